"""Static-batch text generation with a KV cache, under tensor and pipeline parallelism.

Prompts of different lengths share one batch, right-padded: generation starts at the shortest
prompt's length, and while a sequence is still inside its prompt its true prompt token is
kept instead of the sampled one (megatron-core's static engine). Every position then holds a
real token of its sequence, so positions and the causal mask are shared, no padding mask is
needed, and each result equals generating that prompt alone. The first call runs the shortest
prompt length at once (prefill); every later call one position, attending over the KV cache.

Every rank of the model's groups calls ``generate`` with the same arguments. On each step the
stages pass activations forward point-to-point over the ``pp`` group; the last stage gathers the
logits over TP, chooses the tokens (TP rank 0's choice is broadcast over TP) and broadcasts them,
with their log-probabilities, over the ``pp`` group, so every rank embeds / records the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.sampling import sample_tokens, token_log_probs
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, stage_hidden_size
from megatron.core.utils import unwrap_model


@dataclass
class GenerationResult:
    """One prompt's outcome. ``generated_tokens`` excludes the prompt and includes the stop token if one
    was emitted. With ``return_log_probs``: ``prompt_log_probs[i - 1]`` = log p(prompt[i] | prompt[:i])
    for i >= 1, and one log-probability per generated token. ``finish_reason``: "stop" or "length" ("abort":
    stopped by the caller, dynamic engine). ``*_top_n_logprobs`` (dynamic engine, ``top_n_logprobs`` > 0): the
    most likely ids and their log-probabilities at each position that has a log-probability."""

    prompt_tokens: List[int]
    generated_tokens: List[int]
    prompt_log_probs: Optional[List[float]]
    generated_log_probs: Optional[List[float]]
    finish_reason: str
    prompt_top_n_logprobs: Optional[List[Dict[int, float]]] = None
    generated_top_n_logprobs: Optional[List[Dict[int, float]]] = None


class _BatchRecord:
    """What each sequence of the batch has produced so far (the same on every rank)."""

    def __init__(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> None:
        self.prompts = [list(p) for p in prompts]
        self.params = params
        self.generated: List[List[int]] = [[] for _ in prompts]
        self.prompt_log_probs: List[List[float]] = [[] for _ in prompts]
        self.generated_log_probs: List[List[float]] = [[] for _ in prompts]
        self.finish = ["length" if params.num_tokens_to_generate == 0 else None for _ in prompts]

    @property
    def done(self) -> bool:
        return all(reason is not None for reason in self.finish)

    def record(self, cur: int, chosen: List[int], log_probs: Optional[List[List[float]]]) -> None:
        """The tokens at position ``cur`` (``chosen[j]``: sequence j) and, with log-probs, those of the
        positions ending at ``cur`` (``log_probs[j][-1]``: sequence j, position ``cur``)."""
        for j, prompt in enumerate(self.prompts):
            if log_probs is not None:
                first = cur - len(log_probs[j]) + 1
                for position, value in enumerate(log_probs[j], start=first):
                    if position < len(prompt):
                        self.prompt_log_probs[j].append(value)
                    elif self.finish[j] is None:
                        self.generated_log_probs[j].append(value)
            if cur >= len(prompt) and self.finish[j] is None:
                self._append(j, chosen[j])

    def _append(self, j: int, token: int) -> None:
        self.generated[j].append(token)
        if token in self.params.stop_token_ids:
            self.finish[j] = "stop"
        elif len(self.generated[j]) == self.params.num_tokens_to_generate:
            self.finish[j] = "length"

    def results(self) -> List[GenerationResult]:
        with_log_probs = self.params.return_log_probs
        return [
            GenerationResult(
                prompt_tokens=prompt,
                generated_tokens=self.generated[j],
                prompt_log_probs=self.prompt_log_probs[j] if with_log_probs else None,
                generated_log_probs=self.generated_log_probs[j] if with_log_probs else None,
                finish_reason=self.finish[j],
            )
            for j, prompt in enumerate(self.prompts)
        ]


class InferenceEngine:
    """Generates from a ``GPTModel`` (in eval mode) split over the tensor- and pipeline-parallel groups
    of ``pg_collection``: this rank's stage, or a one-element list of it (no virtual pipelining).

    ``max_sequence_length`` (default: the model's) bounds prompt length + tokens to generate.
    ``vocab_size`` (default: the model's): the tokenizer's vocabulary when the model's is padded (a
    multiple of ``make_vocab_size_divisible_by x TP``): ids from it on are never chosen. Log-probabilities
    stay normalized over the whole padded vocabulary, the distribution the model was trained with (as
    Megatron's), so the echoed prompt's log-probabilities reproduce the training loss.
    """

    def __init__(
        self,
        model: Union[torch.nn.Module, List[torch.nn.Module]],
        pg_collection: ProcessGroupCollection,
        max_sequence_length: Optional[int] = None,
        *,
        vocab_size: Optional[int] = None,
    ) -> None:
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if len(chunks) != 1:
            raise NotImplementedError(f"InferenceEngine: {len(chunks)} model chunks (virtual pipelining); pass one")
        self.model = chunks[0]
        self.module = unwrap_model(self.model)
        self.groups = pg_collection
        self.config = self.module.config
        if self.config.sequence_parallel or pg_collection.size_of("cp") > 1:
            raise NotImplementedError(
                "InferenceEngine: sequence_parallel and context parallelism are not supported "
                f"(sequence_parallel={self.config.sequence_parallel}, cp={pg_collection.size_of('cp')})"
            )
        self.max_sequence_length = max_sequence_length or self.module.max_sequence_length
        learned = self.module.position_embedding_type == "learned_absolute"
        if learned and self.max_sequence_length > self.module.max_sequence_length:
            raise ValueError(
                f"InferenceEngine: max_sequence_length={self.max_sequence_length} exceeds the model's "
                f"{self.module.max_sequence_length} learned positions"
            )
        self.vocab_size = vocab_size or self.module.vocab_size
        if not 0 < self.vocab_size <= self.module.vocab_size:
            raise ValueError(f"InferenceEngine: vocab_size={vocab_size} must be in [1, {self.module.vocab_size}]")
        self.device = next(self.module.parameters()).device
        self.p2p = None
        if pg_collection.size_of("pp") > 1:
            dtype = self.config.pipeline_dtype or self.config.params_dtype
            shape = (1, 1, stage_hidden_size(self.config))
            self.p2p = P2PCommunicator(pg_collection.pp, pg_collection.ranks["pp"], shape, dtype, self.device)

    def generate(self, prompts: List[List[int]], sampling_params: SamplingParams) -> List[GenerationResult]:
        """Complete every prompt (token ids). Collective over the model's groups; every rank returns the
        same results. Raises ValueError, before any work, for an empty prompt, a token outside the
        vocabulary, or a prompt longer than ``max_sequence_length - num_tokens_to_generate``."""
        self._validate(prompts, sampling_params)
        if sampling_params.top_n_logprobs:
            raise ValueError(
                f"InferenceEngine.generate: top_n_logprobs={sampling_params.top_n_logprobs} needs the dynamic engine"
            )
        record = _BatchRecord(prompts, sampling_params)
        if not prompts or (record.done and not sampling_params.return_log_probs):
            return record.results()
        lengths = [len(p) for p in prompts]
        total = max(n + max(sampling_params.num_tokens_to_generate, 1) for n in lengths)
        tokens = torch.zeros(len(prompts), total, dtype=torch.long, device=self.device)  # [b, total]
        for j, prompt in enumerate(prompts):
            tokens[j, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        context = StaticInferenceContext(len(prompts), total, not sampling_params.return_log_probs)
        generator = self._generator(sampling_params.seed)
        prompt_lengths = torch.tensor(lengths, device=self.device)  # [b]
        prev = 0
        with torch.no_grad():
            for cur in range(min(lengths), total):
                logits = self._forward(tokens[:, prev:cur], context)  # [b, s or 1, V] on the last stage
                context.increment_sequence_len_offset(cur - prev)
                targets = tokens[:, prev + 1 : cur + 1]  # [b, s]: what this step's logits predict
                chosen, log_probs = self._choose(logits, targets, cur < prompt_lengths, sampling_params, generator)
                tokens[:, cur] = chosen
                record.record(cur, chosen.tolist(), None if log_probs is None else log_probs.tolist())
                if record.done and cur >= max(lengths) - 1:  # echo: every prompt's log-probs are in
                    break
                prev = cur
        return record.results()

    def _validate(self, prompts: List[List[int]], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if self.model.training:
            raise ValueError("InferenceEngine.generate: the model is in training mode; call model.eval() first")
        vocab = self.vocab_size
        limit = self.max_sequence_length - params.num_tokens_to_generate
        for j, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {j} is empty: generation needs at least one token")
            if len(prompt) > limit:
                raise ValueError(
                    f"prompt {j} has {len(prompt)} tokens; with num_tokens_to_generate="
                    f"{params.num_tokens_to_generate} that exceeds max_sequence_length={self.max_sequence_length}"
                )
            bad = [t for t in prompt if not 0 <= int(t) < vocab]
            if bad:
                raise ValueError(f"prompt {j} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")

    def _generator(self, seed: Optional[int]) -> torch.Generator:
        """The sampling RNG (only TP rank 0 of the last stage's draws are used)."""
        generator = torch.Generator(device=self.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        return generator

    def _forward(self, chunk: torch.Tensor, context: StaticInferenceContext) -> Optional[torch.Tensor]:
        """This stage's forward of token ids ``chunk`` ``[b, s]``: full-vocabulary logits ``[b, s|1, V]`` on the
        last stage, None elsewhere (activations ``[s, b, h]`` go point-to-point to the next stage)."""
        b, s = chunk.shape
        if not self.module.pre_process:
            received = self.p2p.exchange([], [(self.p2p.prev_rank, (s, b, stage_hidden_size(self.config)))])[0]
            self.module.set_input_tensor(received)  # [s, b, h]
        output = self.model(chunk, None, None, inference_context=context, runtime_gather_output=True)
        if self.module.post_process:
            return output
        self.p2p.exchange([(output, self.p2p.next_rank)], [])
        return None

    def _choose(
        self,
        logits: Optional[torch.Tensor],
        targets: torch.Tensor,
        in_prompt: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The tokens of the newest position ``[b]`` and, with log-probs, those of ``targets`` ``[b, s]``.

        ``targets`` holds the tokens this step's ``s`` logits predict; its last column, the newest position,
        is known only where ``in_prompt`` ``[b]``: elsewhere the sampled token goes there. Computed on the
        last stage (``logits`` ``[b, s|1, V]``; None elsewhere) and broadcast to every rank.
        """
        b, s = targets.shape
        chosen = torch.empty(b, dtype=torch.long, device=self.device)
        log_probs = torch.empty(b, s, device=self.device) if params.return_log_probs else None
        if logits is not None:
            choosable = logits[:, -1, : self.vocab_size].float()  # [b, V]: the tokenizer's ids, not the padding
            sampled = sample_tokens(choosable, params, generator)  # [b]
            chosen = torch.where(in_prompt, targets[:, -1], sampled)
            if log_probs is not None:
                targets = torch.cat([targets[:, :-1], chosen[:, None]], dim=1)  # [b, s]
                log_probs = token_log_probs(logits, targets)  # [b, s]
        return self._share(chosen, log_probs)

    def _share(
        self, chosen: torch.Tensor, log_probs: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The last stage's TP rank 0 values of ``chosen`` / ``log_probs``, on every rank (over TP, then PP)."""
        shared = [chosen] if log_probs is None else [chosen, log_probs]
        hops = []
        if self.module.post_process and self.groups.size_of("tp") > 1:
            hops.append((self.groups.tp, self.groups.ranks["tp"][0]))
        if self.groups.size_of("pp") > 1:
            hops.append((self.groups.pp, self.groups.ranks["pp"][-1]))
        for group, source in hops:
            for tensor in shared:
                dist.broadcast(tensor, src=source, group=group)
        return chosen, log_probs
