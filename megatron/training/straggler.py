"""Straggler detection (``--log-straggler``): which ranks are slow, by how much, every ``--log-interval``.

Under synchronous data parallelism every rank's step takes as long as the slowest one's: the others
wait in the gradient reduction. So each rank times its own work without the waiting: the step's
*compute* is the forward-backward section minus the time spent in ``finalize_model_grads`` (the
gradient reduction, where the fast ranks wait for the slow one), summed over the interval. Every
``report_interval`` iterations one all-gather brings every rank's sums ``[world, 3]`` (compute,
gradient sync, whole step, in seconds) to every rank; rank 0 prints the ``minmax_count`` slowest and
fastest ranks by compute time with their slowdown against the median rank:

```
straggler report (iterations 11-20, 4 ranks): slowest: rank 2 2.41x (96.3 ms/iter vs median 40.0 ms)
  | fastest: rank 0 0.98x (39.3 ms/iter) | step 98.1-98.4 ms/iter, gradient sync 0.9-58.8 ms/iter
```

``--disable-straggler-on-startup`` starts it off; ``--straggler-ctrlr-port`` serves, on rank 0, an HTTP
endpoint whose every request toggles it (``curl http://RANK0_HOST:PORT``, as in Megatron); rank 0's
state reaches every rank in the report's collective, so all ranks agree whether to gather.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional

import torch
import torch.distributed as dist

from megatron.core.utils import comm_device

logger = logging.getLogger(__name__)


@dataclass
class StragglerConfig:
    """Megatron's straggler flags.

    Attributes:
        log_straggler: gather per-rank timings and name the slowest ranks (``--log-straggler``).
        disable_straggler_on_startup: start with detection off (``--disable-straggler-on-startup``).
        straggler_ctrlr_port: rank 0 port whose requests toggle detection (``--straggler-ctrlr-port``; 0: a
            free port the system picks, printed).
        straggler_minmax_count: how many slowest and fastest ranks to name (``--straggler-minmax-count``).
        report_interval: iterations between reports (``--log-interval``).
    """

    log_straggler: bool = False
    disable_straggler_on_startup: bool = False
    straggler_ctrlr_port: int = 65535
    straggler_minmax_count: int = 1
    report_interval: int = 100

    def __post_init__(self) -> None:
        for name in ("log_straggler", "disable_straggler_on_startup"):
            value = getattr(self, name)
            if value is None:
                setattr(self, name, False)
            elif not isinstance(value, bool):
                raise ValueError(f"{name}={value!r}: must be True or False")
        if not isinstance(self.straggler_minmax_count, int) or self.straggler_minmax_count < 1:
            raise ValueError(f"straggler_minmax_count={self.straggler_minmax_count!r}: must be an integer >= 1")
        if not isinstance(self.straggler_ctrlr_port, int) or not 0 <= self.straggler_ctrlr_port <= 65535:
            raise ValueError(f"straggler_ctrlr_port={self.straggler_ctrlr_port!r}: must be an integer in [0, 65535]")
        if not isinstance(self.report_interval, int) or self.report_interval < 1:
            raise ValueError(f"report_interval={self.report_interval!r}: must be an integer >= 1 (--log-interval)")


class StragglerDetector:
    """Per-rank step timings, gathered and reported every ``report_interval`` iterations (see the module)."""

    def __init__(self, config: StragglerConfig) -> None:
        self.config = config
        self.enabled = not config.disable_straggler_on_startup
        self._sums = [0.0, 0.0, 0.0]  # compute, gradient sync, step (seconds) since the last report
        self._iterations = 0
        self._first = 1
        self._server: Optional[http.server.HTTPServer] = None
        if dist.get_rank() == 0:
            self._serve_toggle(config.straggler_ctrlr_port)

    def _serve_toggle(self, port: int) -> None:
        detector = self

        class Toggle(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                detector.enabled = not detector.enabled
                self.send_response(200)
                self.end_headers()
                self.wfile.write(f"straggler detection {'on' if detector.enabled else 'off'}\n".encode())

            def log_message(self, *args: object) -> None:
                pass

        try:
            self._server = http.server.HTTPServer(("", port), Toggle)
        except OSError as e:
            logger.warning("--straggler-ctrlr-port %d: cannot listen (%s); detection cannot be toggled", port, e)
            return
        threading.Thread(target=self._server.serve_forever, name="straggler-toggle", daemon=True).start()
        if port == 0:
            print(f"straggler detection toggles on port {self._server.server_address[1]}", flush=True)

    def wrap_gradient_sync(self, finalize: Callable) -> Callable:
        """``finalize_model_grads_func`` timed as the gradient sync (where fast ranks wait for slow ones)."""

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return finalize(*args, **kwargs)
            finally:
                self._sums[1] += time.perf_counter() - start

        return timed

    @contextlib.contextmanager
    def step(self, iteration: int) -> Iterator[None]:
        """Times one training step (its forward-backward is ``forward_backward``)."""
        start = time.perf_counter()
        yield
        self._sums[2] += time.perf_counter() - start
        self._iterations += 1
        if iteration % self.config.report_interval == 0:
            self._report(iteration)

    @contextlib.contextmanager
    def forward_backward(self) -> Iterator[None]:
        """The forward-backward section: its time minus the gradient sync inside it is this rank's compute."""
        sync_before, start = self._sums[1], time.perf_counter()
        yield
        self._sums[0] += (time.perf_counter() - start) - (self._sums[1] - sync_before)

    def _report(self, iteration: int) -> None:
        """Collective over the world: rank 0's on/off state, then (when on) every rank's sums."""
        state = torch.tensor([float(self.enabled)], device=comm_device())
        dist.broadcast(state, src=0)
        self.enabled = bool(state.item())
        if self.enabled:
            mine = torch.tensor([s / max(self._iterations, 1) for s in self._sums], dtype=torch.float64)
            table = torch.zeros(dist.get_world_size(), 3, dtype=torch.float64, device=comm_device())  # [world, 3]
            dist.all_gather_into_tensor(table.view(-1), mine.to(comm_device()))
            if dist.get_rank() == 0:
                print(straggler_line(table.cpu().tolist(), self._first, iteration, self.config.straggler_minmax_count))
        self._sums, self._iterations, self._first = [0.0, 0.0, 0.0], 0, iteration + 1

    def close(self) -> None:
        """Stop the toggle endpoint."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def straggler_line(per_rank: List[List[float]], first: int, last: int, count: int) -> str:
    """The report for rows ``[compute, gradient sync, step]`` seconds per iteration, one row per rank."""
    compute = [row[0] for row in per_rank]
    median = statistics.median(compute)
    order = sorted(range(len(compute)), key=lambda r: (-compute[r], r))
    count = min(count, len(order))

    def named(ranks: List[int]) -> str:
        return ", ".join(
            f"rank {r} {compute[r] / median if median > 0 else float('inf'):.2f}x ({compute[r] * 1e3:.1f} ms/iter)"
            for r in ranks
        )

    def span(column: int) -> str:
        values = [row[column] * 1e3 for row in per_rank]
        return f"{min(values):.1f}-{max(values):.1f} ms/iter"

    return (
        f"straggler report (iterations {first}-{last}, {len(compute)} ranks): slowest: {named(order[:count])} "
        f"vs median {median * 1e3:.1f} ms | fastest: {named(order[::-1][:count])} | step {span(2)}, "
        f"gradient sync {span(1)}"
    )
