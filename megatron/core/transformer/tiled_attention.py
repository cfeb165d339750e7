"""Blockwise exact attention with log-sum-exp outputs: the kernel under the ring and all-to-all CP schemes.

A *block* is queries at contiguous global positions ``[q0, q0 + nq)`` against keys at ``[k0, k0 + nk)``.
``block_kind`` says, from those ranges alone, whether the causal mask / sliding window blocks all of
it (``SKIP``), none of it (``FULL``: plain attention, flash-eligible) or part (``PARTIAL``: the causal
diagonal is the usual case, flash-eligible with ``is_causal``). ``block_forward`` returns the block's
output and its log-sum-exp ``lse`` so that partial results over several key blocks merge exactly
(``merge_into``, the online softmax); ``block_backward`` takes the *final* output and ``lse`` (the
FlashAttention backward), so a block's gradients need no other block.

The kernel walks tiles of at most ``TILE_ROWS`` queries, each against the keys of the block it may see:
no tensor of size ``[s, s]`` (or even ``[nq, nk]`` for a long block) exists, a diagonal block costs
half, and a tile's scores (``TILE_ROWS x nk`` per head) grow with the block's keys only: under
context parallelism the blocks are ``s/(2cp)`` keys (``p2p``) or ``s/2`` keys on ``heads/cp`` heads
(``a2a``), so the workspace, like everything else a rank holds, falls as 1/cp. Grouped-query keys and
values stay at their group count (the query heads of a group are folded into the tile). Masks within a
tile come from global positions (``masks.build_attention_mask``); an explicit ``mask`` (True =
blocked) aligned to the block may add padding or documents. Values may have another head dim than
queries (multi-latent attention).

Attention dropout (``dropout = (p, seed)``) drops probabilities after the softmax, as SDPA does; each
tile's keep-mask is drawn from a generator seeded by ``(seed, first query, first key)`` so that
backward draws it again instead of storing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megatron.core.transformer.masks import build_attention_mask

TILE_ROWS = 128  # queries per tile: a tile holds TILE_ROWS x (visible keys) scores per head
SKIP, FULL, PARTIAL = "skip", "full", "partial"
Dropout = Optional[Tuple[float, int]]  # (probability, seed) or None


@dataclass(frozen=True)
class Visibility:
    """Which keys a query sees: ``causal`` and Megatron's ``window`` ``(left, right)`` (-1: unlimited)."""

    causal: bool = True
    window: Optional[Tuple[int, int]] = None

    @property
    def left(self) -> int:
        return self.window[0] if self.window is not None else -1

    @property
    def right(self) -> int:
        if self.causal:
            return 0
        return self.window[1] if self.window is not None else -1

    def key_bounds(self, q0: int, q1: int, k0: int, nk: int) -> Tuple[int, int]:
        """Key rows ``[lo, hi)`` of the block ``[k0, k0 + nk)`` some query in ``[q0, q1)`` may see."""
        lo = 0 if self.left < 0 else max(0, q0 - self.left - k0)
        hi = nk if self.right < 0 else min(nk, q1 - 1 + self.right + 1 - k0)
        return lo, max(lo, hi)

    def mask(self, q0: int, q1: int, k0: int, k1: int, device: torch.device) -> Optional[torch.Tensor]:
        """``[q1 - q0, k1 - k0]`` True where blocked, None when nothing in the tile is."""
        if self.block_kind(q0, q1 - q0, k0, k1 - k0) == FULL:
            return None
        positions = torch.arange(q0 - k0, q1 - k0, device=device)  # [tq] relative to the first key
        return build_attention_mask(q1 - q0, k1 - k0, self.causal, self.window, query_positions=positions)

    def block_kind(self, q0: int, nq: int, k0: int, nk: int) -> str:
        """SKIP, FULL or PARTIAL for queries ``[q0, q0 + nq)`` against keys ``[k0, k0 + nk)``."""
        low, high = k0 - (q0 + nq - 1), k0 + nk - 1 - q0  # range of key position - query position
        left, right = self.left, self.right
        if (right >= 0 and low > right) or (left >= 0 and high < -left):
            return SKIP
        if (right < 0 or high <= right) and (left < 0 or low >= -left):
            return FULL
        return PARTIAL


def _tile_scores(q, k, q_rows, k_rows, pos, vis, mask, scale) -> torch.Tensor:
    """fp32 scores ``[b, g, h/g, tq, tk]`` of query rows ``q_rows`` on key rows ``k_rows``, blocked at -inf."""
    b, h, _, d = q.shape
    g = k.shape[1]
    (t0, t1), (lo, hi), (q0, k0) = q_rows, k_rows, pos
    qt = q[:, :, t0:t1].reshape(b, g, h // g, t1 - t0, d)  # [b, g, h/g, tq, d]
    scores = torch.matmul(qt, k[:, :, lo:hi].unsqueeze(2).transpose(-1, -2)).float() * scale  # [b, g, h/g, tq, tk]
    blocked = vis.mask(q0 + t0, q0 + t1, k0 + lo, k0 + hi, q.device) if vis is not None else None  # [tq, tk]
    if mask is not None:
        extra = mask[:, :, t0:t1, lo:hi].unsqueeze(2)  # [b|1, 1, 1, tq, tk]
        blocked = extra if blocked is None else blocked | extra
    return scores if blocked is None else scores.masked_fill(blocked, float("-inf"))


def _kept(dropout: Dropout, where: Tuple[int, int], like: torch.Tensor) -> Optional[torch.Tensor]:
    """The tile's keep-mask scaled by 1/(1-p), like ``like`` ``[b, g, h/g, tq, tk]``; None without dropout.
    ``where``: global positions of the tile's first query and first key (with the seed: the draw)."""
    if dropout is None:
        return None
    p, seed = dropout
    gen = torch.Generator(device=like.device)
    gen.manual_seed(hash((seed, *where)) & (2**63 - 1))
    keep = torch.rand(like.shape, generator=gen, device=like.device) >= p
    return keep.to(like.dtype) / (1.0 - p)


def _tiles(nq: int, nk: int, q0: int, k0: int, vis: Optional[Visibility], rows: Optional[int]):
    """``(t0, t1, lo, hi)``: query rows (``rows`` per tile, None: ``TILE_ROWS``) and the key rows they
    may see, tile by tile (empty ones dropped)."""
    rows = max(1, min(nq, rows or TILE_ROWS))
    for t0 in range(0, nq, rows):
        t1 = min(nq, t0 + rows)
        lo, hi = vis.key_bounds(q0 + t0, q0 + t1, k0, nk) if vis is not None else (0, nk)
        if hi > lo:
            yield t0, t1, lo, hi


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: Tuple[int, int],
    vis: Optional[Visibility],
    scale: float,
    mask: Optional[torch.Tensor] = None,
    dropout: Dropout = None,
    rows: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block: ``q`` ``[b, h, nq, d]``, ``k`` ``[b, g, nk, d]``, ``v`` ``[b, g, nk, dv]``
    with first positions ``pos = (q0, k0)`` -> fp32 output ``[b, h, nq, dv]`` and ``lse`` ``[b, h, nq]``
    (-inf, output 0, where a query sees no key). ``vis`` None: nothing blocked (a FULL block).
    ``dropout``: ``(p, seed)`` drops probabilities (after the softmax; ``lse`` is the undropped one);
    ``rows``: queries per tile (None: ``TILE_ROWS``)."""
    b, h, nq, _ = q.shape
    nk, dv = k.shape[2], v.shape[-1]
    out = q.new_zeros(b, h, nq, dv, dtype=torch.float32)
    lse = q.new_full((b, h, nq), float("-inf"), dtype=torch.float32)
    for t0, t1, lo, hi in _tiles(nq, nk, pos[0], pos[1], vis, rows):
        scores = _tile_scores(q, k, (t0, t1), (lo, hi), pos, vis, mask, scale)  # [b, g, h/g, tq, tk]
        tile_lse = torch.logsumexp(scores, dim=-1)  # [b, g, h/g, tq]
        probs = torch.exp(scores - _finite(tile_lse).unsqueeze(-1))
        kept = _kept(dropout, (pos[0] + t0, pos[1] + lo), probs)
        probs = probs if kept is None else probs * kept
        ctx = torch.matmul(probs.to(v.dtype), v[:, :, lo:hi].unsqueeze(2))  # [b, g, h/g, tq, dv]
        out[:, :, t0:t1] = ctx.reshape(b, h, t1 - t0, dv).float()
        lse[:, :, t0:t1] = tile_lse.reshape(b, h, t1 - t0)
    return out, lse


def block_backward(
    grads: Tuple[torch.Tensor, torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    pos: Tuple[int, int],
    vis: Optional[Visibility],
    scale: float,
    mask: Optional[torch.Tensor] = None,
    dropout: Dropout = None,
    rows: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (fp32) of one block's ``q``, ``k``, ``v`` given ``grads = (dout, delta)``: the gradient of
    the *final* output ``[b, h, nq, dv]`` and ``delta = rowsum(dout * out)`` ``[b, h, nq]``, with the final
    ``lse`` ``[b, h, nq]``. Shapes and ``pos``/``vis``/``mask``/``dropout``/``rows`` as ``block_forward``."""
    dout, delta = grads
    b, h, nq, d = q.shape
    g, nk = k.shape[1], k.shape[2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for t0, t1, lo, hi in _tiles(nq, nk, pos[0], pos[1], vis, rows):
        scores = _tile_scores(q, k, (t0, t1), (lo, hi), pos, vis, mask, scale)  # [b, g, h/g, tq, tk]
        rows = (b, g, h // g, t1 - t0)
        probs = torch.exp(scores - _finite(lse[:, :, t0:t1]).reshape(rows).unsqueeze(-1))  # final softmax
        dout_t = dout[:, :, t0:t1].float().reshape(*rows, -1)  # [b, g, h/g, tq, dv]
        kept = _kept(dropout, (pos[0] + t0, pos[1] + lo), probs)
        dropped = probs if kept is None else probs * kept
        dv[:, :, lo:hi] += torch.matmul(dropped.transpose(-1, -2), dout_t).sum(2)  # [b, g, tk, dv]
        dprobs = torch.matmul(dout_t, v[:, :, lo:hi].float().unsqueeze(2).transpose(-1, -2))  # [.., tq, tk]
        dprobs = dprobs if kept is None else dprobs * kept
        dscores = probs * (dprobs - delta[:, :, t0:t1].reshape(rows).unsqueeze(-1)) * scale
        dq[:, :, t0:t1] = torch.matmul(dscores, k[:, :, lo:hi].float().unsqueeze(2)).reshape(b, h, t1 - t0, d)
        qt = q[:, :, t0:t1].float().reshape(*rows, d)
        dk[:, :, lo:hi] += torch.matmul(dscores.transpose(-1, -2), qt).sum(2)  # [b, g, tk, d]
    return dq, dk, dv


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (rows that see nothing) as 0, so that exp(-inf - lse) stays 0 rather than nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge_into(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Online softmax: fold a partial result (``[b, h, n, dv]``, ``[b, h, n]``, fp32) into ``out``/``lse`` in place."""
    new = _finite(torch.logaddexp(lse, part_lse))  # [b, h, n]
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(part_out * torch.exp(part_lse - new).unsqueeze(-1))
    lse.copy_(torch.logaddexp(lse, part_lse))
