"""Megatron-core's ``MambaMixer``: the Mamba-2 token mixer in plain PyTorch.

``in_proj`` (column-parallel) makes ``[z, x, B, C, dt]`` per position; ``x, B, C`` pass a short causal
depthwise convolution and SiLU; the selective scan (``ssd.py``) mixes ``x`` over time; the output is
normalized with a gate (``y * silu(z)``, RMS over each group's channels) and projected back by
``out_proj`` (row-parallel). Under tensor parallelism every rank holds ``nheads / tp`` heads and
``ngroups / tp`` groups: each rank's ``in_proj`` rows are its own ``[z, x, B, C, dt]`` pieces, as in
Megatron-core's local tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.ssm.ssd import ssd_chunked_scan, ssd_step
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import refuse_unimplemented

GATED_NORM_EPS = 1e-5  # Megatron-core's fixed epsilon of the mixer's gated RMSNorm


@dataclass
class MambaMixerSubmodules:
    """The two projections (Megatron-core's field names)."""

    in_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    out_proj: Union[ModuleSpec, type] = RowParallelLinear


@dataclass(frozen=True)
class MambaDims:
    """The mixer's global sizes and how ``tp`` ranks split them."""

    d_inner: int
    nheads: int
    ngroups: int
    d_state: int
    headdim: int

    def in_proj_sections(self, tp: int = 1) -> List[int]:
        """Rows of ``z, x, B, C, dt`` in one rank's ``in_proj`` output."""
        bc = self.ngroups * self.d_state // tp
        return [self.d_inner // tp, self.d_inner // tp, bc, bc, self.nheads // tp]

    def conv_sections(self, tp: int = 1) -> List[int]:
        """Channels of ``x, B, C`` in one rank's convolution."""
        return self.in_proj_sections(tp)[1:4]


def mamba_dims(config: TransformerConfig, expand: int = 2) -> MambaDims:
    """Sizes from ``config`` (``mamba_num_heads`` or ``expand * hidden_size / mamba_head_dim`` heads)."""
    headdim = config.mamba_head_dim
    if config.mamba_num_heads is None and (expand * config.hidden_size) % headdim:
        raise ValueError(
            f"{expand} * hidden_size={config.hidden_size} must be divisible by mamba_head_dim={headdim} "
            "(or set mamba_num_heads)"
        )
    nheads = config.mamba_num_heads or expand * config.hidden_size // headdim
    return MambaDims(nheads * headdim, nheads, config.mamba_num_groups, config.mamba_state_dim, headdim)


def shard_rows(full: torch.Tensor, sections: List[int], rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a tensor whose rows are ``sections`` (global sizes), each split over ``tp``."""
    pieces = torch.split(full, sections, dim=0)
    return torch.cat([piece.chunk(tp, dim=0)[rank] for piece in pieces], dim=0)


def gather_rows(shards: List[torch.Tensor], sections: List[int]) -> torch.Tensor:
    """The inverse of ``shard_rows``: the full tensor from every rank's rows (in rank order)."""
    tp = len(shards)
    local = [s // tp for s in sections]
    parts = [torch.split(shard, local, dim=0) for shard in shards]
    return torch.cat([torch.cat([p[i] for p in parts], dim=0) for i in range(len(sections))], dim=0)


def _rank_major(init_method: Callable[[torch.Tensor], torch.Tensor], sections: List[int], tp: int) -> Callable:
    """``init_method`` for a full ``[z, x, B, C, dt]`` weight, its rows reordered so that the contiguous
    TP split of a column-parallel layer hands each rank its ``shard_rows`` (a TP-size-invariant model
    under CPU initialization). Without it each rank draws its own shard, which needs no reordering."""

    def init_(weight: torch.Tensor) -> torch.Tensor:
        init_method(weight)
        if weight.shape[0] != sum(sections) or tp == 1:
            return weight
        with torch.no_grad():
            return weight.copy_(torch.cat([shard_rows(weight, sections, r, tp) for r in range(tp)]))

    return init_


class RMSNormGated(torch.nn.Module):
    """``rmsnorm(y * silu(z))`` over groups of ``group_size`` channels, times ``weight`` (fp32 inside)."""

    def __init__(self, hidden_size: int, group_size: int, dtype: torch.dtype, eps: float = GATED_NORM_EPS) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``y``, ``z`` ``[..., d]`` -> ``[..., d]`` in ``y``'s dtype."""
        gated = y.float() * F.silu(z.float())
        grouped = gated.unflatten(-1, (-1, self.group_size))  # [..., groups, group_size]
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.flatten(-2).to(y.dtype)


def _softplus_inverse(t: torch.Tensor) -> torch.Tensor:
    return t + torch.log(-torch.expm1(-t))


class MambaMixer(MegatronModule):
    """The Mamba-2 mixer: ``[s(/tp with SP), b, h]`` -> (``[s(/tp), b, h]``, bias or None).

    Megatron-core's arguments; ``bias`` and ``norm_before_gate`` must stay False and ``rmsnorm`` True
    (as Megatron-core asserts), and ``D_has_hdim`` gives ``D`` one value per channel instead of per head.
    ``chunk_size`` only changes how the scan is computed, not its result.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MambaMixerSubmodules,
        d_model: int,
        d_conv: int = 4,
        conv_init: Optional[float] = None,
        expand: int = 2,
        A_init_range: Tuple[float, float] = (1, 16),
        D_has_hdim: bool = False,
        rmsnorm: bool = True,
        norm_before_gate: bool = False,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init: str = "random",
        dt_scale: float = 1.0,
        dt_init_floor: float = 1e-4,
        bias: bool = False,
        conv_bias: bool = True,
        chunk_size: int = 128,
        layer_number: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        pp_layer_offset: int = 0,
    ) -> None:
        super().__init__(config)
        refuse_unimplemented(
            "MambaMixer",
            rmsnorm=(rmsnorm, True),
            norm_before_gate=(norm_before_gate, False),
            bias=(bias, False),
            dt_init=(dt_init, "random"),
            dt_scale=(dt_scale, 1.0),
        )
        groups = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
        if groups.size_of("cp") > 1:  # the scan would restart on every rank's chunk of the sequence
            raise NotImplementedError(
                f"MambaMixer: context parallelism (context_parallel_size={groups.size_of('cp')}) not supported yet"
            )
        self.pg_collection, self.layer_number, self.chunk_size = groups, layer_number, chunk_size
        self.dims = dims = mamba_dims(config, expand)
        self.tp = tp = groups.size_of("tp")
        _check_split(dims, tp)
        self.nheads_local, self.ngroups_local = dims.nheads // tp, dims.ngroups // tp
        self.d_inner_local, self.d_conv, self.D_has_hdim = dims.d_inner // tp, d_conv, D_has_hdim
        self.in_proj = build_module(
            submodules.in_proj, d_model, sum(dims.in_proj_sections()), config=config,
            init_method=_rank_major(config.init_method, dims.in_proj_sections(), tp), bias=False,
            gather_output=False, tp_group=groups.tp,
        )  # fmt: skip
        self.out_proj = build_module(
            submodules.out_proj, dims.d_inner, d_model, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
            skip_bias_add=True, tp_group=groups.tp,
        )  # fmt: skip
        conv_dim = sum(dims.conv_sections(tp))
        # Built on the meta device: its own initialization would draw a TP-size-dependent amount of random numbers.
        self.conv1d = torch.nn.Conv1d(
            conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1, bias=conv_bias,
            dtype=config.params_dtype, device="meta",
        ).to_empty(device="cpu")  # fmt: skip
        self._init_ssm_parameters(conv_init, A_init_range, (dt_min, dt_max, dt_init_floor), groups.rank_in("tp"))
        self.norm = RMSNormGated(self.d_inner_local, self.d_inner_local // self.ngroups_local, config.params_dtype)
        for param in (*self.conv1d.parameters(), self.dt_bias, self.A_log, self.D, self.norm.weight):
            set_tensor_model_parallel_attributes(param, True, 0, 1)

    def rank_major_sections(self) -> Dict[str, List[int]]:
        """Parameters whose TP shards hold a piece of each of several sections (global sizes), by name:
        ``shard_rows`` / ``gather_rows`` split and join them (checkpoint converters, tests)."""
        conv = self.dims.conv_sections()
        names = {"in_proj.weight": self.dims.in_proj_sections(), "conv1d.weight": conv}
        if self.conv1d.bias is not None:
            names["conv1d.bias"] = conv
        return names

    def _init_ssm_parameters(
        self, conv_init: Optional[float], a_range: Tuple[float, float], dt_range: Tuple[float, float, float], rank: int
    ) -> None:
        """Megatron-core's initial values, drawn for all heads/channels and sliced to this rank's (so they
        do not depend on the TP size)."""
        d, tp, dtype = self.dims, self.tp, self.config.params_dtype
        conv_full = full_conv_weight(sum(d.conv_sections()), self.d_conv, conv_init)
        bound = 1 / math.sqrt(self.d_conv)  # nn.Conv1d's bias bound (fan_in = d_conv)
        conv_bias_full = torch.empty(sum(d.conv_sections())).uniform_(-bound, bound)
        with torch.no_grad():
            self.conv1d.weight.copy_(shard_rows(conv_full, d.conv_sections(), rank, tp))
            if self.conv1d.bias is not None:
                self.conv1d.bias.copy_(shard_rows(conv_bias_full, d.conv_sections(), rank, tp))
        dt_min, dt_max, floor = dt_range
        dt = torch.exp(torch.rand(d.nheads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
        heads = slice(rank * self.nheads_local, (rank + 1) * self.nheads_local)
        # Cloned: a parameter that viewed the slice would keep every head's storage alive on every rank.
        self.dt_bias = torch.nn.Parameter(_softplus_inverse(dt)[heads].to(dtype).clone())
        self.A_log = torch.nn.Parameter(torch.log(torch.empty(d.nheads).uniform_(*a_range))[heads].clone())  # fp32
        self.D = torch.nn.Parameter(torch.ones(self.d_inner_local if self.D_has_hdim else self.nheads_local))  # fp32

    def forward(
        self,
        hidden_states: torch.Tensor,
        inference_context: Optional[object] = None,
        *,
        packed_seq_params: Optional[object] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``[s(/tp), b, h]`` -> (``[s(/tp), b, h]``, None). ``inference_context``: a static context whose
        ``ssm_cache_for(self)`` (``megatron.core.inference.contexts.MambaStates``) the call continues and updates:
        several positions run the chunked scan from the cached state, one position a single recurrence step."""
        if packed_seq_params is not None:
            raise NotImplementedError("MambaMixer: packed_seq_params (packed sequences) not supported yet")
        zxbcdt, _ = self.in_proj(hidden_states)  # [s, b, P/tp]
        cache = None if inference_context is None else inference_context.ssm_cache_for(self)
        y = self._mix(zxbcdt.transpose(0, 1), cache)  # [b, s, d_inner/tp]
        return self.out_proj(y.transpose(0, 1).contiguous())  # [s(/tp), b, h], None

    def _mix(self, zxbcdt: torch.Tensor, cache: Optional[object]) -> torch.Tensor:
        """``[b, s, P/tp]`` -> ``[b, s, d_inner/tp]``: convolution, scan, skip, gated norm."""
        b, s, _ = zxbcdt.shape
        z, xbc, dt = torch.split(
            zxbcdt, [self.d_inner_local, sum(self.dims.conv_sections(self.tp)), self.nheads_local], -1
        )
        xbc = F.silu(causal_conv(xbc, self.conv1d, cache))  # [b, s, conv_dim/tp]
        x, B, C = torch.split(xbc, self.dims.conv_sections(self.tp), dim=-1)
        x = x.unflatten(-1, (self.nheads_local, -1))  # [b, s, h/tp, p]
        B, C = B.unflatten(-1, (self.ngroups_local, -1)), C.unflatten(-1, (self.ngroups_local, -1))  # [b, s, g/tp, n]
        dt = F.softplus(dt.float() + self.dt_bias.float())  # [b, s, h/tp]
        A = -torch.exp(self.A_log.float())  # [h/tp]
        if cache is not None and cache.ssm_state is not None and s == 1:
            y = ssd_step(cache.ssm_state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])[:, None]  # [b, 1, h/tp, p]
        else:
            initial = None if cache is None else cache.ssm_state
            y, final = ssd_chunked_scan(x, dt, A, B, C, self.chunk_size, initial)  # [b, s, h/tp, p]
            if cache is not None:
                cache.ssm_state = final
        D = self.D.float().view(self.nheads_local, -1) if self.D_has_hdim else self.D.float()[:, None]
        y = y + x.float() * D  # [b, s, h/tp, p]
        return self.norm(y.flatten(-2).to(z.dtype), z)  # [b, s, d_inner/tp]


def full_conv_weight(channels: int, d_conv: int, conv_init: Optional[float]) -> torch.Tensor:
    """A depthwise convolution's initial weight ``[channels, 1, d_conv]`` for all channels (TP-size-invariant):
    uniform in ``+-conv_init``, else ``nn.Conv1d``'s default."""
    weight = torch.empty(channels, 1, d_conv)
    if conv_init is not None:
        return torch.nn.init.uniform_(weight, -conv_init, conv_init)
    return torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def causal_conv(x: torch.Tensor, conv1d: torch.nn.Conv1d, cache: Optional[object]) -> torch.Tensor:
    """Causal depthwise convolution ``[b, s, c]`` -> ``[b, s, c]`` (``conv1d`` padded by ``d_conv - 1``); with a
    cache (``conv_state``), continues from its last ``d_conv - 1`` inputs and stores the new ones."""
    s, d_conv = x.shape[1], conv1d.kernel_size[0]
    inputs = x.transpose(1, 2)  # [b, c, s]
    if cache is None:
        return conv1d(inputs)[..., :s].transpose(1, 2)
    past = cache.conv_state if cache.conv_state is not None else inputs.new_zeros(*inputs.shape[:2], d_conv - 1)
    inputs = torch.cat([past, inputs], dim=-1)  # [b, c, d_conv - 1 + s]
    cache.conv_state = inputs[..., -(d_conv - 1) :].detach().clone()
    out = F.conv1d(inputs, conv1d.weight, conv1d.bias, groups=inputs.shape[1])  # [b, c, s]
    return out.transpose(1, 2)


def _check_split(dims: MambaDims, tp: int) -> None:
    """Raise unless heads and groups split evenly (errors name the config fields)."""
    if dims.nheads % dims.ngroups:
        raise ValueError(f"mamba heads ({dims.nheads}) must be divisible by mamba_num_groups={dims.ngroups}")
    for name, value in (("mamba heads", dims.nheads), ("mamba_num_groups", dims.ngroups)):
        if value % tp:
            raise ValueError(f"{name}={value} must be divisible by tensor_model_parallel_size={tp}")
