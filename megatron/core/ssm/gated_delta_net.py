"""Megatron-core's ``GatedDeltaNet``: the gated linear attention of Qwen3-Next, in plain PyTorch.

``in_proj`` (column-parallel) makes ``[q, k, v, z, beta, alpha]`` per position; ``q, k, v`` pass a short
causal depthwise convolution and SiLU; ``q`` and ``k`` are L2-normalized per head; the gated delta rule
(``gated_delta_rule.py``) mixes over time with write strength ``beta = sigmoid(beta)`` and decay
``g = -exp(A_log) * softplus(alpha + dt_bias)``; its output is RMS-normalized per value head
(``out_norm``), gated by ``silu(z)`` and projected back by ``out_proj`` (row-parallel).

Tensor parallelism splits the heads: each rank holds ``num_key_heads / tp`` key heads and the value heads
that read them; its ``in_proj`` rows are its own ``[q, k, v, z, beta, alpha]`` pieces and its convolution
channels its own ``[q, k, v]`` (Megatron-core's local layout; ``rank_major_sections`` names them for
converters), ``A_log`` and ``dt_bias`` its heads. ``out_norm`` (one ``[value_head_dim]`` weight) is
replicated: each rank's gradient covers its heads only, so it is marked like a sequence-parallel weight and
``finalize_model_grads`` sums it over TP. Under sequence parallelism ``in_proj`` gathers the sequence and
``out_proj`` scatters it back, as for attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.ssm.gated_delta_rule import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_step
from megatron.core.ssm.mamba_mixer import _rank_major, causal_conv, full_conv_weight, shard_rows
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class GatedDeltaNetSubmodules:
    """The two projections (Megatron-core's field names; its ``out_norm`` is always ``config.normalization``'s)."""

    in_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    out_proj: Union[ModuleSpec, type] = RowParallelLinear


@dataclass(frozen=True)
class GDNDims:
    """Global sizes of a GDN layer."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int

    @property
    def qk_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def v_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    def in_proj_sections(self, tp: int = 1) -> List[int]:
        """Rows of ``q, k, v, z, beta, alpha`` in one rank's ``in_proj`` output."""
        qk, v, h = self.qk_dim // tp, self.v_dim // tp, self.num_value_heads // tp
        return [qk, qk, v, v, h, h]

    def conv_sections(self, tp: int = 1) -> List[int]:
        """Channels of ``q, k, v`` in one rank's convolution."""
        return self.in_proj_sections(tp)[:3]


def gdn_dims(config: TransformerConfig) -> GDNDims:
    """The GDN sizes of ``config`` (``linear_*`` fields)."""
    return GDNDims(
        config.linear_num_key_heads, config.linear_num_value_heads,
        config.linear_key_head_dim, config.linear_value_head_dim,
    )  # fmt: skip


class GatedDeltaNet(MegatronModule):
    """Gated DeltaNet: ``[s(/tp with SP), b, h]`` -> (``[s(/tp), b, h]``, None).

    Megatron-core's arguments; ``bias`` must stay False; ``use_qk_l2norm`` False leaves queries and keys
    unnormalized. ``chunk_size`` only changes how the rule is computed, not its result.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: GatedDeltaNetSubmodules,
        layer_number: Optional[int] = None,
        bias: bool = False,
        conv_bias: bool = False,
        conv_init: Optional[float] = None,
        use_qk_l2norm: bool = True,
        A_init_range: Tuple[float, float] = (1, 16),
        pg_collection: Optional[ProcessGroupCollection] = None,
        chunk_size: int = 64,
    ) -> None:
        super().__init__(config)
        if bias:
            raise NotImplementedError("GatedDeltaNet: bias=True not supported (Megatron-core's specs use none)")
        groups = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
        self.pg_collection, self.layer_number, self.chunk_size = groups, layer_number, chunk_size
        self.use_qk_l2norm, self.dims = use_qk_l2norm, gdn_dims(config)
        self.tp = tp = groups.size_of("tp")
        sections = self.dims.in_proj_sections()
        self.in_proj = build_module(
            submodules.in_proj, config.hidden_size, sum(sections), config=config,
            init_method=_rank_major(config.init_method, sections, tp), bias=False, gather_output=False,
            tp_group=groups.tp,
        )  # fmt: skip
        self.out_proj = build_module(
            submodules.out_proj, self.dims.v_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
            skip_bias_add=True, tp_group=groups.tp,
        )  # fmt: skip
        conv_dim, d_conv = sum(self.dims.conv_sections(tp)), config.linear_conv_kernel_dim
        self.conv1d = torch.nn.Conv1d(
            conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1, bias=conv_bias,
            dtype=config.params_dtype, device="meta",
        ).to_empty(device="cpu")  # fmt: skip
        self.out_norm = build_norm(config, self.dims.value_head_dim)
        for param in self.out_norm.parameters():  # replicated, but each rank's gradient covers its heads only
            param.sequence_parallel = True
        self._init_parameters(conv_init, A_init_range, groups.rank_in("tp"))
        for param in (*self.conv1d.parameters(), self.dt_bias, self.A_log):
            set_tensor_model_parallel_attributes(param, True, 0, 1)

    def _init_parameters(self, conv_init: Optional[float], a_range: Tuple[float, float], rank: int) -> None:
        """Megatron-core's initial values (``dt_bias`` ones, ``A`` uniform in ``a_range``), drawn for all
        heads/channels and sliced to this rank's, so that they do not depend on the TP size."""
        d, tp, dtype = self.dims, self.tp, self.config.params_dtype
        conv = self.dims.conv_sections()
        full = full_conv_weight(sum(conv), self.conv1d.kernel_size[0], conv_init)
        with torch.no_grad():
            self.conv1d.weight.copy_(shard_rows(full, conv, rank, tp))
            if self.conv1d.bias is not None:
                self.conv1d.bias.zero_()
        heads = slice(rank * d.num_value_heads // tp, (rank + 1) * d.num_value_heads // tp)
        self.dt_bias = torch.nn.Parameter(torch.ones(d.num_value_heads // tp, dtype=dtype))
        # Cloned: a parameter that viewed the slice would keep every head's storage alive on every rank.
        self.A_log = torch.nn.Parameter(
            torch.log(torch.empty(d.num_value_heads).uniform_(*a_range))[heads].to(dtype).clone()
        )

    def rank_major_sections(self) -> Dict[str, List[int]]:
        """Parameters whose TP shards hold a piece of each of several sections (global sizes), by name."""
        conv = self.dims.conv_sections()
        names = {"in_proj.weight": self.dims.in_proj_sections(), "conv1d.weight": conv}
        if self.conv1d.bias is not None:
            names["conv1d.bias"] = conv
        return names

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        key_value_states: Optional[torch.Tensor] = None,
        inference_context: Optional[Any] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[Any] = None,
        sequence_len_offset: Optional[int] = None,
        *,
        rotary_pos_emb: Optional[Any] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``[s(/tp), b, h]`` -> (``[s(/tp), b, h]``, None). Causal by construction: ``attention_mask`` and
        ``rotary_pos_emb`` (attention's inputs) are not read. ``inference_context``: a static context whose
        ``ssm_cache_for(self)`` holds the convolution inputs and the recurrent state this call continues."""
        for name, value in (("key_value_states", key_value_states), ("attention_bias", attention_bias)):
            if value is not None:
                raise NotImplementedError(f"GatedDeltaNet: {name} not supported")
        if packed_seq_params is not None:
            raise NotImplementedError("GatedDeltaNet: packed_seq_params (packed sequences) not supported yet")
        mixed, _ = self.in_proj(hidden_states)  # [s, b, P/tp]
        cache = None if inference_context is None else inference_context.ssm_cache_for(self)
        out = self._mix(mixed.transpose(0, 1), cache)  # [b, s, v_dim/tp]
        return self.out_proj(out.transpose(0, 1).contiguous())  # [s(/tp), b, h], None

    def _mix(self, mixed: torch.Tensor, cache: Optional[Any]) -> torch.Tensor:
        """``[b, s, P/tp]`` -> ``[b, s, v_dim/tp]``: convolution, gates, the delta rule, gated norm."""
        b, s, _ = mixed.shape
        d, tp = self.dims, self.tp
        _, _, _, z_rows, heads, _ = d.in_proj_sections(tp)
        qkv, z, beta, alpha = torch.split(mixed, [sum(d.conv_sections(tp)), z_rows, heads, heads], -1)
        qkv = F.silu(causal_conv(qkv, self.conv1d, cache))  # [b, s, conv/tp]
        q, k, v = torch.split(qkv, d.conv_sections(tp), dim=-1)
        q, k = q.unflatten(-1, (-1, d.key_head_dim)), k.unflatten(-1, (-1, d.key_head_dim))  # [b, s, hk/tp, dk]
        v = v.unflatten(-1, (-1, d.value_head_dim))  # [b, s, hv/tp, dv]
        if self.use_qk_l2norm:
            q, k = l2norm(q.float()), l2norm(k.float())
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias.float())  # [b, s, hv/tp]
        beta = beta.float().sigmoid()  # [b, s, hv/tp]
        state = None if cache is None else cache.ssm_state
        if state is not None and s == 1:
            y, state = recurrent_gated_delta_step(state, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
            y = y[:, None]  # [b, 1, hv/tp, dv]
        else:
            y, state = chunk_gated_delta_rule(q, k, v, g, beta, self.chunk_size, state)  # [b, s, hv/tp, dv]
        if cache is not None:
            cache.ssm_state = state.detach()
        normed = self.out_norm(y.to(mixed.dtype))  # [b, s, hv/tp, dv]
        gated = normed.float() * F.silu(z.unflatten(-1, (-1, d.value_head_dim)).float())
        return gated.to(mixed.dtype).flatten(-2)  # [b, s, v_dim/tp]
