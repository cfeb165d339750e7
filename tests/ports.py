"""Ports for the rendezvous stores the tests' runs listen on, chosen so that two pytest-xdist workers never
hand out the same one.

``bind(0)``-then-close leaves a port that any other process can take before the run's rank 0 listens on it:
the other xdist worker's next ``bind(0)``, or any outgoing connection (gloo's, a store client's), since the
kernel draws both from the ephemeral range. A collision failed the run ("MASTER_PORT is already in use"), or
worse, let one run's ranks join the other's store. So ports come from below the ephemeral range, where the
kernel assigns none, in a slice of their own for each xdist worker; within a process they are handed out in
turn from a random start (a subprocess of the same worker starts elsewhere in the slice), and one something
already listens on is skipped.
"""

from __future__ import annotations

import os
import random
import socket
from typing import Iterator, Tuple

# Below Linux's default ephemeral range (32768-60999) and clear of the usual fixed ports (torch's 29500 and
# Megatron's 6000 are outside it).
PRIVATE_RANGE = (20000, 29000)
_turn: Iterator[int] = iter(())


def worker_slice(environ=os.environ) -> Tuple[int, int]:
    """[low, high) of the ports this xdist worker (``PYTEST_XDIST_WORKER`` gwN of ``..._COUNT``) hands out."""
    low, high = PRIVATE_RANGE
    ephemeral_low = _ephemeral_low()
    high = min(high, ephemeral_low)
    count = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    worker = environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    width = (high - low) // max(count, 1)
    return low + index * width, low + (index + 1) * width


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _ports() -> Iterator[int]:
    low, high = worker_slice()
    start = random.SystemRandom().randrange(low, high)
    for i in range(high - low):
        yield low + (start - low + i) % (high - low)


def free_port() -> int:
    """A port nothing listens on now, that no other xdist worker hands out and the kernel gives to no one."""
    global _turn
    low, high = worker_slice()
    if high - low < 16:  # an ephemeral range starting too low leaves no private ports: the kernel's choice
        return _bound_port(0)
    for _ in range(2):
        for port in _turn:
            try:
                return _bound_port(port)
            except OSError:
                continue  # something listens there: the next one
        _turn = _ports()
    raise RuntimeError(f"no free port in {low}-{high}")


def _bound_port(port: int) -> int:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store binds: TIME_WAIT is free
        sock.bind(("", port))
        return sock.getsockname()[1]
