"""One request end to end: check it, generate on every rank, answer it.

The generate step is injected (rank 0 broadcasts the command before calling the engine; tests pass
a fake), so this module needs neither torch.distributed nor a model.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

from tools.text_generation.chat import chat_answer, parse_chat_completions
from tools.text_generation.errors import BAD_INPUT, describe, status_of
from tools.text_generation.responses import api_answer, completions_answer, decode_result
from tools.text_generation.validation import (
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
    """

    def __init__(
        self,
        generate: GenerateFn,
        ctx: PromptContext,
        check_sampling: Callable[[Dict[str, Any]], Any],
        model_name: str = "megatron",
    ):
        self.generate = generate
        self.ctx = ctx
        self.check_sampling = check_sampling
        self.model_name = model_name

    def api(self, body: Any) -> Answer:
        """``PUT /api``."""
        return self._answer(body, parse_api, lambda decoded, req: api_answer(decoded, req, self.ctx.tokenizer))

    def completions(self, body: Any) -> Answer:
        """``POST /v1/completions``."""
        return self._answer(
            body,
            parse_completions,
            lambda decoded, req: completions_answer(decoded, req, self.ctx.tokenizer, self.model_name),
        )

    def chat_completions(self, body: Any) -> Answer:
        """``POST /v1/chat/completions``."""
        return self._answer(
            body, parse_chat_completions, lambda decoded, req: chat_answer(decoded, req, self.model_name)
        )

    def _answer(self, body: Any, parse: Callable, build: Callable) -> Answer:
        try:
            request = parse(body, self.ctx)
            self.check_sampling(request.sampling)
        except (RequestError, ValueError) as err:
            return BAD_INPUT, error_body(str(err))
        try:
            results = self.generate(request.prompts, request.sampling)
            decoded = [decode_result(r, request, self.ctx.tokenizer) for r in results]
            return 200, build(decoded, request)
        except Exception as err:  # noqa: BLE001 - answered, never the end of the server
            status = status_of(err)
            return status, error_body(describe(err), status)
