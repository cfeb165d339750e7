"""Self-attention: fused QKV projection (column parallel), core attention, output projection (row parallel)."""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core.context_parallel import cp_chunk_positions, gather_kv_over_cp, packed_cp_indices
from megatron.core.extensions.transformer_engine import is_te_linear
from megatron.core.fusions.fused_softmax import fused_scale_mask_softmax, scale_mask_softmax
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint, get_cuda_rng_tracker
from megatron.core.transformer.cp_attention import RING_SCHEMES, context_parallel_attention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.masks import build_attention_mask
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import LayerNorm, Norm, RMSNorm, build_norm
from megatron.core.transformer.packed_attention import packed_segments
from megatron.core.transformer.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.tiled_attention import Visibility
from megatron.core.transformer.transformer_config import CP_COMM_TYPES, TransformerConfig

_SDPA_BACKENDS = ("auto", "flash", "fused")
FLASH_HEAD_DIM_MAX = 256  # PyTorch's flash kernel pads smaller head dims to a multiple of 8
_flash_warnings: Set[str] = set()  # one warning per distinct case (a CPU run: one in all)


def flash_blockers(
    query: torch.Tensor, mask: Optional[torch.Tensor], value: Optional[torch.Tensor] = None
) -> List[str]:
    """Why PyTorch's flash attention cannot run SDPA on ``query`` ``[b, heads, s, d]`` and ``value``
    ``[b, groups, s, dv]`` with ``mask``."""
    reasons = []
    if query.device.type != "cuda":
        reasons.append(f"tensors on {query.device.type}")
    if query.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"dtype {str(query.dtype).replace('torch.', '')} (needs fp16/bf16)")
    if mask is not None:
        reasons.append("an explicit attention mask (padding, sliding window, context parallel or reset masks)")
    if query.shape[-1] > FLASH_HEAD_DIM_MAX:
        reasons.append(f"head dim {query.shape[-1]} (needs <= {FLASH_HEAD_DIM_MAX})")
    if value is not None and value.shape[-1] != query.shape[-1]:
        # PyTorch's flash kernel takes one head size for q, k and v (MLA: values narrower than queries/keys).
        reasons.append(f"value head dim {value.shape[-1]} != query/key head dim {query.shape[-1]}")
    return reasons


def _warn_once(message: str) -> None:
    if message not in _flash_warnings:
        _flash_warnings.add(message)
        warnings.warn(message, stacklevel=3)


def warn_flash_unavailable(reasons: List[str]) -> None:
    """Warn, once per case, that ``--attention-backend flash`` falls back to another kernel."""
    key = reasons[0] if reasons[0].startswith("tensors on") else "; ".join(reasons)
    if key in _flash_warnings:
        return
    _flash_warnings.add(key)
    warnings.warn(
        f"attention_backend=flash: flash attention cannot run here ({'; '.join(reasons)}); "
        "PyTorch picks another kernel (warned once per case)",
        stacklevel=3,
    )


def _dropout_rng(active: bool, sequence_parallel: bool):
    """Fork the model-parallel RNG: attention heads differ per TP rank, so must their masks.

    Under sequence parallelism the block already runs every layer inside that fork (Megatron
    does not fork again there): a nested fork would restart the stream from the state saved at
    the outer fork, and the hidden dropout after attention would redraw the attention mask's
    random numbers.
    """
    return get_cuda_rng_tracker().fork() if active and not sequence_parallel else contextlib.nullcontext()


def repeat_kv(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, groups, s, d]`` -> ``[b, heads, s, d]``: each group's key or value head once per query head."""
    repeat = heads // tensor.shape[1]
    return tensor.repeat_interleave(repeat, dim=1) if repeat > 1 else tensor


class DotProductAttention(MegatronModule):
    """softmax(q k^T * scale + mask) v for this rank's heads.

    Inputs are ``[s, b, heads, d]``; keys and values may have fewer heads (grouped-query
    attention): SDPA takes them as they are (``enable_gqa``) when no explicit mask is needed,
    otherwise they are repeated to match. ``attention_mask`` is boolean with True where
    attention is NOT allowed (Megatron's convention); None means plain causal.
    ``attention_bias`` (T5's relative position bias), broadcastable to ``[b, heads, sq, sk]``, is
    added to the scaled scores before the mask. Values may have another head dim than queries and
    keys (multi-latent attention); ``softmax_scale`` overrides ``config.softmax_scale`` (default
    ``1/sqrt(kv_channels)``).

    With a context-parallel group of size > 1 the inputs are this rank's ``[s/cp, b, ., d]``
    (chunks r and 2cp-1-r, see ``megatron.core.context_parallel``), and ``cp_comm_type`` (else
    ``config.cp_comm_type``, this layer's entry of a list; None: ``p2p`` as Megatron) picks the scheme:
    ``p2p`` (ring), ``a2a`` (Ulysses) and ``a2a+p2p`` (Ulysses inside ``hcp_groups[0]``, the ring over
    ``hcp_groups[1]``) in ``cp_attention``, without whole-sequence keys or masks;
    ``all_gather``: keys and values all-gathered over CP into sequence order, and the causal mask and
    sliding window built from the queries' global positions. A given ``attention_mask`` is then
    ``[b, 1, s/cp, s]`` (this rank's query rows, every key), as ``get_batch_on_this_cp_rank`` slices it.

    ``packed_seq_params`` (``megatron.core.packed_seq_params``): the ``[t, 1, ., d]`` inputs are packed
    sequences, each attending causally to itself only, computed segment by segment without a
    ``[t, t]`` mask (``_packed``, ``packed_attention.packed_segments``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_group: Optional[torch.distributed.ProcessGroup] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        hcp_groups: Optional[List[torch.distributed.ProcessGroup]] = None,
    ) -> None:
        super().__init__(config)
        self.cp_group = cp_group
        self.cp_size = torch.distributed.get_world_size(cp_group) if cp_group is not None else 1
        self.cp_comm_type = layer_cp_comm_type(config, layer_number, cp_comm_type)
        self.hcp_groups = hcp_groups
        if self.cp_size > 1 and self.cp_comm_type == "a2a+p2p" and (hcp_groups is None or len(hcp_groups) != 2):
            raise ValueError(
                "cp_comm_type='a2a+p2p': needs the hierarchical CP groups [a2a, p2p] (hcp_groups; "
                "ProcessGroupCollection.hcp, built from hierarchical_context_parallel_sizes)"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale or config.softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.backend = getattr(config.attention_backend, "name", config.attention_backend)
        self.use_sdpa = self.backend in _SDPA_BACKENDS and not config.apply_query_key_layer_scaling
        if self.backend == "flash" and not self.use_sdpa:
            warn_flash_unavailable(["apply_query_key_layer_scaling=True runs the unfused softmax"])

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        s, b, heads, _ = query.shape
        if packed_seq_params is not None:
            return self._packed(query, key, value, attention_mask, attention_bias, packed_seq_params)
        causal = attention_mask is None and self.attn_mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        if attention_bias is not None and self.cp_size > 1:
            raise NotImplementedError("DotProductAttention: attention_bias with context parallelism")
        if self.cp_size > 1 and self.cp_comm_type in RING_SCHEMES:
            return self._cp_scheme(query, key, value, attention_mask, causal)
        if self.cp_size > 1:
            key, value, attention_mask = self._gather_over_cp(key, value, attention_mask, causal)
            causal = False
        q = query.permute(1, 2, 0, 3)  # [b, heads, sq, d]
        k, v = (t.permute(1, 2, 0, 3) for t in (key, value))  # [b, groups, sk, d]
        dropout_p = self.config.attention_dropout if self.training else 0.0
        if self.config.window_size is not None and self.cp_size == 1:
            attention_mask = self._with_window(attention_mask, causal, q.shape[-2], k.shape[-2], q.device)
            causal = False
        if attention_bias is not None:
            attention_mask = self._additive(
                attention_bias, attention_mask, causal, q, k.shape[-2]
            )  # [b|1, heads, sq, sk]
            causal = False
        with _dropout_rng(dropout_p > 0, self.config.sequence_parallel):
            if self.use_sdpa:
                ctx = self._sdpa(q, k, v, attention_mask, causal, dropout_p)
            else:
                k, v = repeat_kv(k, heads), repeat_kv(v, heads)  # [b, heads, sk, d]
                ctx = self._unfused(q, k, v, attention_mask, causal, dropout_p)
        return ctx.permute(2, 0, 1, 3).reshape(s, b, heads * ctx.shape[-1])  # [s, b, heads*dv]

    def _packed(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: Optional[torch.Tensor],
        bias: Optional[torch.Tensor],
        params: PackedSeqParams,
    ) -> torch.Tensor:
        """Packed row ``[t(/cp), 1, heads, d]``: each sequence attends causally to itself only
        (``packed_attention.packed_segments``), without a ``[t, t]`` mask -> ``[t(/cp), 1, heads*dv]``."""
        t, b, heads, _ = query.shape
        if b != 1 or mask is not None or bias is not None:
            raise NotImplementedError(
                f"packed_seq_params: needs micro batch 1 (got {b}) and no attention_mask or attention_bias"
            )
        if self.attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise NotImplementedError(f"packed_seq_params with attn_mask_type={self.attn_mask_type.name}")
        cu = params.layout_cu_seqlens().to(query.device)
        positions = torch.arange(t, device=query.device)  # [t] packed-row position of each query
        if self.cp_size > 1:
            if self.cp_comm_type != "all_gather":
                _warn_once(f"cp_comm_type={self.cp_comm_type!r}: packed sequences run the all_gather scheme")
            key = gather_kv_over_cp(key, self.cp_group, cu)  # [t, 1, g, d] the whole packed row
            value = gather_kv_over_cp(value, self.cp_group, cu)
            positions = packed_cp_indices(cu, self.cp_size, torch.distributed.get_rank(self.cp_group))  # [t/cp]
        q = query.permute(1, 2, 0, 3)  # [1, heads, t(/cp), d]
        k, v = (x.permute(1, 2, 0, 3) for x in (key, value))  # [1, g, t, d]
        dropout_p = self.config.attention_dropout if self.training else 0.0
        pieces = []
        with _dropout_rng(dropout_p > 0, self.config.sequence_parallel):
            for seg in packed_segments(positions, cu, self.config.window_size):
                qs = q[:, :, seg.q_start : seg.q_end]  # [1, heads, q, d]
                ks, vs = k[:, :, seg.k_start : seg.k_end], v[:, :, seg.k_start : seg.k_end]  # [1, g, k, d]
                if self.use_sdpa:
                    pieces.append(self._sdpa(qs, ks, vs, seg.mask, seg.mask is None, dropout_p))
                else:
                    ks, vs = repeat_kv(ks, heads), repeat_kv(vs, heads)  # [1, heads, k, d]
                    pieces.append(self._unfused(qs, ks, vs, seg.mask, seg.mask is None, dropout_p))
        ctx = torch.cat(pieces, dim=2)  # [1, heads, t(/cp), dv]
        return ctx.permute(2, 0, 1, 3).reshape(t, b, heads * ctx.shape[-1])  # [t(/cp), 1, heads*dv]

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Optional[torch.Tensor],
        causal: bool,
        dropout_p: float,
    ) -> torch.Tensor:
        """PyTorch SDPA on ``q`` ``[b, heads, sq, d]``, ``k``/``v`` ``[b, groups, sk, d]`` -> ``[b, heads, sq, d]``.

        Without an explicit mask (plain causal: ``is_causal``) grouped-query heads go in as they are
        (``enable_gqa``), which flash attention takes; with a mask they are repeated, since the
        memory-efficient kernel that takes masks does not do GQA.
        """
        heads = q.shape[1]
        gqa = k.shape[1] != heads
        if gqa and mask is not None:
            k, v, gqa = repeat_kv(k, heads), repeat_kv(v, heads), False
        keep = mask if mask is None or mask.is_floating_point() else ~mask  # SDPA: True = attend, or additive
        with self._sdpa_kernel(q, mask, v):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=keep, dropout_p=dropout_p, is_causal=causal, scale=self.softmax_scale, enable_gqa=gqa
            )

    def _sdpa_kernel(self, q: torch.Tensor, mask: Optional[torch.Tensor], v: Optional[torch.Tensor] = None):
        """``attention_backend=flash``: pin SDPA to flash attention where it can run it (CUDA, fp16/bf16,
        no explicit mask, head dim <= 256 and the same for values), else warn once why not; other
        backends: PyTorch picks."""
        if self.backend != "flash":
            return contextlib.nullcontext()
        reasons = flash_blockers(q, mask, v)
        if reasons:
            warn_flash_unavailable(reasons)
            return contextlib.nullcontext()
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])

    def _cp_scheme(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor], causal: bool
    ) -> torch.Tensor:
        """``p2p``/``a2a`` context parallelism (``cp_attention``) on ``[s/cp, b, ., d]`` -> ``[s/cp, b, heads*dv]``."""
        s, b, heads, _ = query.shape
        q = query.permute(1, 2, 0, 3)  # [b, heads, s/cp, d]
        k, v = (t.permute(1, 2, 0, 3) for t in (key, value))  # [b, groups, s/cp, d]
        vis = Visibility(causal, self.config.window_size)
        p = self.config.attention_dropout if self.training else 0.0
        with _dropout_rng(p > 0, self.config.sequence_parallel):
            dropout = (p, int(torch.randint(2**62, (1,)).item())) if p > 0 else None  # the forked RNG's draw
        ctx = context_parallel_attention(
            q, k, v, self.cp_comm_type, self.cp_group, vis, self.softmax_scale, mask, dropout, self.hcp_groups
        )
        return ctx.permute(2, 0, 1, 3).reshape(s, b, heads * ctx.shape[-1])  # [s/cp, b, heads*dv]

    def _gather_over_cp(
        self, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor], causal: bool
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Whole-sequence keys and values ``[s, b, g, d]`` and the mask of this rank's queries ``[s/cp, s]``."""
        key = gather_kv_over_cp(key, self.cp_group)  # [s, b, g, d]
        value = gather_kv_over_cp(value, self.cp_group)
        rank = torch.distributed.get_rank(self.cp_group)
        positions = cp_chunk_positions(key.shape[0], self.cp_size, rank, key.device)  # [s/cp] global
        blocked = build_attention_mask(
            positions.numel(), key.shape[0], causal, self.config.window_size, query_positions=positions
        )  # [s/cp, s]
        if blocked is None:
            return key, value, mask
        return key, value, blocked if mask is None else mask | blocked

    def _additive(
        self, bias: torch.Tensor, mask: Optional[torch.Tensor], causal: bool, q: torch.Tensor, sk: int
    ) -> torch.Tensor:
        """An additive float mask: ``bias`` (added to the already scaled scores) with the blocked
        positions (``mask``, or causal) at the dtype's minimum. ``q`` is ``[b, heads, sq, d]``."""
        if causal:
            mask = build_attention_mask(q.shape[-2], sk, device=q.device)  # [sq, sk]
        dtype = torch.float32 if self.config.attention_softmax_in_fp32 and not self.use_sdpa else q.dtype
        additive = bias.to(dtype)
        if mask is not None:
            additive = additive.masked_fill(mask, torch.finfo(dtype).min)
        return additive

    def _with_window(
        self, mask: Optional[torch.Tensor], causal: bool, sq: int, sk: int, device: torch.device
    ) -> torch.Tensor:
        """``mask`` (True = blocked) with the sliding window, and the causal mask, folded in.

        The queries are the last ``sq`` of the ``sk`` positions: the same ones when ``sq == sk``, and
        with a KV cache (``sq < sk``) this call's tokens after the cached ones.
        """
        positions = torch.arange(sk - sq, sk, device=device)  # [sq]
        blocked = build_attention_mask(sq, sk, causal, self.config.window_size, query_positions=positions)
        return blocked if mask is None else mask | blocked

    def _unfused(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Optional[torch.Tensor],
        causal: bool,
        dropout_p: float,
    ) -> torch.Tensor:
        """Explicit scores: ``softmax(q k^T * scale + mask) v``, the softmax fused or not (``fused_softmax.py``)."""
        # Query-key layer scaling divides by the layer number before the matmul and
        # multiplies back inside the fp32 softmax: the same result, smaller fp16 scores.
        coeff = float(self.layer_number) if self.config.apply_query_key_layer_scaling else 1.0
        scores = torch.matmul(q, k.transpose(-1, -2))  # [b, heads, sq, sk]
        if causal:
            mask = build_attention_mask(*scores.shape[-2:], device=scores.device)  # [sq, sk]
        softmax = fused_scale_mask_softmax if self.config.masked_softmax_fusion else scale_mask_softmax
        in_fp32 = self.config.attention_softmax_in_fp32
        probs = softmax(scores, mask, self.softmax_scale, coeff, in_fp32, v.dtype)  # [b, heads, sq, sk]
        probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
        return torch.matmul(probs, v)  # [b, heads, s, d]


def cp_groups_of(groups: ProcessGroupCollection) -> Dict[str, object]:
    """``DotProductAttention``'s context-parallel keyword arguments from a collection: ``cp_group`` (None
    without CP) and ``hcp_groups`` (the hierarchical sub-groups, None unless built)."""
    return dict(cp_group=groups.cp if groups.size_of("cp") > 1 else None, hcp_groups=groups.hcp)


def layer_cp_comm_type(config: TransformerConfig, layer_number: int, given: Optional[str] = None) -> str:
    """The context-parallel scheme of layer ``layer_number`` (1-based): ``given``, else ``config.cp_comm_type``
    (one value, or one per layer); None means ``p2p``, Megatron's default; ``allgather`` is ``all_gather``."""
    value = given if given is not None else getattr(config, "cp_comm_type", None)
    if isinstance(value, (list, tuple)):
        value = value[max(1, layer_number) - 1]
    return "all_gather" if value == "allgather" else (value or "p2p")


def run_core_attention(
    attention: MegatronModule,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    packed_seq_params: Optional[PackedSeqParams] = None,
) -> torch.Tensor:
    """``attention.core_attention`` on ``[s, b, heads, d]`` inputs, recomputed in backward under selective
    recomputation (the bias, which carries a gradient, goes in as a checkpointed input)."""
    packed = {} if packed_seq_params is None else {"packed_seq_params": packed_seq_params}
    if not (attention.recompute_core_attention and attention.training):
        return attention.core_attention(query, key, value, mask, bias, **packed)
    if bias is None:
        return checkpoint(lambda q, k, v: attention.core_attention(q, k, v, mask, **packed), False, query, key, value)
    return checkpoint(
        lambda q, k, v, t: attention.core_attention(q, k, v, mask, t, **packed), False, query, key, value, bias
    )


@dataclass
class SelfAttentionSubmodules:
    """Megatron-core's parts of self-attention; the defaults are the layers this module builds.

    Only these layers exist here (Transformer-Engine specs fall back to them), so another class in
    a field raises ``NotImplementedError`` naming it. A ``q_layernorm`` / ``k_layernorm`` entry
    (a norm class such as ``transformer.norms.Norm``) builds the query/key norms.
    """

    linear_qkv: Any = ColumnParallelLinear
    core_attention: Any = None  # DotProductAttention (defined above; None means it)
    linear_proj: Any = RowParallelLinear
    q_layernorm: Any = None
    k_layernorm: Any = None

    def check(self, config: TransformerConfig) -> bool:
        """Raise unless every part is one this module builds; whether query/key norms are asked for."""
        expected = {"linear_qkv": ColumnParallelLinear, "core_attention": DotProductAttention}
        expected["linear_proj"] = RowParallelLinear
        te_modes = {"linear_qkv": "column", "linear_proj": "row"}
        for name, cls in expected.items():
            value = getattr(self, name)
            if value not in (cls, None) and not is_te_linear(value, te_modes.get(name, "")):
                raise NotImplementedError(
                    f"SelfAttentionSubmodules.{name}={value!r}: only {cls.__name__}"
                    + (f" or the Transformer Engine {te_modes[name]}-parallel linear" if name in te_modes else "")
                )
        allowed = (None, Norm, LayerNorm if config.normalization == "LayerNorm" else RMSNorm)
        norms = (self.q_layernorm, self.k_layernorm)
        if any(n not in allowed for n in norms) or (norms[0] is None) != (norms[1] is None):
            raise NotImplementedError(
                f"q_layernorm={self.q_layernorm!r}, k_layernorm={self.k_layernorm!r}: both None or both the norm "
                f"config.normalization={config.normalization!r} names (or Norm)"
            )
        return norms[0] is not None


class SelfAttention(MegatronModule):
    """Multi-head / grouped-query self-attention split over tensor-parallel ranks by query group.

    The fused QKV weight is laid out per query group: for each group, its query heads,
    then one key head, then one value head. A column split therefore hands each TP rank
    whole groups, and no communication is needed until the output projection.

    Megatron-core's signature: ``submodules`` (``SelfAttentionSubmodules``, checked), ``cp_comm_type``
    (this layer's context-parallel scheme; None: ``config.cp_comm_type``),
    and ``pg_collection`` (None: ``parallel_state``'s groups, for library
    callers; the models always pass theirs). ``qk_layernorm`` (from our layer spec) builds query/key
    norms (True) or none (False); None follows the submodules, else ``config.qk_layernorm``. The spec
    may not drop norms the config asks for.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Optional[SelfAttentionSubmodules] = None,
        layer_number: int = 1,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        *,
        qk_layernorm: Optional[bool] = None,
    ) -> None:
        super().__init__(config)
        if cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type={cp_comm_type!r}: must be one of {CP_COMM_TYPES}")
        self.cp_comm_type = cp_comm_type
        spec_norms = (submodules or SelfAttentionSubmodules()).check(config)
        if qk_layernorm is None and submodules is not None:
            qk_layernorm = spec_norms or None
        groups = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
        self._build(config, layer_number, attn_mask_type, groups, qk_layernorm, submodules or SelfAttentionSubmodules())

    def _build(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        groups: ProcessGroupCollection,
        qk_layernorm: Optional[bool],
        submodules: SelfAttentionSubmodules,
    ) -> None:
        tp = groups.size_of("tp")
        self.heads_per_rank = config.num_attention_heads // tp
        self.groups_per_rank = config.num_query_groups // tp
        d = config.kv_channels
        gated = 2 if config.attention_output_gate else 1  # each group's queries, then as many gate columns
        qkv_size = d * (gated * config.num_attention_heads + 2 * config.num_query_groups)
        self.linear_qkv = (submodules.linear_qkv or ColumnParallelLinear)(
            config.hidden_size,
            qkv_size,
            config=config,
            init_method=config.init_method,
            bias=config.add_bias_linear or config.add_qkv_bias,
            gather_output=False,
            tp_group=groups.tp,
        )
        self.core_attention = DotProductAttention(
            config,
            layer_number,
            attn_mask_type,
            cp_comm_type=self.cp_comm_type,
            **cp_groups_of(groups),
        )
        self.linear_proj = (submodules.linear_proj or RowParallelLinear)(
            d * config.num_attention_heads,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            tp_group=groups.tp,
        )
        if qk_layernorm is False and config.qk_layernorm:
            raise ValueError("the layer spec says qk_layernorm=False but TransformerConfig.qk_layernorm=True")
        with_qk_norm = config.qk_layernorm if qk_layernorm is None else qk_layernorm
        self.q_layernorm = build_norm(config, d) if with_qk_norm else None
        self.k_layernorm = build_norm(config, d) if with_qk_norm else None
        for norm in (self.q_layernorm, self.k_layernorm) if with_qk_norm and tp > 1 else ():
            for param in norm.parameters():  # per-head weights: each rank's gradient covers its heads only,
                param.sequence_parallel = True  # summed over TP by finalize_model_grads (as Megatron does)
        self.recompute_core_attention = config.recompute_granularity == "selective"
        self.layer_number = layer_number  # global: names this layer's KV cache

    def split_qkv(self, mixed: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[s, b, groups/tp * (q_per_group + 2) * d]`` -> q ``[s, b, heads/tp, d]``, k, v ``[s, b, groups/tp, d]``."""
        query, _, key, value = self.split_qkv_gate(mixed)
        return query, key, value

    def split_qkv_gate(
        self, mixed: torch.Tensor
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Split the QKV projection into q ``[s, b, heads/tp, d]``, the output gate (``[s, b, heads/tp * d]``,
        None unless ``attention_output_gate``), k and v ``[s, b, groups/tp, d]``.

        Each query group's columns are its queries, then (gated) as many gate columns, then its key and value.
        """
        s, b, _ = mixed.shape
        d = self.config.kv_channels
        q_cols = self.heads_per_rank // self.groups_per_rank * d
        g_cols = q_cols if self.config.attention_output_gate else 0
        mixed = mixed.view(s, b, self.groups_per_rank, q_cols + g_cols + 2 * d)
        q, gate, k, v = torch.split(mixed, [q_cols, g_cols, d, d], dim=-1)
        gate = gate.reshape(s, b, self.heads_per_rank * d) if g_cols else None
        return q.reshape(s, b, self.heads_per_rank, d), gate, k, v

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        attention_bias: Optional[torch.Tensor] = None,
        inference_context: Optional[Any] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``[s(/tp with SP), b, h]`` -> (output ``[s(/tp), b, h]``, output bias or None).

        ``packed_seq_params``: the rows are packed sequences (``megatron.core.packed_seq_params``),
        each attending to itself only; the rotary angles already follow each sequence's positions.

        ``attention_bias`` ``[1|b, heads/tp, s, s]`` is added to the scores (T5's relative position bias).
        ``inference_context`` (a ``megatron.core.inference.StaticInferenceContext``): this call's tokens
        are the positions from its ``sequence_len_offset`` on; their keys and values (rotated) join its
        cache, and the queries attend over every cached position up to their own.
        """
        mixed, _ = self.linear_qkv(hidden_states)  # [s, b, qkv/tp]
        query, gate, key, value = self.split_qkv_gate(mixed)
        if self.q_layernorm is not None:
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        if rotary_pos_emb is not None:
            interleaved = self.config.rotary_interleaved
            fused = self.config.apply_rope_fusion
            query = apply_rotary_pos_emb(query, rotary_pos_emb, interleaved, fused=fused)
            key = apply_rotary_pos_emb(key, rotary_pos_emb, interleaved, fused=fused)
        if inference_context is not None and not inference_context.is_static_batching():
            return self.linear_proj(self._paged(inference_context, query, key, value, attention_mask, attention_bias))
        if inference_context is not None:
            key, value, attention_mask = self._with_kv_cache(inference_context, key, value, attention_mask)
        context = run_core_attention(
            self, query, key, value, attention_mask, attention_bias, packed_seq_params
        )  # [s, b, heads/tp*d]
        if gate is not None:  # in fp32, back to the activation dtype
            context = (context * torch.sigmoid(gate.float())).to(context.dtype)
        return self.linear_proj(context)

    def _paged(
        self,
        inference_context: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: Optional[torch.Tensor],
        bias: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """Attention of a dynamic-batching step (``DynamicInferenceContext``): the flat ``[T, 1, ., d]`` tokens of
        several requests, each over its own cached positions -> ``[T, 1, heads/tp*d]``."""
        self._refuse_in_inference()
        if mask is not None or bias is not None:
            raise NotImplementedError(
                "SelfAttention: a dynamic inference step takes no attention_mask or attention_bias"
            )
        query, key, value, blocked = inference_context.paged_attention_inputs(self.layer_number, query, key, value)
        context = run_core_attention(self, query, key, value, blocked, None)  # [maxq, B, heads/tp*d]
        return inference_context.unpad_attention_output(context)

    def _with_kv_cache(
        self, inference_context: Any, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append ``key``/``value`` ``[s, b, groups/tp, d]`` to the cache; return every cached position's
        ``[offset + s, b, groups/tp, d]`` and the causal mask ``[s, offset + s]`` of this call's queries
        (True = blocked), or-ed with ``mask``."""
        self._refuse_in_inference()
        s = key.shape[0]
        positions = inference_context.query_positions(s, key.device)  # [s]
        key, value = inference_context.append_key_value(self.layer_number, key, value)  # [offset + s, b, g, d]
        blocked = build_attention_mask(s, key.shape[0], query_positions=positions)  # [s, offset + s]
        return key, value, blocked if mask is None else mask | blocked

    def _refuse_in_inference(self) -> None:
        c = self.config
        if self.core_attention.cp_size > 1 or c.sequence_parallel:
            raise NotImplementedError(
                "SelfAttention with inference_context: not supported yet with context parallelism or "
                f"sequence_parallel (cp={self.core_attention.cp_size}, sequence_parallel={c.sequence_parallel})"
            )
