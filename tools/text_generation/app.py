"""The Flask app rank 0 serves: ``PUT /api`` (Megatron) and ``POST /v1/completions`` (OpenAI).

Requests are handled one at a time (a lock around each): every request becomes collectives that all
ranks must run in the same order.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from flask import Flask, jsonify, request

from tools.text_generation.service import Answer, GenerationService, error_body


def create_app(service: GenerationService, lock: Optional[threading.Lock] = None) -> Flask:
    """The app answering both endpoints through ``service``, serialized by ``lock``."""
    app = Flask("megatron_text_generation")
    lock = lock or threading.Lock()

    def serve(handler: Callable[[Any], Answer]):
        body = request.get_json(force=True, silent=True)
        if body is None:
            status, answer = 400, error_body("the request body must be valid JSON")
        else:
            with lock:
                status, answer = handler(body)
        return jsonify(answer), status

    app.add_url_rule("/api", "api", lambda: serve(service.api), methods=["PUT"])
    app.add_url_rule("/v1/completions", "completions", lambda: serve(service.completions), methods=["POST"])
    return app
