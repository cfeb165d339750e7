"""One request end to end: check it, generate on every rank, answer it.

The generate step is injected (rank 0 broadcasts the command before calling the engine; tests pass
a fake), so this module needs neither torch.distributed nor a model.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from tools.text_generation.chat import chat_answer, chat_chunk, parse_chat_completions
from tools.text_generation.errors import BAD_INPUT, describe, status_of
from tools.text_generation.responses import api_answer, completion_chunk, completions_answer, decode_result
from tools.text_generation.streaming import sse_stream, stop_check
from tools.text_generation.validation import (
    GenerationRequest,
    PromptContext,
    RequestError,
    parse_api,
    parse_completions,
)

GenerateFn = Callable[[List[List[int]], Dict[str, Any]], Sequence[Any]]
Answer = Tuple[int, Dict[str, Any]]


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 503: "server_overloaded"}


def error_body(message: str, status: int = BAD_INPUT) -> Dict[str, Any]:
    """The JSON of a refused or failed request (OpenAI's error shape, used by both endpoints)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "code": status}}


class GenerationService:
    """Turns request bodies into answers.

    Args:
        generate: ``(prompts, sampling kwargs) -> results`` (``GenerationResult``-like objects);
            what it raises is answered as ``errors.status_of`` says: a ``ValueError`` is the client's
            fault (400), as the engine's own checks are; out of memory 503; ``GenerationFailed`` its own
            status (a failure on another rank); anything else 500.
        ctx: the tokenizer and limits requests are checked against.
        check_sampling: raises ``ValueError`` for sampling settings the engine refuses
            (``SamplingParams(**kwargs)``), called before ``generate`` so no rank starts on them.
        model_name: the ``model`` field of OpenAI answers.
        submit: ``(prompts, sampling kwargs, stop check) -> Submission`` (``engine_loop.EngineLoop.submit``):
            the progress of each prompt, for ``stream: true``; None refuses streaming (400).
    """

    def __init__(
        self,
        generate: GenerateFn,
        ctx: PromptContext,
        check_sampling: Callable[[Dict[str, Any]], Any],
        model_name: str = "megatron",
        submit: Optional[Callable[..., Any]] = None,
    ):
        self.generate = generate
        self.ctx = ctx
        self.check_sampling = check_sampling
        self.model_name = model_name
        self.submit = submit

    def api(self, body: Any) -> Answer:
        """``PUT /api``."""
        return self._answer(body, parse_api, lambda decoded, req: api_answer(decoded, req, self.ctx.tokenizer))

    def completions(self, body: Any) -> Answer:
        """``POST /v1/completions``."""
        return self._answer(
            body,
            parse_completions,
            lambda decoded, req: completions_answer(decoded, req, self.ctx.tokenizer, self.model_name),
            completion_chunk,
        )

    def chat_completions(self, body: Any) -> Answer:
        """``POST /v1/chat/completions``."""
        return self._answer(
            body, parse_chat_completions, lambda decoded, req: chat_answer(decoded, req, self.model_name), chat_chunk
        )

    def _answer(self, body: Any, parse: Callable, build: Callable, chunk: Optional[Callable] = None) -> Answer:
        """(status, JSON answer), or (200, an iterator of server-sent events) for ``stream: true``."""
        try:
            request = parse(body, self.ctx)
            self.check_sampling(request.sampling)
            if request.stream and self.submit is None:
                raise RequestError("stream=true needs the dynamic engine; this server answers whole replies only")
        except (RequestError, ValueError) as err:
            return BAD_INPUT, error_body(str(err))
        if request.stream:
            return self._stream(request, chunk(self.model_name))
        try:
            results = self.generate(request.prompts, request.sampling)
            decoded = [decode_result(r, request, self.ctx.tokenizer) for r in results]
            return 200, build(decoded, request)
        except Exception as err:  # noqa: BLE001 - answered, never the end of the server
            status = status_of(err)
            return status, error_body(describe(err), status)

    def _stream(self, request: GenerationRequest, chunk: Callable) -> Answer:
        tokenizer = self.ctx.tokenizer
        try:
            submission = self.submit(request.prompts, request.sampling, stop_check(request, tokenizer))
        except Exception as err:  # noqa: BLE001 - a refusal (400) or a full queue (503), answered as JSON
            status = status_of(err)
            return status, error_body(describe(err), status)
        return 200, sse_stream(submission, request, tokenizer, chunk, submission.cancel)
