"""The Mamba-2 selective state-space scan in its chunked ("state-space duality", SSD) form, plain PyTorch.

Per head h the recurrence is ``S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T`` (state ``[p, n]``)
and ``y_t = S_t C_t``. The chunked form gives the same numbers with matrix products: inside a chunk of
``Q`` positions the output is a masked, decayed ``C B^T`` "attention" over the chunk; across chunks only
the ``[p, n]`` state at each chunk boundary is carried, by a short loop over the chunks.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.transformer.masks import build_attention_mask


def _acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the scan's accumulation dtype: fp32, or fp64 when given fp64 (for tests)."""
    return t if t.dtype == torch.float64 else t.float()


def _expand_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, l, g, n]`` -> ``[b, l, heads, n]``: head i reads group ``i // (heads / g)``."""
    return t.repeat_interleave(heads // t.shape[2], dim=2)


def _decay_matrix(cum: torch.Tensor) -> torch.Tensor:
    """``exp(cum_t - cum_s)`` for ``s <= t`` else 0: ``[b, c, h, Q]`` -> ``[b, c, h, Q(t), Q(s)]``."""
    q = cum.shape[-1]
    diff = cum[..., :, None] - cum[..., None, :]  # [b, c, h, Q, Q]
    blocked = build_attention_mask(q, q, device=cum.device)  # [Q, Q] True where s > t; None when Q == 1
    return torch.exp(diff if blocked is None else diff.masked_fill(blocked, float("-inf")))


def ssd_chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The scan's outputs and final state, in fp32 (fp64 for fp64 inputs).

    Args:
        x: ``[b, l, h, p]`` inputs per head.
        dt: ``[b, l, h]`` positive step sizes (softplus already applied).
        A: ``[h]`` negative decay rates.
        B, C: ``[b, l, g, n]`` input and output projections of the state, shared by ``h / g`` heads each.
        chunk_size: positions per chunk ``Q``; the result does not depend on it.
        initial_state: ``[b, h, p, n]`` state before the first position (zeros if None).

    Returns:
        ``y`` ``[b, l, h, p]`` and the state after the last position ``[b, h, p, n]``.
    """
    b, length, h, p = x.shape
    n = B.shape[-1]
    pad = (-length) % chunk_size
    x, dt, A = _acc(x), _acc(dt), _acc(A)
    Bh, Ch = _expand_groups(_acc(B), h), _expand_groups(_acc(C), h)  # [b, l, h, n]
    # Zero padding at the end: dt = 0 there, so padded positions neither decay nor feed the state.
    x, Bh, Ch = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, Bh, Ch))
    dt = F.pad(dt, (0, 0, 0, pad))
    c = (length + pad) // chunk_size
    x = x.view(b, c, chunk_size, h, p)
    Bh, Ch = Bh.view(b, c, chunk_size, h, n), Ch.view(b, c, chunk_size, h, n)
    dt = dt.view(b, c, chunk_size, h)
    xdt = x * dt[..., None]  # [b, c, Q, h, p]
    cum = torch.cumsum((dt * A).transpose(2, 3), dim=-1)  # [b, c, h, Q] log-decay since chunk start

    # Inside each chunk: y_t += sum_{s<=t} exp(cum_t - cum_s) (C_t . B_s) dt_s x_s.
    scores = torch.einsum("bcthn,bcshn->bchts", Ch, Bh) * _decay_matrix(cum)  # [b, c, h, Q, Q]
    y = torch.einsum("bchts,bcshp->bcthp", scores, xdt)  # [b, c, Q, h, p]

    # Each chunk's own contribution to the state at its end.
    to_end = torch.exp(cum[..., -1:] - cum)  # [b, c, h, Q]
    chunk_states = torch.einsum("bchs,bcshn,bcshp->bchpn", to_end, Bh, xdt)  # [b, c, h, p, n]
    chunk_decay = torch.exp(cum[..., -1])  # [b, c, h]

    state = x.new_zeros(b, h, p, n) if initial_state is None else _acc(initial_state)
    entering = []
    for i in range(c):  # carry the state over the chunk boundaries
        entering.append(state)
        state = chunk_decay[:, i, :, None, None] * state + chunk_states[:, i]
    entering = torch.stack(entering, dim=1)  # [b, c, h, p, n] state before each chunk

    # From the state entering the chunk: y_t += exp(cum_t) C_t . S_in.
    y = y + torch.einsum("bcthn,bchpn->bcthp", Ch, entering) * torch.exp(cum).transpose(2, 3)[..., None]
    return y.reshape(b, c * chunk_size, h, p)[:, :length], state


def ssd_step(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> torch.Tensor:
    """One position of the recurrence, updating ``state`` ``[b, h, p, n]`` (fp32) in place.

    ``x`` ``[b, h, p]``, ``dt`` ``[b, h]``, ``A`` ``[h]``, ``B``/``C`` ``[b, g, n]``; returns ``y`` ``[b, h, p]``.
    """
    h = x.shape[1]
    Bh = _acc(B).repeat_interleave(h // B.shape[1], dim=1)  # [b, h, n]
    Ch = _acc(C).repeat_interleave(h // C.shape[1], dim=1)  # [b, h, n]
    dt = _acc(dt)
    decay = torch.exp(dt * _acc(A))[..., None, None]  # [b, h, 1, 1]
    state.mul_(decay).add_((dt[..., None] * _acc(x))[..., None] * Bh[:, :, None, :])
    return torch.einsum("bhpn,bhn->bhp", state, Ch)
