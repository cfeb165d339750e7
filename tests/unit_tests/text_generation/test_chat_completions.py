"""``POST /v1/chat/completions`` with the fake engine and character tokenizer of the server tests.

The prompt must be the ChatML text written out here by hand (the character tokenizer has no chat
template, so the built-in format applies) ending in the assistant's opening; the reply is cut at
``<|im_end|>``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flask")

from tests.unit_tests.text_generation.test_text_generation_server import FakeEngine, make_client  # noqa: E402

MESSAGES = [{"role": "system", "content": "Hi"}, {"role": "user", "content": "2+2?"}]  # 88 prompt tokens


def test_chat_prompt_is_the_training_format_and_reply_stops_at_end_of_turn():
    engine = FakeEngine(script="4<|im_end|>\nmore")
    client = make_client(engine, max_len=128)
    # The fake server's limit is 100 tokens a request.
    reply = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 12})
    assert reply.status_code == 200, reply.get_json()
    body = reply.get_json()
    text = "<|im_start|>system\nHi<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    ((prompts, sampling),) = engine.calls
    assert prompts == [[ord(c) for c in text]]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "4"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == len(text)


@pytest.mark.parametrize(
    "body,message",
    [
        ({"messages": []}, "messages: 'messages' must be a non-empty list"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "message 0 must be"),
        ({"messages": MESSAGES, "stream": True, "max_tokens": 4}, "stream=true needs the dynamic engine"),
        ({"messages": MESSAGES, "n": 129}, "n must be between 1 and 128"),
        ({"prompt": "x"}, "unknown field"),
    ],
)
def test_bad_chat_requests_get_400(body, message):
    engine = FakeEngine()
    reply = make_client(engine, max_len=128).post("/v1/chat/completions", json=body)
    assert reply.status_code == 400 and message in reply.get_json()["error"]["message"]
    assert not engine.calls
