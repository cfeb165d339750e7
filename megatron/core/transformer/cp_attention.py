"""Context-parallel attention without whole-sequence keys: Megatron's ``p2p`` (ring) and ``a2a`` (Ulysses) schemes.

Every CP rank holds chunks ``r`` and ``2cp-1-r`` of the sequence (``megatron.core.context_parallel``).

* ``p2p`` (ring): keys and values travel round the CP ring, one rank's block per step; the exchange
  for step ``t + 1`` (isend to ``r + 1``, irecv from ``r - 1``) is posted before step ``t``'s blocks are
  computed. Each (query chunk, key chunk) pair is skipped, computed in full or computed as the causal
  diagonal (``tiled_attention.Visibility.block_kind``), and the partial results merge by log-sum-exp.
  Backward walks the ring again: key/value blocks travel as in forward, and each block's key/value
  gradient travels with it, gathering every rank's contribution, until it reaches its owner.
* ``a2a`` (Ulysses): an all-to-all turns ``[s/cp, heads]`` into ``[s, heads/cp]`` (sequence gathered,
  put in order); attention runs on the whole sequence for ``heads/cp`` heads (the same blockwise
  kernel, no ``[s, s]`` mask); a second all-to-all turns the output back. Grouped-query keys and
  values are sent at their group count (repeated only up to a multiple of ``cp`` where fewer).
* ``a2a+p2p`` (hierarchical): the all-to-all inside groups of consecutive CP ranks (the first of
  ``hierarchical_context_parallel_sizes``, ``A``), then the ring over the second level (``P``). CP rank
  ``pA + a`` holds chunks ``pA + a`` and ``2cp-1-pA-a``; after the all-to-all its group's tokens are the
  spans ``p`` and ``2P-1-p`` of ``2P`` spans of ``A`` chunks: the load-balanced layout of a ``P``-rank
  ring, which then runs unchanged on ``h/A`` heads.

Both are exact (log-sum-exp merging), so every scheme equals CP=1 up to float rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.context_parallel import cp_chunk_positions, gathered_order
from megatron.core.tensor_parallel.mappings import all_to_all
from megatron.core.transformer import tiled_attention
from megatron.core.transformer.tiled_attention import FULL, SKIP, Visibility, block_backward, block_forward, merge_into

RING_SCHEMES = ("p2p", "a2a", "a2a+p2p")  # cp_comm_type values computed here; "all_gather" is attention.py's own path


def _pack(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: torch.Tensor, *shapes: torch.Size) -> List[torch.Tensor]:
    sizes = [math.prod(s) for s in shapes]
    return [piece.view(shape) for piece, shape in zip(torch.split(flat, sizes), shapes)]


@dataclass
class Ring:
    """The CP ring (``group`` None: one rank, no communication) and what this rank's queries may see."""

    group: Optional[dist.ProcessGroup]
    vis: Visibility
    scale: float
    dropout: Optional[Tuple[float, int]] = None  # (p, seed): tiled_attention's attention dropout
    tile_rows: Optional[int] = None  # queries per score tile (None: tiled_attention.TILE_ROWS)

    def __post_init__(self) -> None:
        self.size = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        if self.size > 1:
            self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def exchange(self, send: torch.Tensor) -> Tuple[torch.Tensor, List]:
        """Post isend of ``send`` to the next rank and irecv of the previous rank's; returns (buffer, works)."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)

    def blocks(self, src: int, c: int) -> Iterator[Tuple[slice, slice, Tuple[int, int], Optional[Visibility]]]:
        """(query rows, key rows, first positions, visibility or None when FULL) of this rank's queries
        on rank ``src``'s keys, chunk by chunk (``c`` tokens each), SKIP blocks left out."""
        for q0, q_row in ((self.rank * c, 0), ((2 * self.size - 1 - self.rank) * c, c)):
            for k0, k_row in ((src * c, 0), ((2 * self.size - 1 - src) * c, c)):
                kind = self.vis.block_kind(q0, c, k0, c)
                if kind != SKIP:
                    yield slice(q_row, q_row + c), slice(k_row, k_row + c), (q0, k0), None if kind == FULL else self.vis

    def forward(self, q, k, v, mask) -> Tuple[torch.Tensor, torch.Tensor]:
        """fp32 output ``[b, h, 2c, dv]`` and ``lse`` ``[b, h, 2c]`` of ``q`` ``[b, h, 2c, d]`` over all keys."""
        b, h, n, _ = q.shape
        c = n // 2
        out = q.new_zeros(b, h, n, v.shape[-1], dtype=torch.float32)
        lse = q.new_full((b, h, n), float("-inf"), dtype=torch.float32)
        kv = _pack(k, v)
        for step in range(self.size):
            src = (self.rank - step) % self.size
            pending = self.exchange(kv) if step + 1 < self.size else None  # posted before this step's compute
            kb, vb = _unpack(kv, k.shape, v.shape)
            for rows, keys, pos, vis in self.blocks(src, c):
                block_mask = _cut(mask, rows, pos[1], c)
                part = block_forward(
                    q[:, :, rows], kb[:, :, keys], vb[:, :, keys], pos, vis, self.scale, block_mask, self.dropout,
                    self.tile_rows,
                )  # fmt: skip
                merge_into(out[:, :, rows], lse[:, :, rows], *part)
            if pending is not None:
                kv = _wait(pending)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, mask) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 gradients of ``q``, ``k``, ``v`` (this rank's) from the output gradient ``dout`` ``[b, h, 2c, dv]``."""
        c = q.shape[2] // 2
        delta = (dout.float() * out).sum(-1)  # [b, h, 2c]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, incoming = _pack(k, v), None
        for step in range(self.size):
            src = (self.rank - step) % self.size
            pending = self.exchange(kv) if step + 1 < self.size else None
            kb, vb = _unpack(kv, k.shape, v.shape)
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            for rows, keys, pos, vis in self.blocks(src, c):
                grads = (dout[:, :, rows], delta[:, :, rows])
                gq, gk, gv = block_backward(
                    grads, q[:, :, rows], kb[:, :, keys], vb[:, :, keys], lse[:, :, rows], pos, vis, self.scale,
                    _cut(mask, rows, pos[1], c), self.dropout, self.tile_rows,
                )  # fmt: skip
                dq[:, :, rows] += gq
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv
            acc = _pack(dk, dv)  # this rank's part of rank src's key/value gradients
            if incoming is not None:
                acc += _wait(incoming)  # the ranks before this one on the ring, for the same keys
            incoming = self.exchange(acc) if self.size > 1 else None
            if pending is not None:
                kv = _wait(pending)
        dkv = _wait(incoming) if incoming is not None else acc  # every rank's part of this rank's keys
        dk, dv = _unpack(dkv, k.shape, v.shape)
        return dq, dk, dv


def _wait(pending: Tuple[torch.Tensor, List]) -> torch.Tensor:
    buffer, works = pending
    for work in works:
        work.wait()
    return buffer


def _cut(mask: Optional[torch.Tensor], rows: slice, k0: int, c: int) -> Optional[torch.Tensor]:
    """The explicit mask ``[b|1, 1, 2c, s]`` (global keys) of one block: ``[b|1, 1, c, c]``."""
    return None if mask is None else mask[:, :, rows, k0 : k0 + c]


class _RingAttention(torch.autograd.Function):
    """Exact attention of this rank's queries over the ring's keys; saves only q, k, v, output and lse."""

    @staticmethod
    def forward(ctx, q, k, v, mask, ring: Ring):
        out, lse = ring.forward(q, k, v, mask)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.ring = ring
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = ctx.ring.backward(dout, q, k, v, out, lse, mask)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q, k, v, ring: Ring, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``q`` ``[b, h, 2c, d]``, ``k`` ``[b, g, 2c, d]``, ``v`` ``[b, g, 2c, dv]`` (this rank's two chunks; a
    one-rank ``ring``: the sequence in order) -> ``[b, h, 2c, dv]``. ``mask`` ``[b|1, 1, 2c, s]``: True = blocked."""
    return _RingAttention.apply(q, k, v, mask, ring)


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[b, n, s/cp, d]`` (this rank's chunks) -> ``[b, n/cp, s, d]`` (the whole sequence, in order)."""
    cp = dist.get_world_size(group)
    b, n, sl, d = x.shape
    if n % cp:
        raise ValueError(f"cp_comm_type a2a: needs the heads per rank ({n}) divisible by the all-to-all size {cp}")
    pieces = x.reshape(b, cp, n // cp, sl, d).transpose(0, 1)  # [cp, b, n/cp, sl, d]: piece j goes to rank j
    got = all_to_all(group, pieces.reshape(cp, -1)).view(cp, b, n // cp, sl, d)  # piece j from rank j
    rank_order = got.permute(1, 2, 0, 3, 4).reshape(b, n // cp, cp * sl, d)
    return rank_order.index_select(2, gathered_order(sl, cp, x.device))  # [b, n/cp, s, d]


def _heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``_seq_to_heads`` reversed: ``[b, n/cp, s, d]`` -> ``[b, n, s/cp, d]``."""
    cp = dist.get_world_size(group)
    b, m, s, d = y.shape
    held = torch.cat([cp_chunk_positions(s, cp, r, y.device) for r in range(cp)])  # [s] in rank order
    pieces = y.index_select(2, held).view(b, m, cp, s // cp, d).permute(2, 0, 1, 3, 4)  # [cp, b, n/cp, s/cp, d]
    got = all_to_all(group, pieces.reshape(cp, -1)).view(cp, b, m, s // cp, d)  # head group j from rank j
    return got.transpose(0, 1).reshape(b, cp * m, s // cp, d)


def _groups_for(k: torch.Tensor, heads: int, cp: int) -> torch.Tensor:
    """Key/value groups ``[b, g, ., d]`` repeated up to ``lcm(g, cp)`` so that each rank gets whole groups."""
    g = k.shape[1]
    wanted = g * cp // math.gcd(g, cp)
    if heads % wanted:
        raise ValueError(
            f"cp_comm_type a2a: {heads} heads and {g} query groups per rank cannot be split over the "
            f"all-to-all group's {cp} ranks (heads must be divisible by lcm(groups, {cp}) = {wanted})"
        )
    return k.repeat_interleave(wanted // g, dim=1) if wanted > g else k


def ulysses_attention(q, k, v, a2a_group: dist.ProcessGroup, ring: Ring) -> torch.Tensor:
    """All-to-all CP attention over ``a2a_group``: ``q`` ``[b, h, n, d]``, ``k``/``v`` ``[b, g, n, .]`` ->
    ``[b, h, n, dv]``. This rank's ``h/a2a`` heads attend over the ``a2a`` ranks' tokens gathered in order,
    on ``ring``: one rank (``a2a``, the whole sequence) or the ring of ``a2a+p2p`` (its chunks of it)."""
    cp, heads = dist.get_world_size(a2a_group), q.shape[1]
    k, v = (_seq_to_heads(_groups_for(t, heads, cp), a2a_group) for t in (k, v))  # [b, g'/cp, cp*n, .]
    ctx = ring_attention(_seq_to_heads(q, a2a_group), k, v, ring)  # [b, h/cp, cp*n, dv]
    return _heads_to_seq(ctx, a2a_group)


def _after_a2a(group: Optional[dist.ProcessGroup], a2a_group: dist.ProcessGroup, vis, scale, dropout) -> Ring:
    """The ring (``group`` None: one rank) that attends after the all-to-all over ``a2a_group``: dropout
    seeded per head group (each a2a rank draws for other heads), and score tiles of ``TILE_ROWS / a2a``
    queries, since its blocks have ``a2a`` times the keys: a tile holds what a ``p2p`` one does per head,
    so the workspace falls as 1/cp here too."""
    a2a = dist.get_world_size(a2a_group)
    seed = None if dropout is None else (dropout[0], hash((dropout[1], dist.get_rank(a2a_group))))
    return Ring(group, vis, scale, seed, tile_rows=max(1, tiled_attention.TILE_ROWS // a2a))


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scheme: str,
    group: dist.ProcessGroup,
    vis: Visibility,
    scale: float,
    mask: Optional[torch.Tensor] = None,
    dropout: Optional[Tuple[float, int]] = None,
    hcp: Optional[Sequence[dist.ProcessGroup]] = None,
) -> torch.Tensor:
    """This rank's attention output ``[b, h, s/cp, dv]`` under ``scheme`` (``p2p``, ``a2a`` or ``a2a+p2p``).

    ``q`` ``[b, h, s/cp, d]``, ``k``/``v`` ``[b, g, s/cp, d|dv]`` hold chunks r and 2cp-1-r of ``group``;
    ``mask`` (``p2p`` only) ``[b|1, 1, s/cp, s]``, True = blocked, in global key order; ``dropout``
    ``(p, seed)``; ``hcp`` (``a2a+p2p``): the ``[a2a, p2p]`` sub-groups of ``group`` (consecutive ranks, then
    the ring across them: ``ProcessGroupCollection.hcp``).
    """
    if scheme == "p2p":
        return ring_attention(q, k, v, Ring(group, vis, scale, dropout), mask)
    if scheme not in RING_SCHEMES:
        raise ValueError(f"cp_comm_type={scheme!r}: this function computes {RING_SCHEMES}")
    if mask is not None:
        raise NotImplementedError(f"cp_comm_type={scheme!r} with an explicit attention mask: use 'p2p' or 'all_gather'")
    if scheme == "a2a":
        return ulysses_attention(q, k, v, group, _after_a2a(None, group, vis, scale, dropout))
    if hcp is None or len(hcp) != 2:
        raise ValueError("cp_comm_type='a2a+p2p' needs the two hierarchical CP groups [a2a, p2p] (hcp)")
    a2a, p2p = hcp
    return ulysses_attention(q, k, v, a2a, _after_a2a(p2p, a2a, vis, scale, dropout))
