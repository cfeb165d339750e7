"""The rank-0 / follower protocol without processes: commands are recorded, not broadcast."""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, List

import pytest

from tools.text_generation import ranks
from tools.text_generation.errors import GenerationFailed


def test_followers_run_each_generation_until_stop_and_survive_refused_ones(monkeypatch):
    commands: List[Dict[str, Any]] = [
        {"op": ranks.NOOP},
        {"op": ranks.GENERATE, "prompts": [[1, 2]], "sampling": {"n": 1}},
        {"op": ranks.GENERATE, "prompts": [[]], "sampling": {"n": 1}},
        {"op": ranks.GENERATE, "prompts": [[3]], "sampling": {"n": 2}},
        {"op": ranks.STOP},
        {"op": ranks.GENERATE, "prompts": [[9]], "sampling": {}},  # never reached
    ]
    monkeypatch.setattr(ranks, "broadcast_command", lambda command=None: commands.pop(0))
    seen = []

    def run(prompts, sampling):
        if prompts == [[]]:
            raise ValueError("empty prompt")  # rank 0 answered 400 for it
        seen.append((prompts, sampling))
        if sampling["n"] == 1:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")  # not a ValueError

    outcomes = []
    monkeypatch.setattr(ranks, "agree", lambda outcome: outcomes.append(outcome) or [outcome])
    assert ranks.follow(run) == 3
    assert seen == [([[1, 2]], {"n": 1}), ([[3]], {"n": 2})]
    assert len(commands) == 1
    assert [status for status, _ in outcomes] == [500, 400, None]  # every generation's outcome was shared
    assert "RuntimeError: probability tensor" in outcomes[0][1]


def test_leader_answers_with_the_worst_failure_of_any_rank_and_refuses_once_stopping(monkeypatch):
    monkeypatch.setattr(ranks, "broadcast_command", lambda command=None: command)
    follower = [(None, "")]
    monkeypatch.setattr(ranks, "agree", lambda outcome: [outcome, *follower])
    leader = ranks.Leader(lambda prompts, sampling: ["ok"], threading.Lock(), heartbeat_s=60)
    assert leader.generate([[1]], {}) == ["ok"]
    for status, message in [(503, "out of memory on rank 1"), (500, "internal error on rank 1: KeyError: 3")]:
        follower[:] = [(status, message)]
        with pytest.raises(GenerationFailed) as caught:
            leader.generate([[1]], {})
        assert caught.value.status == status and str(caught.value) == message
    follower[:] = [(400, "bad"), (500, "bug")]  # ranks disagree: the most serious failure is answered
    with pytest.raises(GenerationFailed, match="bug"):
        leader.generate([[1]], {})
    leader._stopped.set()
    with pytest.raises(GenerationFailed, match="stopping") as caught:
        leader.generate([[1]], {})
    assert caught.value.status == 503


def test_leader_broadcasts_before_generating_heartbeats_when_idle_and_stops_last(monkeypatch):
    sent: List[str] = []
    monkeypatch.setattr(ranks, "broadcast_command", lambda command=None: sent.append(command["op"]))
    lock = threading.Lock()
    leader = ranks.Leader(lambda prompts, sampling: sent.append("engine") or ["result"], lock, heartbeat_s=0.05)
    leader.start()
    time.sleep(0.3)
    with lock:
        assert leader.generate([[1]], {}) == ["result"]
    leader.stop()
    assert sent.index(ranks.GENERATE) + 1 == sent.index("engine")
    assert ranks.NOOP in sent and sent[-1] == ranks.STOP
    assert sent.count(ranks.STOP) == 1


def test_without_torch_distributed_a_command_is_returned_as_is():
    assert ranks.broadcast_command({"op": ranks.STOP}) == {"op": ranks.STOP}
    assert ranks.broadcast_command() == {"op": ranks.NOOP}


def test_cli_accepts_megatrons_host_port_or_a_url():
    from tools.text_generation_cli import api_url

    assert api_url("localhost:5000") == "http://localhost:5000/api"
    assert api_url("http://h:1/") == "http://h:1/api"
    assert api_url("http://h:1/api") == "http://h:1/api"
