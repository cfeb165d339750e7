"""Layer specs: which module class builds each part of a layer, chosen once per model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Type, Union

import torch


@dataclass
class ModuleSpec:
    """A module class, keyword arguments for it, and specs of its own submodules."""

    module: Union[Type[torch.nn.Module], type]
    params: Dict[str, Any] = field(default_factory=dict)
    submodules: Optional[Any] = None


def build_module(spec: Union[ModuleSpec, type], *args: Any, **kwargs: Any) -> torch.nn.Module:
    """Instantiate ``spec`` (a ModuleSpec or a bare class) with the given arguments.

    A ModuleSpec's ``submodules`` are passed as the ``submodules`` keyword when set.
    """
    if isinstance(spec, ModuleSpec):
        if spec.submodules is not None:
            kwargs["submodules"] = spec.submodules
        return spec.module(*args, **spec.params, **kwargs)
    return spec(*args, **kwargs)
