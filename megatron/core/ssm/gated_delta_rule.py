"""The gated delta rule (Gated DeltaNet's token mixing) in plain PyTorch: a chunked form and one recurrence step.

Per value head the state ``S`` is ``[dk, dv]``. At position ``t`` (decay ``g_t <= 0``, write strength
``beta_t`` in (0, 1), key ``k_t``, value ``v_t``, query ``q_t`` scaled by ``1/sqrt(dk)``)::

    S <- exp(g_t) S                       (forget)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T   (delta rule: move what S recalls for k_t towards v_t)
    o_t = S^T q_t

The chunked form computes the same numbers chunk by chunk. With ``G_t`` the cumulative log decay from the
chunk's start and ``S_0`` the state entering the chunk, the state is
``S_t = exp(G_t) S_0 + sum_{s<=t} exp(G_t - G_s) k_s u_s^T`` for "pseudo values" ``u`` that solve the unit
lower-triangular system ``(I + A) u = beta (v - exp(G) S_0^T k)``, ``A_ts = beta_t exp(G_t - G_s) k_t . k_s``
for ``s < t``. Everything but the ``S_0`` terms is computed for all chunks at once; a short loop over
the chunks carries the state.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.transformer.masks import build_attention_mask


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (as FLA's and transformers' kernels)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the rule's accumulation dtype: fp32, or fp64 when given fp64 (for tests)."""
    return t if t.dtype == torch.float64 else t.float()


def _heads_first(q, k, v, g, beta):
    """``[b, l, h, d]`` / ``[b, l, h]`` -> ``[b, h, l, d]`` / ``[b, h, l]`` in the accumulation dtype; the
    query scaled by ``1/sqrt(dk)``; query/key heads repeated to the value heads (``h_v / h_k`` each)."""
    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v, g, beta = (_acc(t).transpose(1, 2) for t in (q, k, v, g, beta))
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Outputs and final state of the gated delta rule over a whole sequence (fp32; fp64 for fp64 inputs).

    Args:
        query, key: ``[b, l, h_k, dk]`` (already L2-normalized if the model does so).
        value: ``[b, l, h_v, dv]``; ``h_v`` a multiple of ``h_k`` (value head ``i`` reads key head ``i // (h_v/h_k)``).
        g: ``[b, l, h_v]`` log decays (<= 0); beta: ``[b, l, h_v]`` write strengths.
        chunk_size: positions per chunk; the result does not depend on it.
        initial_state: ``[b, h_v, dk, dv]`` state before the first position (zeros if None).

    Returns:
        ``[b, l, h_v, dv]`` outputs and the state after the last position ``[b, h_v, dk, dv]``.
    """
    q, k, v, g, beta = _heads_first(query, key, value, g, beta)
    b, h, length, dk = k.shape
    dv = v.shape[-1]
    pad = (-length) % chunk_size  # padded positions: g = 0 (no decay), beta = 0 (no write), k = 0
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    c = (length + pad) // chunk_size
    q, k, v = (t.reshape(b, h, c, chunk_size, -1) for t in (q, k, v))  # [b, h, c, Q, d]
    cum = g.reshape(b, h, c, chunk_size).cumsum(-1)  # [b, h, c, Q] G_t
    beta = beta.reshape(b, h, c, chunk_size, 1)

    future = build_attention_mask(chunk_size, chunk_size, device=k.device)  # [Q, Q] True where s > t
    diff = cum[..., :, None] - cum[..., None, :]  # [b, h, c, Q(t), Q(s)] G_t - G_s
    decay = torch.exp(diff.masked_fill(future, float("-inf")) if future is not None else diff)  # 0 above the diagonal
    below = decay * (k @ k.transpose(-1, -2)) * beta  # [b, h, c, Q, Q]; zero above the diagonal
    strictly = below - torch.diag_embed(torch.diagonal(below, dim1=-2, dim2=-1))  # the diagonal dropped too
    system = torch.eye(chunk_size, dtype=k.dtype, device=k.device) + strictly
    solve = lambda rhs: torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # noqa: E731
    w = solve(beta * v)  # [b, h, c, Q, dv]: u = w - kd @ S_0
    kd = solve(beta * torch.exp(cum)[..., None] * k)  # [b, h, c, Q, dk]
    scores = (q @ k.transpose(-1, -2)) * decay  # [b, h, c, Q, Q] inside the chunk, s <= t
    q_in = q * torch.exp(cum)[..., None]  # [b, h, c, Q, dk] reads the entering state
    k_out = k * torch.exp(cum[..., -1:] - cum)[..., None]  # [b, h, c, Q, dk] writes the leaving state

    state = k.new_zeros(b, h, dk, dv) if initial_state is None else _acc(initial_state)
    out = []
    for i in range(c):  # carry the state over the chunk boundaries
        u = w[:, :, i] - kd[:, :, i] @ state  # [b, h, Q, dv]
        out.append(q_in[:, :, i] @ state + scores[:, :, i] @ u)
        state = torch.exp(cum[:, :, i, -1])[..., None, None] * state + k_out[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(out, dim=2).reshape(b, h, c * chunk_size, dv)[:, :, :length]
    return o.transpose(1, 2), state  # [b, l, h_v, dv], [b, h_v, dk, dv]


def recurrent_gated_delta_step(
    state: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One position of the recurrence (decoding).

    ``state`` ``[b, h_v, dk, dv]``; ``query``/``key`` ``[b, h_k, dk]``, ``value`` ``[b, h_v, dv]``, ``g``/``beta``
    ``[b, h_v]``. Returns the output ``[b, h_v, dv]`` and the new state (fp32; fp64 for fp64 inputs).
    """
    q, k, v, g, beta = _heads_first(*(t[:, None] for t in (query, key, value, g, beta)))
    q, k, v, g, beta = q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0]  # [b, h, d] / [b, h]
    state = _acc(state) * torch.exp(g)[..., None, None]  # [b, h, dk, dv]
    recalled = (k[..., None] * state).sum(-2)  # [b, h, dv] S^T k
    state = state + k[..., None] * (beta[..., None] * (v - recalled))[..., None, :]
    return (q[..., None] * state).sum(-2), state
