"""The feed-forward block: h -> ffn (column parallel) -> activation -> h (row parallel)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.extensions.transformer_engine import is_te_linear
from megatron.core.fusions.fused_activations import fused_activation, fused_swiglu
from megatron.core.parallel_state import ProcessGroupCollection, get_tensor_model_parallel_group_if_none
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class MLPSubmodules:
    """Megatron-core's parts of the MLP; the defaults are the layers this module builds.

    Only these exist here, so another class raises ``NotImplementedError`` naming the field; the
    activation is ``config.activation_func`` (``activation_func`` must stay None).
    """

    linear_fc1: Any = ColumnParallelLinear
    activation_func: Any = None
    linear_fc2: Any = RowParallelLinear

    def check(self) -> None:
        """Raise unless every part is one this module builds."""
        for name, cls, mode in (
            ("linear_fc1", ColumnParallelLinear, "column"),
            ("linear_fc2", RowParallelLinear, "row"),
        ):
            value = getattr(self, name)
            if value not in (cls, None) and not is_te_linear(value, mode):
                raise NotImplementedError(
                    f"MLPSubmodules.{name}={value!r}: only {cls.__name__} or Transformer Engine's {mode}-parallel one"
                )
        if self.activation_func is not None:
            raise NotImplementedError(
                f"MLPSubmodules.activation_func={self.activation_func!r}: not supported yet; set config.activation_func"
            )


def apply_activation(config: TransformerConfig, intermediate: torch.Tensor) -> torch.Tensor:
    """fc1's output ``[..., f]`` (gated: ``[..., 2f]``, gate then up) -> ``[..., f]``: ``act(x)``, or
    ``act(gate) * up``; with ``config.activation_func_clamp_value`` c (DeepSeek-V4's ``swiglu_limit``)
    the gate is clamped to ``<= c`` and the up half to ``[-c, c]`` first."""
    if not config.gated_linear_unit:
        return config.activation_func(intermediate)
    gate, up = torch.chunk(intermediate, 2, dim=-1)  # [..., f] each
    limit = config.activation_func_clamp_value
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return config.activation_func(gate) * up


class MLP(MegatronModule):
    """``act(x W1 + b1) W2 + b2``, or with ``gated_linear_unit`` ``(act(x Wg) * x Wu) W2`` (SwiGLU).

    For gated units the first projection holds the gate and the up projection stacked;
    it is split over TP with stride 2 so every rank gets matching halves of both.

    Megatron-core's signature: ``submodules`` (``MLPSubmodules``, checked), ``input_size`` (default
    ``hidden_size``; the output is ``hidden_size``), and the group: ``tp_group``, else ``pg_collection``'s
    TP group (its expert-TP group with ``is_expert``), else ``parallel_state``'s for library callers.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Optional[MLPSubmodules] = None,
        is_expert: bool = False,
        input_size: Optional[int] = None,
        ffn_hidden_size: Optional[int] = None,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        *,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config)
        submodules = submodules or MLPSubmodules()
        submodules.check()
        if tp_group is None and pg_collection is not None:
            tp_group = pg_collection.expt_tp if is_expert else pg_collection.tp
        tp_group = get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)
        ffn = ffn_hidden_size or config.ffn_hidden_size
        gated = config.gated_linear_unit
        self.linear_fc1 = (submodules.linear_fc1 or ColumnParallelLinear)(
            input_size or config.hidden_size,
            2 * ffn if gated else ffn,
            config=config,
            init_method=config.init_method,
            bias=config.add_bias_linear,
            gather_output=False,
            skip_bias_add=False,  # the bias joins fc1's GEMM (addmm): no separate pass over [s, b, ffn/tp]
            stride=2 if gated else 1,
            is_expert=is_expert,
            tp_group=tp_group,
        )
        self.linear_fc2 = (submodules.linear_fc2 or RowParallelLinear)(
            ffn,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=is_expert,
            tp_group=tp_group,
        )

    def forward(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``[s, b, h]`` -> (``[s, b, h]``, bias of the last projection or None)."""
        intermediate, _ = self.linear_fc1(hidden_states)  # [s, b, ffn/tp] (x2 when gated), bias included
        return self.linear_fc2(self._activation(intermediate))  # [s, b, ffn/tp] into fc2

    def _activation(self, intermediate: torch.Tensor) -> torch.Tensor:
        """``[s, b, ffn/tp]`` (``[s, b, 2 ffn/tp]`` gated) -> ``[s, b, ffn/tp]``; fused with
        ``config.bias_activation_fusion`` (``--no-bias-swiglu-fusion`` / ``--no-bias-gelu-fusion`` turn it off),
        else (and with a clamp) ``apply_activation``."""
        config = self.config
        if config.bias_activation_fusion and config.activation_func_clamp_value is None:
            if config.gated_linear_unit and config.activation_func is F.silu:
                return fused_swiglu(intermediate)
            if not config.gated_linear_unit:
                return fused_activation(intermediate, config.activation_func)
        return apply_activation(config, intermediate)
