"""OpenAI's ``POST /v1/chat/completions``: messages in, the assistant's reply (``n`` of them, streamed or not) out.

The prompt is the conversation formatted exactly as fine-tuning formatted it
(``megatron.core.datasets.sft_format``): the tokenizer's chat template when it has one, else the
built-in ChatML, followed by the assistant turn's opening. Generation stops at the end-of-document
token or at ChatML's ``<|im_end|>`` (token or text), which is not shown.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence

from megatron.core.datasets.sft_format import (
    CHATML_SPECIAL_TOKENS,
    conversation_messages,
    default_prompt_format,
    generation_prompt_ids,
    hf_tokenizer,
)
from tools.text_generation.responses import DecodedResult
from tools.text_generation.validation import (
    MAX_SEED,
    GenerationRequest,
    PromptContext,
    RequestError,
    check_encodable,
    check_fields,
    check_lengths,
    check_prompt_count,
    get_float,
    get_int,
    get_n_and_stream,
    get_stop,
    short,
    stop_token_ids,
)

CHAT_FIELDS = ("messages", "max_tokens", "temperature", "top_p", "stop", "seed", "model", "n", "stream")
END_OF_TURN = CHATML_SPECIAL_TOKENS[1]


def end_of_turn_ids(tokenizer: Any) -> List[int]:
    """The id of ``<|im_end|>`` when the tokenizer has it as one token."""
    hf = hf_tokenizer(tokenizer)
    convert = getattr(hf, "convert_tokens_to_ids", None)
    token = convert(END_OF_TURN) if convert is not None else None
    return [token] if isinstance(token, int) and token != getattr(hf, "unk_token_id", None) else []


def parse_chat_completions(body: Any, ctx: PromptContext) -> GenerationRequest:
    """The chat body (OpenAI's defaults: temperature 1, top_p 1; ``max_tokens`` 16 here as for completions)."""
    body = check_fields(body, CHAT_FIELDS, ["messages"])
    n, stream = get_n_and_stream(body)
    check_prompt_count([None] * n, ctx)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise RequestError(f"model must be a string, got {short(body['model'])}")
    try:
        messages = conversation_messages({"messages": body["messages"]}, need_assistant=False)
    except ValueError as err:
        raise RequestError(f"messages: {err}, got {short(body['messages'])}") from None
    for i, m in enumerate(messages):
        check_encodable(m["content"], f"message {i}")
    ids = generation_prompt_ids(ctx.tokenizer, messages, default_prompt_format(ctx.tokenizer))
    tokens = get_int(body, "max_tokens", 16, 1)
    check_lengths([ids] * n, tokens, ctx)
    top_p = get_float(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise RequestError("top_p must be above 0 (1 keeps every token)")
    sampling = dict(
        temperature=get_float(body, "temperature", 1.0, 0.0, 2.0),
        top_k=0,
        top_p=0.0 if top_p == 1.0 else top_p,
        num_tokens_to_generate=tokens,
        return_log_probs=False,
        seed=get_int(body, "seed", None, 0, MAX_SEED),
        stop_token_ids=stop_token_ids(ctx) + end_of_turn_ids(ctx.tokenizer),
    )
    return GenerationRequest([ids] * n, sampling, get_stop(body) + [END_OF_TURN], n=n, stream=stream)


def chat_answer(decoded: Sequence[DecodedResult], request: GenerationRequest, model_name: str) -> Dict[str, Any]:
    """OpenAI's ``chat.completion`` object: the assistant's message, ``n`` choices."""
    prompt_tokens = len(decoded[0].prompt_tokens)
    completion_tokens = sum(len(d.generated_tokens) for d in decoded)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [
            {
                "index": index,
                "message": {"role": "assistant", "content": d.generated_text},
                "finish_reason": d.finish_reason,
            }
            for index, d in enumerate(decoded)
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def chat_chunk(model_name: str) -> Callable[[int, str, Optional[str]], Dict[str, Any]]:
    """The ``chat.completion.chunk`` builder of one streamed reply (the role goes with each choice's first)."""
    ident, created, started = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), set()

    def chunk(index: int, delta: str, finish: Optional[str]) -> Dict[str, Any]:
        content = {"content": delta} if index in started else {"role": "assistant", "content": delta}
        started.add(index)
        choice = {"index": index, "delta": content, "finish_reason": finish}
        return {
            "id": ident,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model_name,
            "choices": [choice],
        }

    return chunk
