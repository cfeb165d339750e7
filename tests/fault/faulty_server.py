"""tools/run_text_generation_server.py with a failure injected on the follower ranks (for the fault suite).

Usage: python faulty_server.py <server flags...>

On every rank but 0, a generation whose ``seed`` is one of ``FAULT_SEEDS`` raises after the engine
finished (so every collective of the request completed): rank 0 succeeded, the follower did not, the
failure a follower-only error (a bug, an out-of-memory) leaves. The server must answer it with its
status and keep serving on every rank.
"""

import os
import runpy
import sys

from megatron.core.inference import engine

FAULT_SEEDS = {
    1001: lambda: RuntimeError("injected follower failure (not a ValueError)"),
    1002: lambda: MemoryError("injected follower out of memory"),
}


def inject_follower_failures() -> None:
    generate = engine.InferenceEngine.generate

    def generate_or_fail(self, prompts, params):
        results = generate(self, prompts, params)
        if os.environ.get("RANK", "0") != "0" and params.seed in FAULT_SEEDS:
            raise FAULT_SEEDS[params.seed]()
        return results

    engine.InferenceEngine.generate = generate_or_fail


if __name__ == "__main__":
    inject_follower_failures()
    sys.argv[0] = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "run_text_generation_server.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
