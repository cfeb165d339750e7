"""Generation results turned into the answers of both endpoints.

A result's tokens are decoded once as a whole (byte-level BPE pieces only make sense together);
each token's character offset is the length of the decoded prefix before it. A stop string found
in the generated text cuts it there (after it, for Megatron's ``/api``); the tokens kept are those
that start before the cut, and the finish reason becomes ``"stop"``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from tools.text_generation.validation import GenerationRequest


@dataclass
class DecodedResult:
    """One prompt's result as text: prompt and generated parts, per-token strings, offsets, log probs."""

    prompt_text: str
    generated_text: str
    prompt_tokens: List[int]
    generated_tokens: List[int]
    offsets: List[int]  # character offset of every token (prompt then generated) in prompt_text + generated_text
    prompt_log_probs: Optional[List[float]]  # log p(prompt[i] | prompt[:i]) for i >= 1
    generated_log_probs: Optional[List[float]]
    finish_reason: str
    prompt_top: Optional[List[Dict[int, float]]] = None  # the most likely ids at each prompt log prob
    generated_top: Optional[List[Dict[int, float]]] = None


def token_offsets(tokenizer: Any, tokens: Sequence[int]) -> List[int]:
    """Character offset of each token: the length of the decoded text before it."""
    return [len(tokenizer.detokenize(tokens[:i])) for i in range(len(tokens))]


def first_stop(text: str, stops: Sequence[str], keep_stop: bool) -> Optional[int]:
    """Where ``text`` is cut by its earliest stop string (None: no stop string in it)."""
    found = [(text.find(s), s) for s in stops if s in text]
    if not found:
        return None
    pos, stop = min(found)
    return pos + len(stop) if keep_stop else pos


def decode_result(result: Any, request: GenerationRequest, tokenizer: Any) -> DecodedResult:
    """The text of one result, cut at the first stop string; stop tokens are not shown."""
    prompt, generated = list(result.prompt_tokens), list(result.generated_tokens)
    gen_lps = list(result.generated_log_probs) if result.generated_log_probs is not None else None
    stop_ids = set(request.sampling.get("stop_token_ids") or [])
    finish = result.finish_reason or "length"  # nothing to generate (0 tokens): no reason given
    if generated and generated[-1] in stop_ids:
        generated, gen_lps, finish = generated[:-1], gen_lps[:-1] if gen_lps is not None else None, "stop"
    prompt_text = tokenizer.detokenize(prompt)
    full = tokenizer.detokenize(prompt + generated)
    offsets = token_offsets(tokenizer, prompt + generated)
    generated_text = full[len(prompt_text) :]
    cut = first_stop(generated_text, request.stop, request.keep_stop)
    if cut is not None:
        generated_text = generated_text[:cut]
        keep = sum(1 for off in offsets[len(prompt) :] if off - len(prompt_text) < cut)
        generated, offsets, finish = generated[:keep], offsets[: len(prompt) + keep], "stop"
        gen_lps = gen_lps[:keep] if gen_lps is not None else None
    prompt_lps = list(result.prompt_log_probs) if result.prompt_log_probs is not None else None
    prompt_top = getattr(result, "prompt_top_n_logprobs", None)
    gen_top = getattr(result, "generated_top_n_logprobs", None)
    gen_top = None if gen_top is None else list(gen_top)[: len(generated)]
    decoded = DecodedResult(prompt_text, generated_text, prompt, generated, offsets, prompt_lps, gen_lps, finish)
    decoded.prompt_top, decoded.generated_top = prompt_top, gen_top
    return decoded


def api_answer(decoded: Sequence[DecodedResult], request: GenerationRequest, tokenizer: Any) -> Dict[str, Any]:
    """Megatron's ``/api`` answer: prompt + generation per prompt, token strings, log probs or null."""
    logprobs = None
    if request.logprobs is not None:
        logprobs = [list(d.prompt_log_probs or []) + list(d.generated_log_probs or []) for d in decoded]
    return {
        "text": [d.prompt_text + d.generated_text for d in decoded],
        "segments": [[tokenizer.detokenize([t]) for t in d.prompt_tokens + d.generated_tokens] for d in decoded],
        "logprobs": logprobs,
    }


def choice_logprobs(d: DecodedResult, echo: bool, tokenizer: Any) -> Dict[str, List[Any]]:
    """OpenAI's ``logprobs`` object of one choice (the prompt's tokens first when echoed; its first is null).

    ``top_logprobs``: the engine's most likely tokens at each position (their strings; ids that decode to the
    same string keep the higher log prob), or the chosen token alone when the engine gave none.
    """
    tokens = (d.prompt_tokens if echo else []) + d.generated_tokens
    lps: List[Optional[float]] = list(d.generated_log_probs or [])
    tops: List[Optional[Dict[int, float]]] = list(d.generated_top or [None] * len(lps))
    if echo:
        prompt_lps = d.prompt_log_probs or [None] * (len(d.prompt_tokens) - 1)
        lps = [None, *prompt_lps, *lps]
        tops = [None, *(d.prompt_top or [None] * len(prompt_lps)), *tops]
    strings = [tokenizer.detokenize([t]) for t in tokens]
    offsets = d.offsets if echo else [o - len(d.prompt_text) for o in d.offsets[len(d.prompt_tokens) :]]
    return {
        "tokens": strings,
        "token_logprobs": lps,
        "top_logprobs": [top_strings(tokenizer, s, lp, top) for s, lp, top in zip(strings, lps, tops)],
        "text_offset": offsets,
    }


def top_strings(
    tokenizer: Any, chosen: str, lp: Optional[float], top: Optional[Dict[int, float]]
) -> Optional[Dict[str, float]]:
    """One position's ``top_logprobs`` entry: ``{token string: log prob}``."""
    if lp is None:
        return None
    if top is None:
        return {chosen: lp}
    out: Dict[str, float] = {}
    for token, value in top.items():
        text = tokenizer.detokenize([int(token)])
        out[text] = max(value, out.get(text, value))
    return out


def completions_answer(
    decoded: Sequence[DecodedResult], request: GenerationRequest, tokenizer: Any, model_name: str
) -> Dict[str, Any]:
    """OpenAI's ``text_completion`` object, one choice per prompt."""
    choices = []
    for index, d in enumerate(decoded):
        choices.append(
            {
                "index": index,
                "text": (d.prompt_text if request.echo else "") + d.generated_text,
                "logprobs": None if request.logprobs is None else choice_logprobs(d, request.echo, tokenizer),
                "finish_reason": d.finish_reason,
            }
        )
    prompt_tokens = sum(len(d.prompt_tokens) for d in decoded)
    completion_tokens = sum(len(d.generated_tokens) for d in decoded)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def completion_chunk(model_name: str):
    """The streamed ``text_completion`` event builder of one request: ``(index, new text, finish) -> event``."""
    ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(index: int, delta: str, finish: Optional[str]) -> Dict[str, Any]:
        choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": finish}
        return {"id": ident, "object": "text_completion", "created": created, "model": model_name, "choices": [choice]}

    return chunk
