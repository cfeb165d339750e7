"""Request bodies of both endpoints, checked before any rank does work.

Every rule failure raises :class:`RequestError` naming the field, the value and the rule; the
app answers it with HTTP 400 and keeps serving. A valid body becomes a :class:`GenerationRequest`:
token ids per prompt and the keyword arguments of ``SamplingParams`` (plain data, so that rank 0
can broadcast them to the other ranks).
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

# Megatron's own limits (megatron/inference/endpoints/completions.py and text_generation_server.py).
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1000
MAX_OPENAI_LOGPROBS = 5
MAX_STOP_STRINGS = 4
MAX_PROMPTS = 128  # prompts per request (Megatron's text_generation_server refuses more)
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes 64-bit seeds
MAX_N = 128  # OpenAI's bound on choices per prompt


class RequestError(ValueError):
    """A request that breaks a rule; its message goes back to the client with HTTP 400."""


@dataclass
class GenerationRequest:
    """One validated request, ready for the engine.

    Attributes:
        prompts: token ids of each prompt (never empty).
        sampling: ``SamplingParams`` keyword arguments.
        stop: strings that end a generation (cut from the text unless ``keep_stop``).
        keep_stop: keep the stop string in the text (Megatron's ``/api`` keeps the end-of-line).
        echo: the answer's text starts with the prompt.
        logprobs: OpenAI's ``logprobs`` (None: no log probs); for ``/api`` 0 or None.
        n: choices per prompt (``prompts`` holds each prompt ``n`` times in a row).
        stream: answer with server-sent events as tokens arrive.
    """

    prompts: List[List[int]]
    sampling: Dict[str, Any]
    stop: List[str] = field(default_factory=list)
    keep_stop: bool = False
    echo: bool = False
    logprobs: Optional[int] = None
    n: int = 1
    stream: bool = False


def check_fields(body: Any, allowed: Sequence[str], required: Sequence[str]) -> Mapping[str, Any]:
    """``body`` as a JSON object with only ``allowed`` fields and every ``required`` one."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}; accepted fields: {sorted(allowed)}")
    missing = [name for name in required if name not in body]
    if missing:
        raise RequestError(f"missing field(s) {missing}")
    return body


def short(value: Any) -> str:
    """``repr(value)`` cut short in length and depth: an error message never echoes a whole request back."""
    return reprlib.repr(value)


def get_int(body: Mapping[str, Any], name: str, default: Optional[int], low: int, high: Optional[int] = None) -> Any:
    """``body[name]`` as an int in [low, high] (booleans are not ints here); ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {short(value)}")
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"between {low} and {high}"
        raise RequestError(f"{name} must be {bound}, got {value}")
    return value


def get_float(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    """``body[name]`` as a number in [low, high]; ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {short(value)}")
    if not low <= value <= high:
        raise RequestError(f"{name} must be between {low} and {high}, got {value}")
    return float(value)


def get_bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {short(value)}")
    return value


def get_stop(body: Mapping[str, Any]) -> List[str]:
    """OpenAI's ``stop``: null, a string, or a list of up to 4 non-empty strings."""
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of non-empty strings, got {short(value)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop holds at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for i, text in enumerate(stops):
        check_encodable(text, f"stop string {i}")
    return list(stops)


def is_token_list(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def encode_prompts(
    prompts: Sequence[Any], tokenizer: Any, vocab_size: int, bos: Optional[int] = None
) -> List[List[int]]:
    """Token ids of each prompt (a string, or already token ids), ``bos`` in front when given."""
    encoded = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            check_encodable(prompt, f"prompt {i}")
        ids = list(prompt) if isinstance(prompt, list) else tokenizer.tokenize(prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"prompt {i} holds token ids outside [0, {vocab_size}): {bad[:5]}")
        ids = ([bos] if bos is not None else []) + ids
        if not ids:
            raise RequestError(f"prompt {i} is empty (no tokens)")
        encoded.append(ids)
    return encoded


def check_encodable(text: str, what: str) -> None:
    """``text`` must be valid Unicode (JSON's ``"\\ud800"`` escapes decode to lone surrogates, which are not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(
            f"{what} holds an invalid character at {err.start} (a lone surrogate?): {err.reason}"
        ) from None


def check_prompt_count(prompts: Sequence[Any], ctx: PromptContext) -> None:
    """At most ``ctx.max_prompts`` prompts, counted before any is tokenized."""
    if len(prompts) > ctx.max_prompts:
        raise RequestError(f"a request holds at most {ctx.max_prompts} prompts, got {len(prompts)}")


def check_lengths(prompts: Sequence[Sequence[int]], tokens_to_generate: int, ctx: PromptContext) -> None:
    """Every prompt plus the tokens to generate must fit the model's sequence length, and all of them
    together ``ctx.max_request_tokens`` (the batch the engine holds at once)."""
    for i, ids in enumerate(prompts):
        if len(ids) + tokens_to_generate > ctx.max_sequence_length:
            raise RequestError(
                f"prompt {i} has {len(ids)} tokens; with {tokens_to_generate} tokens to generate that is "
                f"{len(ids) + tokens_to_generate}, over the maximum sequence length {ctx.max_sequence_length}"
            )
    total = sum(len(ids) + tokens_to_generate for ids in prompts)
    if ctx.max_request_tokens is not None and total > ctx.max_request_tokens:
        raise RequestError(
            f"the request needs {total} tokens (prompt tokens plus tokens to generate, over all prompts), "
            f"over the limit of {ctx.max_request_tokens} per request"
        )


@dataclass
class PromptContext:
    """What checking a request needs to know of the served model."""

    tokenizer: Any
    vocab_size: int
    max_sequence_length: int
    eod: Optional[int]
    max_prompts: int = MAX_PROMPTS
    max_request_tokens: Optional[int] = None  # prompt + generated tokens over all prompts; None: no limit


API_FIELDS = (
    "prompts",
    "tokens_to_generate",
    "logprobs",
    "temperature",
    "top_k",
    "top_p",
    "add_BOS",
    "stop_on_eol",
    "stop_on_double_eol",
    "random_seed",
)
COMPLETIONS_FIELDS = (
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "logprobs",
    "echo",
    "stop",
    "seed",
    "model",
    "n",
    "stream",
)


def parse_api(body: Any, ctx: PromptContext) -> GenerationRequest:
    """Megatron's ``PUT /api`` body (its defaults: 64 tokens, temperature 1, no top-k/top-p).

    Unlike Megatron, temperature 0 is accepted and means greedy (as ``top_k`` 1 does).
    """
    body = check_fields(body, API_FIELDS, ["prompts"])
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise RequestError(f"prompts must be a non-empty list of strings, got {short(prompts)}")
    check_prompt_count(prompts, ctx)
    tokens = get_int(body, "tokens_to_generate", 64, 0)
    logprobs = get_bool(body, "logprobs")
    if tokens == 0 and not logprobs:
        raise RequestError("tokens_to_generate=0 implies logprobs should be true (nothing else to return)")
    top_k = get_int(body, "top_k", 0, 0, MAX_TOP_K)
    top_p = get_float(body, "top_p", 0.0, 0.0, 1.0)
    if top_k > 0 and top_p > 0:
        raise RequestError(f"cannot set both top_k ({top_k}) and top_p ({top_p})")
    seed = get_int(body, "random_seed", -1, -1, MAX_SEED)
    stop = ["\n\n"] if get_bool(body, "stop_on_double_eol") else []
    stop = ["\n"] if get_bool(body, "stop_on_eol") else stop
    add_bos = get_bool(body, "add_BOS")
    if add_bos and ctx.eod is None:
        raise RequestError("add_BOS: the tokenizer has no end-of-document token to use as BOS")
    bos = ctx.eod if add_bos else None
    ids = encode_prompts(prompts, ctx.tokenizer, ctx.vocab_size, bos)
    check_lengths(ids, tokens, ctx)
    sampling = dict(
        temperature=get_float(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
        top_k=top_k,
        top_p=top_p,
        num_tokens_to_generate=tokens,
        return_log_probs=logprobs,
        seed=None if seed < 0 else seed,
        stop_token_ids=stop_token_ids(ctx),
    )
    return GenerationRequest(ids, sampling, stop, keep_stop=True, echo=True, logprobs=0 if logprobs else None)


def parse_completions(body: Any, ctx: PromptContext) -> GenerationRequest:
    """OpenAI's ``POST /v1/completions`` body (its defaults: 16 tokens, temperature 1, top_p 1)."""
    body = check_fields(body, COMPLETIONS_FIELDS, ["prompt"])
    n, stream = get_n_and_stream(body)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise RequestError(f"model must be a string, got {short(body['model'])}")
    prompts = completion_prompts(body["prompt"])
    check_prompt_count(prompts * n, ctx)
    tokens = get_int(body, "max_tokens", 16, 0)
    logprobs = get_int(body, "logprobs", None, 0, MAX_OPENAI_LOGPROBS)
    echo = get_bool(body, "echo")
    if stream and (logprobs is not None or echo):
        raise RequestError("stream=true streams the text only: leave out logprobs and echo")
    top_p = get_float(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise RequestError("top_p must be above 0 (1 keeps every token)")
    ids = [p for p in encode_prompts(prompts, ctx.tokenizer, ctx.vocab_size) for _ in range(n)]
    check_lengths(ids, tokens, ctx)
    seed = get_int(body, "seed", None, 0, MAX_SEED)
    sampling = dict(
        temperature=get_float(body, "temperature", 1.0, 0.0, 2.0),
        top_k=0,
        top_p=0.0 if top_p == 1.0 else top_p,
        num_tokens_to_generate=tokens,
        return_log_probs=logprobs is not None,
        seed=seed,
        stop_token_ids=stop_token_ids(ctx),
        top_n_logprobs=logprobs or 0,
    )
    return GenerationRequest(ids, sampling, get_stop(body), echo=echo, logprobs=logprobs, n=n, stream=stream)


def get_n_and_stream(body: Mapping[str, Any]) -> tuple:
    """OpenAI's ``n`` (choices per prompt, 1 .. MAX_N) and ``stream``."""
    return get_int(body, "n", 1, 1, MAX_N), get_bool(body, "stream")


def completion_prompts(value: Any) -> List[Any]:
    """OpenAI's ``prompt``: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(value, str):
        return [value]
    if is_token_list(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, str) or is_token_list(p) for p in value):
        return list(value)
    raise RequestError(
        "prompt must be a string, a non-empty list of strings, a list of token ids or a list of token-id lists"
    )


def stop_token_ids(ctx: PromptContext) -> List[int]:
    """The end-of-document token ends every generation."""
    return [] if ctx.eod is None else [ctx.eod]
