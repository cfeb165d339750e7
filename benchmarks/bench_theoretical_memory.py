"""Theoretical memory (``megatron/training/theoretical_memory.py``) against measurement, per config.

Every config runs one training step (the real pipeline schedule, DDP, the Megatron optimizer) on
gloo ranks; ``tests/memory_probe.py`` measures the parameter, gradient-buffer and optimizer bytes
(distinct storages) and the peak of saved-for-backward bytes (``saved_tensors_hooks``, distinct
storages, parameters excluded) over the schedule. Printed per config and rank: the state bytes
(accounted = measured, or the difference) and activations accounted vs measured, then the worst
activation error. The 2-rank grid is the unit test's; the 4-rank one adds TP x DP, TP x PP, PP 4,
expert parallelism and the distributed optimizer over 4 ranks.

Usage: python benchmarks/bench_theoretical_memory.py [--skip-4]

Measured 2026-12-01: parameters, gradient buffers, fp32 main parameters and optimizer states equal
to the byte on every rank of all 21 configs. Activations: 0.0% on most; full recompute +5.6% (the
backward rise is taken at the start of the backward, before the head's bytes are freed); MoE bf16
+0.9%; selective under interleaving +0.2%; TP without a loss on the rank -0.03% (32 bytes). Under
expert parallelism the accounting equals the mean over EP ranks (0.0% dense-routed MoE, -7.2% with
full recompute) while single ranks differ by the routing imbalance of the batch (-16% .. +11%).
Worst: 7.2%.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.dist_harness import run_distributed  # noqa: E402
from tests.memory_probe import MemCase, measure_cases  # noqa: E402
from tests.unit_tests.training.test_theoretical_memory import GRID  # noqa: E402

STATE = ("params", "grads", "main_params", "optimizer_states")

GRID_4 = [
    MemCase("tp2 dp2 dist-opt bf16", tp=2, sp=True, dist_opt=True, bf16=True, llama=True),
    MemCase("tp2 pp2 sp 1f1b m4", tp=2, pp=2, sp=True, num_microbatches=4, num_layers=4),
    MemCase("pp4 1f1b m8", pp=4, num_layers=4, num_microbatches=8),
    MemCase("pp2 vp2 dp2 m4 selective", pp=2, vp=2, num_layers=4, num_microbatches=4, recompute="selective"),
    MemCase("dp4 dist-opt", dist_opt=True),
    MemCase("moe ep2 dp2 (expected tokens/expert)", moe=True, ep=2),
    MemCase("moe ep2 tp2 sp full", moe=True, ep=2, tp=2, sp=True, recompute="full"),
]


def run(cases: List[MemCase], world_size: int) -> float:
    """Print one block; return the worst relative activation error.

    Under expert parallelism the accounting knows only the expected tokens per expert; how the
    routing of this batch splits them between EP ranks is not knowable from the configs, so those
    cases are judged on the mean over the ranks (each rank's own error is printed too).
    """
    results = run_distributed(measure_cases, world_size, cases, timeout=1200)
    worst = 0.0
    header = "state (params/grads/main/optim bytes) | activations acc / meas  err"
    print(f"\n{world_size} ranks | {'config':38s} rank | {header}")
    for i, case in enumerate(cases):
        for rank, per_rank in enumerate(results):
            m, a = per_rank[i]["measured"], per_rank[i]["accounted"]
            state = "/".join(str(m[k]) for k in STATE)
            exact = all(m[k] == a[k] for k in STATE) and m["num_parameters"] == a["num_parameters"]
            err = (a["activations"] - m["activations"]) / m["activations"]
            if case.ep == 1:
                worst = max(worst, abs(err))
            verdict = "exact" if exact else "DIFFERS " + "/".join(str(a[k]) for k in STATE)
            print(
                f"{'':8s} {case.name:38s} {rank:4d} | {state:>30s} {verdict:6s} | "
                f"{a['activations']:9d} / {m['activations']:9d} {err:+6.1%}"
            )
        if case.ep > 1:
            mean = sum(r[i]["measured"]["activations"] for r in results) / world_size
            err = (results[0][i]["accounted"]["activations"] - mean) / mean
            worst = max(worst, abs(err))
            print(f"{'':8s} {case.name:38s} mean over the EP ranks: measured {mean:.0f}, error {err:+6.1%}")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-4", action="store_true", help="only the 2-rank grid")
    args = parser.parse_args()
    worst = run(GRID, 2)
    if not args.skip_4:
        worst = max(worst, run(GRID_4, 4))
    print(f"\nworst activation error: {worst:.1%} (acceptance: 10%)")


if __name__ == "__main__":
    main()
