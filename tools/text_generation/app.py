"""The Flask app rank 0 serves: ``PUT /api`` (Megatron), ``POST /v1/completions`` and ``POST /v1/chat/completions``
(OpenAI), and its HTTP server.

Connections are served by threads (at most ``ServerLimits.max_connections`` at once: more are answered
503 at once), each with a read timeout, so a client that stalls holds one thread and nothing else.
Handlers take no lock: they queue their prompts to the engine loop (``engine_loop.py``), which batches
every request in flight and runs the collectives all ranks share, and wait for (or stream) the results.
A body is checked (API key, size) before it is read. Every answer, errors included, is JSON, except the
server-sent events of ``stream: true``.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import ClientDisconnected, HTTPException
from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

from tools.text_generation.errors import FAILED, OVERLOAD
from tools.text_generation.service import Answer, GenerationService, error_body


@dataclass
class ServerLimits:
    """What one client may ask of the server (the ``--max-*``, ``--request-read-timeout`` and ``--api-key`` flags)."""

    max_body_bytes: int = 4 * 1024 * 1024
    max_connections: int = 64
    read_timeout_s: float = 10.0
    api_key: Optional[str] = None


def create_app(
    service: GenerationService, lock: Optional[threading.Lock] = None, limits: Optional[ServerLimits] = None
) -> Flask:
    """The app answering every endpoint through ``service``; ``lock`` (None: none) serializes the handlers."""
    app = Flask("megatron_text_generation")
    lock = lock or contextlib.nullcontext()
    limits = limits or ServerLimits()
    # Werkzeug stops reading a chunked body at this length: one byte more than allowed tells it was over.
    app.config["MAX_CONTENT_LENGTH"] = limits.max_body_bytes + 1

    def serve(handler: Callable[[Any], Answer]):
        body, refusal = checked_body(limits)
        if refusal is not None:
            return refusal
        with lock:
            status, answer = handler(body)
        if not isinstance(answer, dict):  # server-sent events, produced as the engine steps
            return Response(answer, status=status, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})
        return jsonify(answer), status

    @app.errorhandler(HTTPException)
    def http_error(err: HTTPException):  # 404, 405, 413 ... as JSON, not Werkzeug's HTML page
        return jsonify(error_body(f"{err.name}: {err.description}", err.code or FAILED)), err.code

    @app.errorhandler(Exception)
    def internal_error(err: Exception):
        app.logger.exception("request failed")
        return jsonify(error_body(f"internal error: {type(err).__name__}: {err}", FAILED)), FAILED

    app.add_url_rule("/api", "api", lambda: serve(service.api), methods=["PUT"])
    app.add_url_rule("/v1/completions", "completions", lambda: serve(service.completions), methods=["POST"])
    app.add_url_rule(
        "/v1/chat/completions", "chat_completions", lambda: serve(service.chat_completions), methods=["POST"]
    )
    return app


def refuse(status: int, message: str, **headers: str) -> Tuple[Response, int]:
    response = jsonify(error_body(message, status))
    response.headers.update(headers)
    return response, status


def checked_body(limits: ServerLimits) -> Tuple[Any, Optional[Tuple[Response, int]]]:
    """(the parsed JSON body, None) or (None, the refusal): 401 without the API key, 413 for a body over
    the limit (by its Content-Length, before reading it), 408 when the client stops sending, 400 when
    it is not JSON (including nesting too deep to parse)."""
    if limits.api_key is not None and not authorized(request.headers.get("Authorization", ""), limits.api_key):
        return None, refuse(401, "missing or wrong API key (send 'Authorization: Bearer KEY')", **BEARER)
    size = request.content_length
    if size is not None and size > limits.max_body_bytes:
        return None, refuse(413, f"the request body has {size} bytes, over the limit of {limits.max_body_bytes}")
    try:
        data = request.get_data(cache=False)
    except (OSError, ClientDisconnected):  # the socket's read timeout (Werkzeug: "disconnected"), or a dropped one
        message = f"the request body stopped arriving (nothing for {limits.read_timeout_s:g} s, or the client left)"
        return None, refuse(408, message)
    if len(data) > limits.max_body_bytes:  # a chunked body (no Content-Length), cut at the limit plus one byte
        return None, refuse(413, f"the request body is over the limit of {limits.max_body_bytes} bytes")
    try:
        return json.loads(data), None
    except (ValueError, RecursionError) as err:  # RecursionError: nesting deeper than the parser's stack
        return None, refuse(400, f"the request body must be valid JSON ({type(err).__name__}: {str(err)[:200]})")


BEARER = {"WWW-Authenticate": "Bearer"}


def authorized(header: str, api_key: str) -> bool:
    """Whether ``Authorization`` carries ``Bearer <api_key>`` (compared in constant time)."""
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class BoundedThreadedServer(ThreadedWSGIServer):
    """Werkzeug's threaded server with at most ``max_connections`` connections served at once.

    A connection beyond them is answered 503 and closed by the accepting thread without being read.
    """

    def __init__(self, host: str, port: int, app: Flask, limits: ServerLimits):
        handler = type("TimedRequestHandler", (WSGIRequestHandler,), {"timeout": limits.read_timeout_s})
        super().__init__(host, port, app, handler)
        self.slots = threading.BoundedSemaphore(limits.max_connections)
        self.max_connections = limits.max_connections

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.answer_overloaded(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def answer_overloaded(self, connection: socket.socket) -> None:
        message = f"the server is serving its maximum of {self.max_connections} connections; retry later"
        body = json.dumps(error_body(message, OVERLOAD)).encode()
        head = f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        try:
            connection.settimeout(1.0)
            connection.sendall(head.encode() + b"Retry-After: 1\r\nConnection: close\r\n\r\n" + body)
            _linger(connection)
        except OSError:
            pass  # the client is gone or not reading: closing is all that is left


LINGER_S, LINGER_BYTES = 0.25, 64 * 1024  # how long / how much of an unread request is drained before closing


def _linger(connection: socket.socket) -> None:
    """Half-close, then read (and drop) what the client is still sending, briefly: closing a socket with unread
    input resets the connection, and a client still writing its request would get the reset, not the answer."""
    connection.shutdown(socket.SHUT_WR)
    deadline, drained = time.monotonic() + LINGER_S, 0
    while drained < LINGER_BYTES and time.monotonic() < deadline:
        connection.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = connection.recv(4096)  # b"": the client closed after reading the answer
        if not chunk:
            return
        drained += len(chunk)
