"""How tokens are chosen (megatron-core's ``SamplingParams``; ``seed`` and ``stop_token_ids`` are ours)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass
class SamplingParams:
    """Sampling settings of one ``InferenceEngine.generate`` call.

    ``temperature`` 0.0 (or ``top_k`` 1) picks the most likely token (greedy). Otherwise the logits
    are divided by ``temperature``, cut to the ``top_k`` most likely tokens (0: off) or to the
    smallest set whose probability reaches ``top_p`` (0.0: off), and a token is drawn from a
    ``torch.Generator`` seeded with ``seed`` (same seed, same prompts: same tokens). A sequence
    stops after emitting one of ``stop_token_ids`` or ``num_tokens_to_generate`` tokens.
    ``return_log_probs``: log-probabilities (log-softmax of the full-vocabulary fp32 logits, before
    temperature) of the prompt tokens after the first and of every generated token; with
    ``top_n_logprobs`` > 0 also the ``top_n_logprobs`` most likely ids at each of those positions
    (the dynamic engine only).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    num_tokens_to_generate: int = 30
    return_log_probs: bool = False
    seed: Optional[int] = None
    stop_token_ids: Tuple[int, ...] = ()
    top_n_logprobs: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field, its value and the rule it breaks (also after later edits)."""
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        checks = (
            ("temperature", self.temperature, self.temperature >= 0, "must be >= 0 (0.0 = greedy)"),
            ("top_k", self.top_k, self.top_k >= 0, "must be >= 0 (0 = off)"),
            ("top_p", self.top_p, 0.0 <= self.top_p <= 1.0, "must be in [0, 1] (0.0 = off)"),
            ("num_tokens_to_generate", self.num_tokens_to_generate, self.num_tokens_to_generate >= 0, "must be >= 0"),
            ("top_n_logprobs", self.top_n_logprobs, self.top_n_logprobs >= 0, "must be >= 0 (0 = off)"),
        )
        for name, value, ok, rule in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={value!r}: {rule}")
        if self.top_k > 0 and self.top_p > 0.0:
            raise ValueError(
                f"SamplingParams.top_k={self.top_k} and top_p={self.top_p}: use one of them (the other must be off)"
            )

        if self.top_n_logprobs > 0 and not self.return_log_probs:
            raise ValueError(f"SamplingParams.top_n_logprobs={self.top_n_logprobs}: needs return_log_probs=True")

    @property
    def greedy(self) -> bool:
        """Whether every step takes the most likely token."""
        return self.temperature == 0.0 or self.top_k == 1
