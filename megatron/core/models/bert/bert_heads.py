"""BERT's heads: the masked-LM transform (``BertLMHead``) and the first-token ``Pooler``.

Both are replicated over tensor-parallel ranks (plain ``torch.nn.Linear``, as in Megatron-core).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.transformer_config import TransformerConfig


def replicated_linear(in_features: int, out_features: int, config: TransformerConfig) -> torch.nn.Linear:
    """A ``torch.nn.Linear`` with ``config.init_method`` weights and a zero bias (Megatron's ``get_linear_layer``)."""
    layer = torch.nn.Linear(in_features, out_features, dtype=config.params_dtype)
    if config.perform_initialization:
        config.init_method(layer.weight)
    with torch.no_grad():
        layer.bias.zero_()
    return layer


class BertLMHead(MegatronModule):
    """``layer_norm(gelu(dense(x)))`` on ``[s(/tp with SP), b, h]``, before the output layer.

    The gelu is ``F.gelu`` (exact, erf), as Megatron's and Hugging Face's ``"gelu"``. Under
    sequence parallelism each TP rank transforms its own tokens, so the dense weights are marked
    ``sequence_parallel`` (their gradients are summed over TP, as the norm's are).
    """

    def __init__(self, hidden_size: int, config: TransformerConfig) -> None:
        super().__init__(config)
        self.dense = replicated_linear(hidden_size, hidden_size, config)
        for param in self.dense.parameters():
            param.sequence_parallel = config.sequence_parallel
        self.layer_norm = build_norm(config, hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(F.gelu(self.dense(hidden_states)))  # [s(/tp), b, h]


class Pooler(MegatronModule):
    """``tanh(dense(x[sequence_index]))``: ``[s(/tp with SP), b, h]`` -> ``[b, h]``.

    Under sequence parallelism the sequence is first all-gathered over ``tp_group``; every TP rank
    then computes the same pooled output, so the gather's backward keeps only this rank's slice of
    the (identical) gradient rather than summing it.
    """

    def __init__(
        self,
        hidden_size: int,
        config: TransformerConfig,
        sequence_parallel: bool = False,
        *,
        tp_group: torch.distributed.ProcessGroup,
    ) -> None:
        super().__init__(config)
        self.dense = replicated_linear(hidden_size, hidden_size, config)
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden_states: torch.Tensor, sequence_index: int = 0) -> torch.Tensor:
        if self.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.tp_group
            )  # [s, b, h]
        return torch.tanh(self.dense(hidden_states[sequence_index]))  # [b, h]
