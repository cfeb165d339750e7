"""Choosing the next token from full-vocabulary logits, and the log-probabilities of chosen tokens."""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.inference.sampling_params import SamplingParams


def _keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits`` ``[b, V]`` with every token outside each row's ``k`` largest set to -inf."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # [b, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _keep_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """``logits`` ``[b, V]`` cut to each row's smallest most-likely set whose probability reaches ``p``
    (the most likely token always stays)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [b, V]
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # [b, V]: probability of the more likely tokens
    drop_sorted = before >= p
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """One token per row of ``logits`` ``[b, V]`` (fp32, full vocabulary) -> ``[b]`` int64.

    Greedy (``temperature`` 0 or ``top_k`` 1): the argmax. Otherwise the logits are divided by the
    temperature, cut by ``top_k`` or ``top_p``, and a token is drawn from their softmax with ``generator``.
    A row whose scaled logits overflow fp32 (a temperature as small as 1e-300 is 0 in fp32) takes its
    argmax, the limit of sampling as the temperature goes to 0, instead of non-finite probabilities.
    """
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    logits = logits.float()
    scaled = logits / params.temperature  # [b, V]
    overflow = (~torch.isfinite(scaled) & torch.isfinite(logits)).any(dim=-1)  # [b]
    scaled = scaled.masked_fill(overflow[:, None], 0.0)  # any valid row: its draw is replaced below
    if params.top_k > 0:
        scaled = _keep_top_k(scaled, params.top_k)
    elif params.top_p > 0.0:
        scaled = _keep_top_p(scaled, params.top_p)
    probs = torch.softmax(scaled, dim=-1)  # [b, V]
    sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [b]
    return torch.where(overflow, torch.argmax(logits, dim=-1), sampled)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(``tokens``) ``[b, s]`` under ``logits`` ``[b, s, V]``: log-softmax of the fp32 logits, gathered."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [b, s, V]
    return log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [b, s]
