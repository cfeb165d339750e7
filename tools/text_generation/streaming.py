"""``stream: true``: server-sent events carrying each choice's text as it grows.

Every event holds the new text of one choice since its last event: the decoded text so far (as the whole
answer would decode it: ``responses.decode_result``, stop strings cut), minus what may still change, a
trailing incomplete character (U+FFFD) and an ending that could begin a stop string. The last event of a
choice holds the rest of its final text and its finish reason, so the concatenated text equals the
non-streaming answer. The stream ends with ``data: [DONE]``; a failure is sent as an ``error`` event first.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from tools.text_generation.errors import GenerationFailed
from tools.text_generation.responses import decode_result, first_stop
from tools.text_generation.validation import GenerationRequest

ChunkFn = Callable[[int, str, Optional[str]], Dict[str, Any]]  # (choice index, new text, finish reason)
DONE = "data: [DONE]\n\n"


def sse(obj: Dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def settled_text(text: str, stops: Sequence[str]) -> str:
    """``text`` without what later tokens may still change: a trailing replacement character (a character
    whose bytes are not all generated yet) and the longest ending that begins a stop string."""
    text = text.rstrip("\ufffd")
    held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - held]


def stop_check(request: GenerationRequest, tokenizer: Any) -> Optional[Callable[[int, List[int]], bool]]:
    """Whether a choice's generated tokens already hold a stop string (the engine may stop it early)."""
    if not request.stop:
        return None

    def check(index: int, generated: List[int]) -> bool:
        prompt = request.prompts[index]
        text = tokenizer.detokenize(prompt + list(generated))[len(tokenizer.detokenize(prompt)) :]
        return first_stop(text, request.stop, request.keep_stop) is not None

    return check


def sse_stream(
    submission: Any, request: GenerationRequest, tokenizer: Any, chunk: ChunkFn, on_close: Callable[[], None]
) -> Iterator[str]:
    """The events of ``submission`` (``engine_loop.Submission``); ``on_close`` runs when the stream ends or the
    client leaves."""
    sent = [""] * len(request.prompts)
    try:
        for index, result, finished in submission.events():
            decoded = decode_result(result, request, tokenizer)
            text = decoded.generated_text if finished else settled_text(decoded.generated_text, request.stop)
            if not text.startswith(sent[index]):
                continue  # a decoding that changed earlier text: wait for the final one
            delta, sent[index] = text[len(sent[index]) :], text
            if delta or finished:
                yield sse(chunk(index, delta, decoded.finish_reason if finished else None))
    except GenerationFailed as err:
        yield sse({"error": {"message": str(err), "type": "server_error", "code": err.status}})
    finally:
        on_close()
    yield DONE
