"""Continuous batching over a paged KV cache (megatron-core's ``DynamicInferenceEngine``).

Requests join and leave the running batch at every step. Each ``step`` plans one forward pass under the
context's token budget (``max_tokens``): one token for every decoding request, then the rest of the prompts
being prefilled, then new requests in arrival order while a request slot (``max_requests``) and the blocks
for the whole request (prompt plus ``num_tokens_to_generate``) are free. A prompt longer than the budget
left is prefilled in chunks over several steps (``enable_chunked_prefill``; without it a request waits
until its whole prompt fits). Leading prompt blocks already in the prefix cache are taken, not computed.
A request's blocks go back to the pool when it finishes.

Every rank of the model's groups makes the same calls in the same order (``add_request`` then ``step``):
the plan depends only on them, so each stage knows every step's shapes, and tokens are chosen on the last
stage's TP rank 0 and broadcast as in the static engine (``InferenceEngine``, whose forward and
broadcasting this class reuses). Each request samples with its own generator (seeded with its
``SamplingParams.seed``), so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from megatron.core.inference.block_allocator import block_hashes
from megatron.core.inference.dynamic_context import DynamicInferenceContext, StepEntry
from megatron.core.inference.dynamic_request import DynamicInferenceRequest
from megatron.core.inference.engine import GenerationResult, InferenceEngine
from megatron.core.inference.sampling import sample_tokens, token_log_probs
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.parallel_state import ProcessGroupCollection

Plan = List[Tuple[DynamicInferenceRequest, int]]  # (request, tokens it feeds this step)


class DynamicInferenceEngine(InferenceEngine):
    """Generates from a ``GPTModel`` stage (eval mode) with continuous batching over ``context``.

    Args:
        model: this rank's stage (or a one-element list of it).
        context: the paged KV cache; its ``max_sequence_length`` bounds prompt + generated tokens.
        random_seed: seeds the generators of requests without their own ``seed`` (None: random).
        pg_collection: the model's groups.
        enable_chunked_prefill: split prompts longer than the step's token budget left.
        vocab_size: as ``InferenceEngine``'s (ids from it on are never chosen).
    """

    def __init__(
        self,
        model: Union[torch.nn.Module, List[torch.nn.Module]],
        context: DynamicInferenceContext,
        random_seed: Optional[int] = None,
        *,
        pg_collection: ProcessGroupCollection,
        enable_chunked_prefill: bool = True,
        vocab_size: Optional[int] = None,
    ) -> None:
        super().__init__(model, pg_collection, context.max_sequence_length, vocab_size=vocab_size)
        if not context.materialize_only_last_token_logits:
            raise ValueError(
                "DynamicInferenceEngine: the context's materialize_only_last_token_logits=False; the engine reads "
                "only the rows it asks for (those of requests with log-probs are all there), so it must be True"
            )
        self.context = context
        self.random_seed = random_seed
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: List[DynamicInferenceRequest] = []
        self.active: List[DynamicInferenceRequest] = []
        self.requests: Dict[int, DynamicInferenceRequest] = {}
        self.step_count = 0
        self.prefill_tokens = 0  # prompt positions computed (prefix-cached ones are not)
        self._ids = itertools.count()

    def add_request(
        self, request_id: Optional[int], prompt: Sequence[int], sampling_params: SamplingParams
    ) -> DynamicInferenceRequest:
        """Queue a prompt (token ids); it joins the batch at a coming step. Raises ValueError (before queueing)
        for what the static engine refuses, an id in use, or a request the whole pool cannot hold."""
        request_id = next(self._ids) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"DynamicInferenceEngine.add_request: request_id {request_id} is in use")
        self.check_request(request_id, prompt, sampling_params)
        request = DynamicInferenceRequest(request_id, [int(t) for t in prompt], sampling_params)
        seed = sampling_params.seed
        if seed is None and self.random_seed is not None:
            seed = self.random_seed * 1_000_003 + request_id
        request.generator = self._generator(seed)
        self.requests[request_id] = request
        self.waiting.append(request)
        return request

    def check_request(self, request_id: int, prompt: Sequence[int], sampling_params: SamplingParams) -> None:
        """Raise ValueError for a request ``add_request`` would refuse (reads only the engine's settings)."""
        self._validate([list(prompt)], sampling_params)
        ctx = self.context
        need = ctx.blocks_for(len(prompt) + sampling_params.num_tokens_to_generate)
        if need > ctx.block_count:
            raise ValueError(
                f"request {request_id} needs {need} KV blocks ({len(prompt)} prompt + "
                f"{sampling_params.num_tokens_to_generate} new tokens); the pool holds {ctx.block_count}"
            )
        if not self.enable_chunked_prefill and len(prompt) > ctx.max_tokens:
            raise ValueError(
                f"request {request_id}: a prompt of {len(prompt)} tokens exceeds max_tokens={ctx.max_tokens} "
                "per step and chunked prefill is off"
            )

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.active)

    def abort_request(self, request_id: int) -> None:
        """Stop a request now (finish reason "abort"); its blocks go back to the pool. Collective like ``step``."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        else:
            self._release(request)
        request.finish("abort")
        self.requests.pop(request_id, None)

    def reset(self) -> None:
        """Abort every request (after a failed step: every rank does the same)."""
        for request in list(self.waiting) + list(self.active):
            self.abort_request(request.request_id)

    def generate(self, prompts: List[List[int]], sampling_params: SamplingParams) -> List[GenerationResult]:
        """Every prompt to completion, all in flight together (``InferenceEngine.generate``'s contract)."""
        added = [self.add_request(None, p, sampling_params) for p in prompts]
        while self.has_unfinished_requests():
            self.step()
        return [r.result() for r in added]

    # -- one step ---------------------------------------------------------------------------------

    def step(self) -> List[DynamicInferenceRequest]:
        """One forward pass over the planned tokens of every scheduled request. Returns the requests that
        finished in it (their blocks are back in the pool)."""
        plan = self.schedule()
        if not plan:
            return []
        tokens, entries, logit_rows, sample_rows = self._layout(plan)
        self.context.initialize_attention_state(entries, logit_rows, self.device)
        with torch.no_grad():
            logits = self._forward(tokens[None], self.context)  # [1, R, V] on the last stage
            chosen, log_probs, top_ids, top_values = self._choose_all(plan, logits, logit_rows, sample_rows)
        self.step_count += 1
        return self._update(plan, chosen, log_probs, top_ids, top_values)

    def schedule(self) -> Plan:
        """This step's (request, token count) pairs, decodes first; admits waiting requests that fit."""
        budget = self.context.max_tokens
        plan: Plan = []
        for request in sorted(self.active, key=lambda r: r.computed < len(r.prompt_tokens)):
            n = min(request.remaining, budget)
            if n > 0 and (n == request.remaining or self.enable_chunked_prefill):
                plan.append((request, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.active) < self.context.max_requests:
            request = self.waiting[0]
            if not self.enable_chunked_prefill and len(request.prompt_tokens) > budget:
                break
            if not self._admit(request):
                break
            self.waiting.pop(0)
            n = min(request.remaining, budget)
            plan.append((request, n))
            budget -= n
        return plan

    def _admit(self, request: DynamicInferenceRequest) -> bool:
        """Give ``request`` its blocks (prefix-cached ones first) if the pool has them."""
        ctx, params = self.context, request.sampling_params
        allocator, bs = ctx.allocator, ctx.block_size_tokens
        shared = [] if params.return_log_probs else allocator.match_prefix(request.prompt_tokens)
        need = ctx.blocks_for(len(request.prompt_tokens) + params.num_tokens_to_generate)
        blocks = allocator.allocate(need - len(shared), shared)
        if blocks is None:
            return False
        request.block_ids, request.reused_blocks = blocks, len(shared)
        request.computed = len(shared) * bs
        request.prompt_hashes = block_hashes(request.prompt_tokens, bs, len(request.prompt_tokens) // bs)
        self.active.append(request)
        return True

    def _layout(self, plan: Plan) -> Tuple[torch.Tensor, List[StepEntry], List[int], List[int]]:
        """The flat token row ``[T]``, each request's attention entry, the rows whose logits are needed, and
        (an index into those rows) the row each choosing request samples from."""
        tokens, entries, logit_rows, sample_rows = [], [], [], []
        for request, n in plan:
            row = len(tokens)
            tokens += request.tokens[request.computed : request.computed + n]
            entries.append(StepEntry(request.block_ids, request.computed, n))
            if request.sampling_params.return_log_probs:
                logit_rows += range(row, row + n)
            elif n == request.remaining:
                logit_rows.append(row + n - 1)
            if n == request.remaining:
                sample_rows.append(len(logit_rows) - 1)
        return torch.tensor(tokens, dtype=torch.long, device=self.device), entries, logit_rows, sample_rows

    def _choose_all(
        self, plan: Plan, logits: Optional[torch.Tensor], logit_rows: List[int], sample_rows: List[int]
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Chosen tokens ``[S]``, log-probabilities ``[R]`` of every logit row's next token and the top-n
        ``[R, k]`` ids/values, computed on the last stage and shared with every rank."""
        choosers = [r for r, n in plan if n == r.remaining]
        top_k = max((r.sampling_params.top_n_logprobs for r, _ in plan), default=0)
        want_lp = any(r.sampling_params.return_log_probs for r, _ in plan)
        chosen = torch.zeros(len(choosers), dtype=torch.long, device=self.device)
        log_probs = torch.zeros(len(logit_rows), device=self.device) if want_lp else None
        top_ids = torch.zeros(len(logit_rows), top_k, dtype=torch.long, device=self.device) if top_k else None
        top_values = torch.zeros(len(logit_rows), top_k, device=self.device) if top_k else None
        if logits is not None:
            rows = logits[0].float()  # [R, V]
            chosen = self._sample(choosers, rows[sample_rows, : self.vocab_size])
            if want_lp:
                log_probs = token_log_probs(rows[None], self._targets(plan, chosen)[None])[0]  # [R]
            if top_k:
                top = torch.log_softmax(rows, dim=-1)[:, : self.vocab_size].topk(top_k, dim=-1)  # [R, k]
                top_ids, top_values = top.indices, top.values
        chosen, log_probs = self._share(chosen, log_probs)
        if top_k:
            top_ids, top_values = self._share(top_ids, top_values)
        return chosen, log_probs, top_ids, top_values

    def _sample(self, choosers: List[DynamicInferenceRequest], rows: torch.Tensor) -> torch.Tensor:
        """One token per choosing request from its row of ``rows`` ``[S, vocab]``: argmax for the greedy ones
        (at once), each other one with its own generator."""
        chosen = torch.argmax(rows, dim=-1)  # [S]
        for i, request in enumerate(choosers):
            if not request.sampling_params.greedy:
                chosen[i] = sample_tokens(rows[i : i + 1], request.sampling_params, request.generator)[0]
        return chosen

    def _targets(self, plan: Plan, chosen: torch.Tensor) -> torch.Tensor:
        """The token each logit row predicts ``[R]``: the next known token, or the chosen one (0 where none)."""
        targets, chooser = [], 0
        for request, n in plan:
            rows = range(request.computed, request.computed + n)
            if not request.sampling_params.return_log_probs:
                rows = rows[-1:] if n == request.remaining else []
            known = request.tokens
            for p in rows:
                targets.append(known[p + 1] if p + 1 < len(known) else int(chosen[chooser]))
            chooser += n == request.remaining
        return torch.tensor(targets, dtype=torch.long, device=chosen.device)

    def _update(
        self,
        plan: Plan,
        chosen: torch.Tensor,
        log_probs: Optional[torch.Tensor],
        top_ids: Optional[torch.Tensor],
        top_values: Optional[torch.Tensor],
    ) -> List[DynamicInferenceRequest]:
        """Record the step's tokens and log-probabilities, register full prompt blocks, release finished ones."""
        chosen_list = chosen.tolist()
        lps = log_probs.tolist() if log_probs is not None else None
        tops = None if top_ids is None else list(zip(top_ids.tolist(), top_values.tolist()))
        finished, row, chooser = [], 0, 0
        for request, n in plan:
            start, chooses = request.computed, n == request.remaining
            self.prefill_tokens += max(0, min(start + n, len(request.prompt_tokens)) - start)
            if request.sampling_params.return_log_probs:
                for p in range(start, start + n):
                    self._record_log_prob(request, p + 1, lps[row], tops[row] if tops else None)
                    row += 1
            elif chooses:
                row += 1
            request.computed += n
            self._register_prompt_blocks(request)
            if chooses:
                self._choose_for(request, chosen_list[chooser])
                chooser += 1
            if request.finished:
                self._release(request)
                finished.append(request)
        return finished

    def _record_log_prob(self, request: DynamicInferenceRequest, target: int, value: float, top) -> None:
        params = request.sampling_params
        if target < len(request.prompt_tokens) or params.num_tokens_to_generate > 0:
            top_n = None
            if params.top_n_logprobs:
                ids, values = top
                top_n = dict(zip(ids[: params.top_n_logprobs], values[: params.top_n_logprobs]))
            request.record_log_prob(target, value, top_n)

    def _choose_for(self, request: DynamicInferenceRequest, token: int) -> None:
        if request.sampling_params.num_tokens_to_generate == 0:
            request.finish("length")  # the prompt's log-probabilities were all it asked for
        else:
            request.record_token(token)

    def _register_prompt_blocks(self, request: DynamicInferenceRequest) -> None:
        """Offer the prompt's blocks whose positions are all computed to the prefix cache."""
        done = min(request.computed, len(request.prompt_tokens)) // self.context.block_size_tokens
        for i in range(request.reused_blocks, done):
            self.context.allocator.register(request.block_ids[i], request.prompt_hashes[i])

    def _release(self, request: DynamicInferenceRequest) -> None:
        self.active.remove(request)
        self.context.allocator.release(request.block_ids)
        request.block_ids = []
        self.requests.pop(request.request_id, None)
