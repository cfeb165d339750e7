"""The activation functions of the models, by name: one registry for the flags, the T5 spec and the converters.

``gelu_tanh`` is GeLU with the tanh approximation: Megatron's ``openai_gelu`` (the original GPT's),
Hugging Face's ``gelu_new`` and T5 v1.1's gate activation are all this one function.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor], torch.Tensor]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GeLU with the tanh approximation."""
    return F.gelu(x, approximate="tanh")


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (Primer's activation)."""
    return torch.pow(F.relu(x), 2)


ACTIVATIONS: Dict[str, Activation] = {
    "gelu": F.gelu,
    "gelu_tanh": gelu_tanh,
    "silu": F.silu,
    "squared_relu": squared_relu,
}


def activation(name: str) -> Activation:
    """The registered activation called ``name``."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r}: must be one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def activation_name(swiglu: bool = False, squared_relu: bool = False, openai_gelu: bool = False) -> str:
    """The activation Megatron's three model switches choose (at most one set): ``swiglu`` (SiLU, gated),
    ``squared_relu``, ``openai_gelu`` (GeLU, tanh approximation); none of them: exact GeLU."""
    chosen = {"swiglu": swiglu, "squared_relu": squared_relu, "openai_gelu": openai_gelu}
    given = [f"{name}=True" for name, on in chosen.items() if on]
    if len(given) > 1:
        raise ValueError(f"choose one activation, got {', '.join(given)}")
    if swiglu:
        return "silu"
    if squared_relu:
        return "squared_relu"
    return "gelu_tanh" if openai_gelu else "gelu"
