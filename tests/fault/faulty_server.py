"""tools/run_text_generation_server.py with a failure injected on the follower ranks (for the fault suite).

Usage: python faulty_server.py <server flags...>

On every rank but 0, an engine step holding a request whose ``seed`` is one of ``FAULT_SEEDS`` raises after
the step finished (so every collective of the step completed): rank 0 succeeded, the follower did not, the
failure a follower-only error (a bug, an out-of-memory) leaves. The server must answer it with its
status and keep serving on every rank.
"""

import os
import runpy
import sys

from megatron.core.inference import dynamic_engine

FAULT_SEEDS = {
    1001: lambda: RuntimeError("injected follower failure (not a ValueError)"),
    1002: lambda: MemoryError("injected follower out of memory"),
}


def inject_follower_failures() -> None:
    step = dynamic_engine.DynamicInferenceEngine.step

    def step_or_fail(self):
        seeds = {r.sampling_params.seed for r in self.active + self.waiting}
        finished = step(self)
        for seed in seeds & set(FAULT_SEEDS):
            if os.environ.get("RANK", "0") != "0":
                raise FAULT_SEEDS[seed]()
        return finished

    dynamic_engine.DynamicInferenceEngine.step = step_or_fail


if __name__ == "__main__":
    inject_follower_failures()
    sys.argv[0] = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "run_text_generation_server.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
