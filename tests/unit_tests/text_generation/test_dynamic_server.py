"""The server over the real dynamic engine and its engine loop (one rank, a tiny Llama, the character tokenizer).

Concurrent HTTP handlers (threads, no lock) queue to the loop and are batched together in the engine's
steps (counted); each answer equals the static engine's greedy continuation of its prompt alone.
``stream: true`` gives the same text as the whole answer, on both OpenAI endpoints and with a stop string;
``n`` > 1 gives n seeded, reproducible choices; ``top_logprobs`` holds the top-k of a full forward; a full
queue is answered 503; Megatron's ``/api`` answers as before.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

pytest.importorskip("flask")

from megatron.core.inference import InferenceEngine, SamplingParams  # noqa: E402
from tests.dist_harness import run_distributed  # noqa: E402
from tests.model_utils import single_rank_groups  # noqa: E402
from tests.unit_tests.inference.hf_models import hf_model, our_model  # noqa: E402
from tests.unit_tests.inference.test_dynamic_engine import dynamic_engine  # noqa: E402
from tests.unit_tests.text_generation.test_text_generation_server import CharTokenizer  # noqa: E402
from tools.text_generation.app import create_app  # noqa: E402
from tools.text_generation.engine_loop import EngineLoop  # noqa: E402
from tools.text_generation.service import GenerationService  # noqa: E402
from tools.text_generation.validation import PromptContext  # noqa: E402

PROMPTS = ["Hello", "abc", "The quick brown fox", "x", "12345678", "Serve", "ok then", "qq"]
TOKENS = 6
MAX_LENGTH = 96  # a chat prompt in ChatML


class AsciiTokenizer(CharTokenizer):
    vocab_size = 128
    eod = None

    def detokenize(self, ids) -> str:
        return "".join(chr(i) for i in ids)


def _client(engine, max_queued=64):
    loop = EngineLoop(engine, heartbeat_s=60.0, max_queued_requests=max_queued)
    ctx = PromptContext(AsciiTokenizer(), 128, MAX_LENGTH, None)
    service = GenerationService(loop.generate, ctx, lambda s: SamplingParams(**s), "tiny", submit=loop.submit)
    loop.start()
    return loop, create_app(service)


def _post(app, path, body):
    reply = app.test_client().post(path, json=body)
    if body.get("stream"):
        events = [line[6:] for line in reply.get_data(as_text=True).split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events
        return reply.status_code, [json.loads(e) for e in events[:-1]]
    return reply.status_code, reply.get_json()


def _streamed_text(events, key):
    texts = {}
    for event in events:
        for choice in event["choices"]:
            piece = choice["text"] if key == "text" else choice["delta"].get("content", "")
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return [texts[i] for i in sorted(texts)]


def _concurrent_greedy(app, engine, model):
    """Eight handlers at once; every answer equals the static engine's; some steps batched several requests."""
    answers = [None] * len(PROMPTS)
    sizes = []
    step = engine.step
    engine.step = lambda: sizes.append(len(engine.active) + len(engine.waiting)) or step()

    def ask(i):
        answers[i] = _post(app, "/v1/completions", {"prompt": PROMPTS[i], "max_tokens": TOKENS, "temperature": 0})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    engine.step = step
    tok = AsciiTokenizer()
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=TOKENS)
    for prompt, (status, answer) in zip(PROMPTS, answers):
        (expected,) = InferenceEngine(model, single_rank_groups()).generate([tok.tokenize(prompt)], params)
        assert status == 200 and answer["choices"][0]["text"] == tok.detokenize(expected.generated_tokens), answer
    assert max(sizes) > 1, f"no step held requests of two handlers: {sizes}"


def _streaming(app):
    body = {"prompt": PROMPTS[2], "max_tokens": TOKENS, "temperature": 0}
    _, whole = _post(app, "/v1/completions", body)
    text = whole["choices"][0]["text"]
    for extra in ({}, {"stop": text[2:4]}):
        _, plain = _post(app, "/v1/completions", {**body, **extra})
        status, events = _post(app, "/v1/completions", {**body, **extra, "stream": True})
        assert status == 200 and _streamed_text(events, "text") == [plain["choices"][0]["text"]]
        assert events[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert (
        plain["choices"][0]["text"] == text[: text.index(text[2:4])] and plain["choices"][0]["finish_reason"] == "stop"
    )
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS, "temperature": 0, "n": 2}
    _, plain = _post(app, "/v1/chat/completions", chat)
    status, events = _post(app, "/v1/chat/completions", {**chat, "stream": True})
    assert status == 200 and _streamed_text(events, "delta") == [c["message"]["content"] for c in plain["choices"]]


def _n_and_top_logprobs(app, model):
    body = {"prompt": ["ab", "cd"], "max_tokens": TOKENS, "temperature": 1.0, "seed": 3, "n": 3}
    _, first = _post(app, "/v1/completions", body)
    _, again = _post(app, "/v1/completions", body)
    texts = [c["text"] for c in first["choices"]]
    assert len(texts) == 6 and texts == [c["text"] for c in again["choices"]] and len(set(texts[:3])) > 1
    _, answer = _post(app, "/v1/completions", {"prompt": "ab", "max_tokens": 3, "temperature": 0, "logprobs": 3})
    logprobs = answer["choices"][0]["logprobs"]
    tok = AsciiTokenizer()
    tokens = torch.tensor([tok.tokenize("ab" + answer["choices"][0]["text"])])
    with torch.no_grad():
        full = torch.log_softmax(model(tokens)[0, 1:-1].float(), -1).topk(3, -1)  # [3, 3]: after "ab" on
    for position, top in enumerate(logprobs["top_logprobs"]):
        expected = {tok.detokenize([i]): v for i, v in zip(full.indices[position].tolist(), full.values[position])}
        assert top.keys() == expected.keys()
        assert all(abs(top[k] - float(expected[k])) < 1e-5 for k in top)


def _limits_and_api(app, engine):
    loop, small = _client(engine, max_queued=2)
    status, answer = _post(small, "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 2})
    assert status == 503 and "--max-queued-requests=2" in answer["error"]["message"]
    loop.stop()
    reply = app.test_client().put("/api", json={"prompts": ["Hello"], "tokens_to_generate": TOKENS, "top_k": 1})
    _, whole = _post(app, "/v1/completions", {"prompt": "Hello", "max_tokens": TOKENS, "temperature": 0})
    assert reply.status_code == 200 and reply.get_json()["text"] == ["Hello" + whole["choices"][0]["text"]]


def _server_body(rank, world_size):
    groups = single_rank_groups()
    model = our_model(hf_model("llama", seed=1), groups)
    engine = dynamic_engine(model, groups, max_requests=4, max_sequence_length=MAX_LENGTH)
    loop, app = _client(engine)
    try:
        _concurrent_greedy(app, engine, model)
        _streaming(app)
        _n_and_top_logprobs(app, model)
        _limits_and_api(app, engine)
    finally:
        loop.stop()


def test_server_over_the_dynamic_engine():
    run_distributed(_server_body, 1)
