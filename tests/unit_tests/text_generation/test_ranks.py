"""The rank-0 / follower protocol of the engine loop without processes: commands are recorded, not broadcast."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest

from tools.text_generation import engine_loop, ranks
from tools.text_generation.errors import GenerationFailed


class FakeEngine:
    """Records the calls every rank makes; a step fails when ``fail`` says so; requests finish in one step."""

    def __init__(self, fail=None):
        self.calls, self.fail, self.requests = [], fail, {}

    def check_request(self, request_id, prompt, params):
        if not prompt:
            raise ValueError("prompt is empty")

    def add_request(self, request_id, prompt, params):
        self.calls.append(("add", request_id, params.seed))
        request = SimpleNamespace(generated_tokens=[], finished=False, result=lambda: "partial")
        self.requests[request_id] = request
        return request

    def abort_request(self, request_id):
        self.calls.append(("abort", request_id))

    def step(self):
        self.calls.append(("step",))
        if self.fail is not None and self.fail():
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        for request in self.requests.values():
            request.finished, request.result = True, lambda: "done"

    def reset(self):
        self.calls.append(("reset",))


def test_followers_run_each_step_until_stop_and_reset_after_a_failed_one(monkeypatch):
    commands: List[Dict[str, Any]] = [
        {"op": ranks.NOOP},
        {"op": engine_loop.STEP, "add": [(0, [1, 2], {"seed": 4})], "abort": []},
        {"op": engine_loop.STEP, "add": [], "abort": [0]},
        {"op": ranks.STOP},
        {"op": engine_loop.STEP, "add": [], "abort": []},  # never reached
    ]
    monkeypatch.setattr(engine_loop, "broadcast_command", lambda command=None: commands.pop(0))
    outcomes = []
    monkeypatch.setattr(ranks, "agree", lambda outcome: outcomes.append(outcome) or [outcome])
    steps = iter([False, True])
    engine = FakeEngine(fail=lambda: next(steps))
    assert engine_loop.follow_engine(engine) == 2
    assert engine.calls == [("add", 0, 4), ("step",), ("abort", 0), ("step",), ("reset",)]
    assert len(commands) == 1 and [status for status, _ in outcomes] == [None, 500]


def test_engine_loop_broadcasts_before_stepping_answers_failures_and_stops_last(monkeypatch):
    sent: List[str] = []
    monkeypatch.setattr(engine_loop, "broadcast_command", lambda command: sent.append(command["op"]))
    follower = [(None, "")]
    monkeypatch.setattr(ranks, "agree", lambda outcome: [outcome, *follower])
    engine = FakeEngine()
    engine.step = lambda step=engine.step: sent.append("engine") or step()
    loop = engine_loop.EngineLoop(engine, heartbeat_s=0.05, max_queued_requests=3)
    loop.start()
    deadline = time.monotonic() + 60
    while ranks.NOOP not in sent:  # idle: the loop sends heartbeats (waited for; a fixed pause can be too short)
        assert time.monotonic() < deadline, sent
        time.sleep(0.01)
    assert loop.generate([[1], [2]], {"seed": 7}) == ["done", "done"]
    assert [c for c in engine.calls if c[0] == "add"] == [("add", 0, 7), ("add", 1, 8)]  # seed + k
    with pytest.raises(ValueError, match="empty"):
        loop.submit([[]], {})
    with pytest.raises(GenerationFailed, match="--max-queued-requests=3") as caught:
        loop.submit([[1]] * 4, {})
    assert caught.value.status == 503
    follower[:] = [(503, "out of memory on rank 1")]
    with pytest.raises(GenerationFailed, match="out of memory on rank 1") as caught:
        loop.generate([[3]], {})
    assert caught.value.status == 503 and engine.calls[-1] == ("reset",)
    loop.stop()
    assert sent.index(engine_loop.STEP) + 1 == sent.index("engine")
    assert ranks.NOOP in sent and sent[-1] == ranks.STOP and sent.count(ranks.STOP) == 1
    with pytest.raises(GenerationFailed, match="stopping"):
        loop.submit([[1]], {})


def test_without_torch_distributed_a_command_is_returned_as_is():
    assert ranks.broadcast_command({"op": ranks.STOP}) == {"op": ranks.STOP}
    assert ranks.broadcast_command() == {"op": ranks.NOOP}


def test_cli_accepts_megatrons_host_port_or_a_url():
    from tools.text_generation_cli import api_url

    assert api_url("localhost:5000") == "http://localhost:5000/api"
    assert api_url("http://h:1/") == "http://h:1/api"
    assert api_url("http://h:1/api") == "http://h:1/api"
