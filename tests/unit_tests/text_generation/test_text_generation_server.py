"""The server's HTTP layer with a fake engine: request checks, answers of both endpoints, stop handling.

The fake tokenizer maps one character to one id (its code point), so texts, offsets and cuts are easy
to state; the fake engine continues every prompt with a fixed script of characters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import pytest

pytest.importorskip("flask")

from tools.text_generation.app import ServerLimits, create_app  # noqa: E402
from tools.text_generation.errors import GenerationFailed  # noqa: E402
from tools.text_generation.service import GenerationService  # noqa: E402
from tools.text_generation.validation import PromptContext  # noqa: E402

EOD = 0
SCRIPT = "ab\ncd\n\nef"


class CharTokenizer:
    vocab_size = 256
    eod = EOD

    def tokenize(self, text: str) -> List[int]:
        return [ord(c) for c in text]

    def detokenize(self, ids) -> str:
        return "".join(chr(i) for i in ids if i != EOD) if ids else ""


@dataclass
class FakeResult:
    prompt_tokens: List[int]
    generated_tokens: List[int]
    prompt_log_probs: Optional[List[float]]
    generated_log_probs: Optional[List[float]]
    finish_reason: str


def lp(token: int) -> float:
    """The fake model's log prob of a token: distinct per token, so misalignment shows."""
    return -token / 100.0


class FakeEngine:
    """Continues each prompt with ``script`` (then EOD when ``end_with_eod``), recording its calls."""

    def __init__(self, script: str = SCRIPT, end_with_eod: bool = False):
        self.script, self.end_with_eod, self.calls = script, end_with_eod, []

    def generate(self, prompts: List[List[int]], sampling: Dict[str, Any]) -> List[FakeResult]:
        self.calls.append((prompts, sampling))
        out = []
        n = sampling["num_tokens_to_generate"]
        for prompt in prompts:
            gen = [ord(c) for c in self.script][:n]
            reason = "length"
            if self.end_with_eod and len(gen) < n:
                gen, reason = gen + [EOD], "stop"
            lps = sampling["return_log_probs"]
            out.append(
                FakeResult(
                    prompt,
                    gen,
                    [lp(t) for t in prompt[1:]] if lps else None,
                    [lp(t) for t in gen] if lps else None,
                    reason,
                )
            )
        return out


def check_sampling(sampling: Dict[str, Any]) -> None:
    if sampling["temperature"] > 50:
        raise ValueError("the engine refuses temperature above 50")


@pytest.fixture
def engine():
    return FakeEngine()


MAX_REQUEST_TOKENS = 100


def make_client(engine: FakeEngine, max_len: int = 32, limits: Optional[ServerLimits] = None, tokenizer=None):
    ctx = PromptContext(tokenizer or CharTokenizer(), 256, max_len, EOD, max_request_tokens=MAX_REQUEST_TOKENS)
    return create_app(GenerationService(engine.generate, ctx, check_sampling, "tiny"), limits=limits).test_client()


def put_api(client, body):
    return client.put("/api", json=body)


def post_completions(client, body):
    return client.post("/v1/completions", json=body)


def test_api_returns_prompt_plus_generation_and_token_segments(engine):
    res = put_api(make_client(engine), {"prompts": ["hi", "yo"], "tokens_to_generate": 2, "top_k": 1})
    assert res.status_code == 200, res.json
    assert res.json["text"] == ["hiab", "yoab"]
    assert res.json["segments"][0] == ["h", "i", "a", "b"]
    assert res.json["logprobs"] is None
    prompts, sampling = engine.calls[0]
    assert prompts == [[ord("h"), ord("i")], [ord("y"), ord("o")]]
    assert sampling["top_k"] == 1 and sampling["num_tokens_to_generate"] == 2 and sampling["stop_token_ids"] == [EOD]


def test_api_logprobs_cover_every_token_after_the_first(engine):
    res = put_api(make_client(engine), {"prompts": ["hi"], "tokens_to_generate": 2, "logprobs": True})
    assert res.json["logprobs"] == [[lp(ord(c)) for c in "iab"]]


def test_api_stop_on_eol_keeps_the_newline_and_add_bos_prepends_eod(engine):
    res = put_api(
        make_client(engine), {"prompts": ["x"], "tokens_to_generate": 8, "stop_on_eol": True, "add_BOS": True}
    )
    assert res.json["text"] == ["xab\n"]
    assert engine.calls[0][0] == [[EOD, ord("x")]]
    res = put_api(make_client(engine), {"prompts": ["x"], "tokens_to_generate": 9, "stop_on_double_eol": True})
    assert res.json["text"] == ["xab\ncd\n\n"]


def test_completions_shape_and_stop_string_cut(engine):
    body = {"prompt": "hi", "max_tokens": 9, "temperature": 0, "stop": ["\n\n", "d"], "logprobs": 1, "model": "x"}
    res = post_completions(make_client(engine), body)
    assert res.status_code == 200, res.json
    answer = res.json
    assert answer["object"] == "text_completion" and answer["model"] == "tiny"
    (choice,) = answer["choices"]
    assert choice["text"] == "ab\nc" and choice["finish_reason"] == "stop" and choice["index"] == 0
    assert choice["logprobs"]["tokens"] == ["a", "b", "\n", "c"]
    assert choice["logprobs"]["token_logprobs"] == [lp(ord(c)) for c in "ab\nc"]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 3]
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert engine.calls[0][1]["temperature"] == 0.0 and engine.calls[0][1]["top_p"] == 0.0


def test_completions_echo_logprobs_zero_tokens_scores_the_prompt(engine):
    res = post_completions(make_client(engine), {"prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 0})
    (choice,) = res.json["choices"]
    assert choice["text"] == "abc"
    assert choice["logprobs"]["token_logprobs"] == [None, lp(ord("b")), lp(ord("c"))]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2]
    assert choice["logprobs"]["top_logprobs"] == [None, {"b": lp(ord("b"))}, {"c": lp(ord("c"))}]


def test_completions_accepts_token_id_prompts_as_lm_eval_sends_them(engine):
    body = {"prompt": [[104, 105], [120]], "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0, "seed": 1234}
    res = post_completions(make_client(engine), body)
    assert [c["text"] for c in res.json["choices"]] == ["hia", "xa"]
    assert res.json["choices"][0]["logprobs"]["token_logprobs"] == [None, lp(105), lp(ord("a"))]
    assert engine.calls[0][1]["seed"] == 1234


def test_end_of_document_ends_the_generation_and_is_not_shown():
    engine = FakeEngine("ab", end_with_eod=True)
    res = post_completions(make_client(engine), {"prompt": "x", "max_tokens": 5, "logprobs": 0})
    (choice,) = res.json["choices"]
    assert choice["text"] == "ab" and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"] == ["a", "b"]
    res = post_completions(make_client(FakeEngine("ab")), {"prompt": "x", "max_tokens": 2})
    assert res.json["choices"][0]["finish_reason"] == "length"


BAD_REQUESTS = [
    ("/api", {"prompts": "hi"}, "prompts must be"),
    ("/api", {"prompts": []}, "prompts must be"),
    ("/api", {"prompts": ["hi"], "tokens_to_generate": -1}, "tokens_to_generate must be at least 0"),
    ("/api", {"prompts": ["hi"], "tokens_to_generate": "3"}, "tokens_to_generate must be an integer"),
    ("/api", {"prompts": ["hi"], "tokens_to_generate": 0}, "logprobs should be true"),
    ("/api", {"prompts": ["hi"], "top_k": 2, "top_p": 0.5}, "cannot set both"),
    ("/api", {"prompts": ["hi"], "beam_width": 2}, "unknown field"),
    ("/api", {"prompts": ["hi"], "tokens_to_generate": 31}, "over the maximum sequence length 32"),
    ("/api", {"prompts": [""]}, "prompt 0 is empty"),
    ("/api", {"prompts": ["hi"], "logprobs": "yes"}, "logprobs must be true or false"),
    ("/v1/completions", {"max_tokens": 1}, "missing field"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -2}, "max_tokens must be at least 0"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n must be between 1 and 128"),
    ("/v1/completions", {"prompt": ["a"] * 65, "n": 2}, "at most 128 prompts, got 130"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "logprobs": 1}, "stream=true streams the text only"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature must be between"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, "logprobs must be between 0 and 5"),
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, "stop must be"),
    ("/v1/completions", {"prompt": [1, 999]}, "outside [0, 256)"),
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt must be"),
    ("/v1/completions", {"prompt": "hi", "stream": True}, "stream=true needs the dynamic engine"),
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt 0 holds an invalid character at 1"),
    ("/api", {"prompts": ["x\udfff"]}, "prompt 0 holds an invalid character"),
    ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}, "stop string 0 holds an invalid character"),
    ("/v1/completions", {"prompt": ["a"] * 129}, "at most 128 prompts, got 129"),
    ("/api", {"prompts": ["a"] * 4096}, "at most 128 prompts, got 4096"),
    ("/v1/completions", {"prompt": ["abcd"] * 20, "max_tokens": 2}, "needs 120 tokens"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed must be between 0 and"),
    ("/v1/completions", {"prompt": "x" * 30, "max_tokens": 3}, "over the maximum sequence length"),
    ("/v1/completions", [1, 2], "must be a JSON object"),
]


@pytest.mark.parametrize("path,body,message", BAD_REQUESTS)
def test_bad_requests_get_400_and_never_reach_the_engine(engine, path, body, message):
    client = make_client(engine)
    res = client.open(path, method="PUT" if path == "/api" else "POST", json=body)
    assert res.status_code == 400
    assert message in res.json["error"]["message"]
    assert engine.calls == []
    assert put_api(client, {"prompts": ["ok"], "tokens_to_generate": 1}).status_code == 200


def test_malformed_json_and_wrong_method(engine):
    client = make_client(engine)
    res = client.put("/api", data="{not json", content_type="application/json")
    assert res.status_code == 400 and "valid JSON" in res.json["error"]["message"]
    deep = "[" * 100_000 + "]" * 100_000
    res = client.put("/api", data=deep, content_type="application/json")
    assert res.status_code == 400 and "RecursionError" in res.json["error"]["message"]
    for method, path in (("GET", "/api"), ("POST", "/api"), ("GET", "/v1/completions")):
        res = client.open(path, method=method)
        assert res.status_code == 405 and res.is_json and "Method Not Allowed" in res.json["error"]["message"]
    assert client.get("/nowhere").status_code == 404 and client.get("/nowhere").is_json
    assert post_completions(client, {"prompt": "ok", "max_tokens": 1, "stream": False}).status_code == 200
    assert engine.calls and len(engine.calls) == 1


class CountingTokenizer(CharTokenizer):
    calls = 0

    def tokenize(self, text: str) -> List[int]:
        CountingTokenizer.calls += 1
        return super().tokenize(text)


def test_body_over_the_limit_is_413_from_its_length_and_prompts_are_counted_before_tokenizing(engine):
    client = make_client(engine, limits=ServerLimits(max_body_bytes=1000), tokenizer=CountingTokenizer())
    res = client.post("/v1/completions", data=b"x" * 1001, content_type="application/json")
    assert res.status_code == 413 and "over the limit of 1000" in res.json["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": ["a"] * 129}).status_code == 400
    assert CountingTokenizer.calls == 0 and engine.calls == []


def test_api_key_is_a_bearer_token(engine):
    client = make_client(engine, limits=ServerLimits(api_key="s3cret"))
    body = {"prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        res = client.post("/v1/completions", json=body, headers=headers)
        assert res.status_code == 401 and res.headers["WWW-Authenticate"] == "Bearer", headers
    assert engine.calls == []
    res = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
    assert res.status_code == 200 and len(engine.calls) == 1


def test_engine_value_errors_are_the_clients_400(engine):
    def refuse(prompts, sampling):
        raise ValueError("prompt too long for the engine")

    ctx = PromptContext(CharTokenizer(), 256, 32, EOD)
    client = create_app(GenerationService(refuse, ctx, check_sampling)).test_client()
    res = post_completions(client, {"prompt": "hi", "max_tokens": 1})
    assert res.status_code == 400 and "too long" in res.json["error"]["message"]


@pytest.mark.parametrize(
    "error, status, message",
    [
        (RuntimeError("probability tensor contains either inf, nan or element < 0"), 500, "internal error"),
        (MemoryError(), 503, "out of memory"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 GB"), 503, "out of memory"),
        (GenerationFailed(503, "out of memory on rank 1"), 503, "on rank 1"),
        (GenerationFailed(500, "internal error on rank 1: KeyError: 3"), 500, "internal error on rank 1: KeyError: 3"),
    ],
)
def test_generation_failures_get_one_answer_and_the_server_keeps_serving(error, status, message):
    engine = FakeEngine()
    fail = [error]

    def generate(prompts, sampling):
        if fail:
            raise fail.pop()
        return engine.generate(prompts, sampling)

    ctx = PromptContext(CharTokenizer(), 256, 32, EOD)
    client = create_app(GenerationService(generate, ctx, check_sampling)).test_client()
    res = post_completions(client, {"prompt": "hi", "max_tokens": 1})
    assert res.status_code == status and message in res.json["error"]["message"], res.json
    assert post_completions(client, {"prompt": "hi", "max_tokens": 2}).json["choices"][0]["text"] == "ab"


def test_sampling_check_refuses_before_generating(engine):
    client = make_client(engine)
    res = put_api(client, {"prompts": ["hi"], "temperature": 60})
    assert res.status_code == 400 and engine.calls == []
    assert put_api(client, {"prompts": ["hi"], "tokens_to_generate": 1}).status_code == 200


def test_threaded_server_bounds_connections_and_times_out_stalled_ones(engine):
    """The real HTTP server in-process: with 2 slots, one stalled client leaves one for others; a third
    connection while both are held gets 503 unread; the stalled one gets 408 after the read timeout; a
    chunked body over the limit gets 413."""
    import socket
    import threading
    import time
    import urllib.request

    from tools.text_generation.app import BoundedThreadedServer

    limits = ServerLimits(max_body_bytes=1000, max_connections=2, read_timeout_s=8.0)
    ctx = PromptContext(CharTokenizer(), 256, 32, EOD)
    app = create_app(GenerationService(engine.generate, ctx, check_sampling), limits=limits)
    server = BoundedThreadedServer("127.0.0.1", 0, app, limits)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stalled() -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
        return sock

    def post() -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/completions", method="POST")
        req.data, req.headers["Content-type"] = b'{"prompt": "hi", "max_tokens": 1}', "application/json"
        try:
            with urllib.request.urlopen(req, timeout=10) as res:
                return res.status
        except urllib.error.HTTPError as err:
            return err.code

    def wait_for_free_slots(count: int) -> None:
        """A connection's slot comes back when its thread ends, just after its client has the answer: wait for
        it (no sleep: a loaded machine may take longer than any fixed pause)."""
        deadline = time.monotonic() + 60
        while server.slots._value != count:  # threading.BoundedSemaphore's count
            assert time.monotonic() < deadline, f"{server.slots._value} of 2 slots free, want {count}"
            time.sleep(0.01)

    try:
        first = stalled()
        stalled_at = time.monotonic()
        assert post() == 200 and time.monotonic() - stalled_at < limits.read_timeout_s
        wait_for_free_slots(1)  # the answered connection's thread has ended; the stalled one holds a slot
        second = stalled()
        # The accepting thread takes slots in connection order: the second stalled client has the last one.
        assert post() == 503
        assert first.recv(1024).startswith(b"HTTP/1.1 408 ")
        assert time.monotonic() - stalled_at < limits.read_timeout_s + 5  # given up at the read timeout
        second.recv(1024)
        wait_for_free_slots(2)
        assert post() == 200  # the slots came back
        chunked = socket.create_connection(("127.0.0.1", server.port), timeout=10)  # no Content-Length to check
        chunked.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunked.sendall(b"400\r\n" + b" " * 1024 + b"\r\n")  # over the 1,000-byte limit: spaces would parse
        chunked.sendall(b"e\r\n" + b'{"prompt":"a"}' + b"\r\n0\r\n\r\n")
        assert chunked.recv(1024).startswith(b"HTTP/1.1 413 ")
    finally:
        server.shutdown()
        server.server_close()


def test_only_loopback_hosts_count_as_this_machine_only():
    from tools.run_text_generation_server import is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.4", "example.org"))


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("max_connections", 0, "--max-connections=0: must be at least 1"),
        ("max_prompts_per_request", -1, "--max-prompts-per-request=-1: must be at least 1"),
        ("request_read_timeout", float("inf"), "--request-read-timeout=inf: must be a positive"),
        ("api_key", " ", "--api-key is empty"),
    ],
)
def test_server_flags_are_checked_naming_the_flag_and_the_rule(flag, value, message):
    import argparse

    from tools.text_generation.model_loading import add_server_args, check_server_args

    args = add_server_args(argparse.ArgumentParser()).parse_args([])
    check_server_args(args)  # the defaults pass
    setattr(args, flag, value)
    with pytest.raises(SystemExit, match=message):
        check_server_args(args)
