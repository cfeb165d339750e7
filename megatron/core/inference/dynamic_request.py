"""One request of the dynamic engine (megatron-core's ``DynamicInferenceRequest``): its tokens, where its KV
cache lives, what it has produced and when."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from megatron.core.inference.engine import GenerationResult
from megatron.core.inference.sampling_params import SamplingParams


@dataclass
class DynamicInferenceRequest:
    """A prompt in flight. ``computed``: positions whose keys and values are cached (from prefix-cached blocks
    or computed); the next step feeds ``tokens[computed:]``. ``*_top_n_logprobs`` hold, per log-probability,
    the ``top_n_logprobs`` most likely ids and their log-probabilities. Times are ``time.monotonic()``."""

    request_id: int
    prompt_tokens: List[int]
    sampling_params: SamplingParams
    generator: Optional[torch.Generator] = None
    generated_tokens: List[int] = field(default_factory=list)
    prompt_log_probs: List[float] = field(default_factory=list)
    generated_log_probs: List[float] = field(default_factory=list)
    prompt_top_n_logprobs: List[Dict[int, float]] = field(default_factory=list)
    generated_top_n_logprobs: List[Dict[int, float]] = field(default_factory=list)
    block_ids: List[int] = field(default_factory=list)
    prompt_hashes: List[str] = field(default_factory=list)
    computed: int = 0
    reused_blocks: int = 0
    finish_reason: Optional[str] = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None

    @property
    def tokens(self) -> List[int]:
        return self.prompt_tokens + self.generated_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        """Tokens to feed before the next one can be chosen."""
        return len(self.prompt_tokens) + len(self.generated_tokens) - self.computed

    def record_token(self, token: int) -> None:
        """Append a chosen token; finish on a stop token or at ``num_tokens_to_generate``."""
        params = self.sampling_params
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.generated_tokens.append(token)
        if token in params.stop_token_ids:
            self.finish("stop")
        elif len(self.generated_tokens) >= params.num_tokens_to_generate:
            self.finish("length")

    def record_log_prob(self, target_position: int, value: float, top: Optional[Dict[int, float]]) -> None:
        """log p(token at ``target_position`` | the tokens before it), and the top-n alternatives there."""
        in_prompt = target_position < len(self.prompt_tokens)
        (self.prompt_log_probs if in_prompt else self.generated_log_probs).append(value)
        if top is not None:
            (self.prompt_top_n_logprobs if in_prompt else self.generated_top_n_logprobs).append(top)

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.finish_time = time.monotonic()

    def result(self) -> GenerationResult:
        """The static engine's result type (log-probabilities only when asked for)."""
        with_log_probs = self.sampling_params.return_log_probs
        top_n = self.sampling_params.top_n_logprobs > 0
        return GenerationResult(
            prompt_tokens=list(self.prompt_tokens),
            generated_tokens=list(self.generated_tokens),
            prompt_log_probs=list(self.prompt_log_probs) if with_log_probs else None,
            generated_log_probs=list(self.generated_log_probs) if with_log_probs else None,
            finish_reason=self.finish_reason,
            prompt_top_n_logprobs=list(self.prompt_top_n_logprobs) if top_n else None,
            generated_top_n_logprobs=list(self.generated_top_n_logprobs) if top_n else None,
        )
