"""Core attention: softmax(q k^T * scale + mask) v over one rank's heads (``DotProductAttention``), by PyTorch SDPA
or explicit scores, with context parallelism, packed sequences and the flash-attention pin."""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import List, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core.context_parallel import cp_chunk_positions, gather_kv_over_cp, packed_cp_indices
from megatron.core.fusions.fused_softmax import fused_scale_mask_softmax, scale_mask_softmax
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.transformer.cp_attention import RING_SCHEMES, context_parallel_attention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.masks import build_attention_mask
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.packed_attention import packed_segments
from megatron.core.transformer.tiled_attention import Visibility
from megatron.core.transformer.transformer_config import TransformerConfig

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


def layer_cp_comm_type(config: TransformerConfig, layer_number: int, given: Optional[str] = None) -> str:
    """The context-parallel scheme of layer ``layer_number`` (1-based): ``given``, else ``config.cp_comm_type``
    (one value, or one per layer); None means ``p2p``, Megatron's default; ``allgather`` is ``all_gather``."""
    value = given if given is not None else getattr(config, "cp_comm_type", None)
    if isinstance(value, (list, tuple)):
        value = value[max(1, layer_number) - 1]
    return "all_gather" if value == "allgather" else (value or "p2p")
