"""tests/ports.py: the xdist workers' port slices never overlap, lie below the kernel's ephemeral range, and
a port something listens on is never handed out."""

import socket

from tests import ports


def test_worker_slices_are_disjoint_and_below_the_ephemeral_range():
    env = {"PYTEST_XDIST_WORKER_COUNT": "2"}
    first = ports.worker_slice({**env, "PYTEST_XDIST_WORKER": "gw0"})
    second = ports.worker_slice({**env, "PYTEST_XDIST_WORKER": "gw1"})
    assert first[0] < first[1] <= second[0] < second[1] <= ports._ephemeral_low()
    assert ports.worker_slice({}) == (ports.PRIVATE_RANGE[0], min(ports.PRIVATE_RANGE[1], ports._ephemeral_low()))


def test_free_ports_come_in_turn_from_the_slice_and_skip_a_listening_one(monkeypatch):
    low = ports.free_port()  # somewhere free in this worker's slice
    monkeypatch.setattr(ports, "worker_slice", lambda: (low, low + 16))
    monkeypatch.setattr(ports, "_turn", iter(()))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", low))
        holder.listen()
        handed = {ports.free_port() for _ in range(10)}
    assert low not in handed and len(handed) == 10 and all(low < p < low + 16 for p in handed)
