"""The README's benchmark commands run (shrunk to toy sizes): each prints a line per thing it compares.

The numbers themselves are measurements for the README, not assertions; what is checked is that the command
the README shows still parses and runs to its report.
"""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 300


def _run(script: str, *args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def test_long_context_benchmark_reports_every_scheme():
    out = _run("bench_long_context.py", "--seq", "512", "--cp", "2", "--heads", "4", "--groups", "2", "--dim", "8")
    for scheme in ("p2p", "a2a", "all_gather"):
        assert any(line.startswith(scheme) and "peak" in line for line in out.splitlines()), out


def test_step_benchmark_reports_ours_beside_plain_pytorch():
    out = _run("bench_step_vs_plain.py", "--config", "tiny", "--iters", "1", "--warmup", "1", "--columns", "ours,plain")
    assert "ours/plain" in out and "fp32:" in out, out


@pytest.mark.full  # compiles two regions per dtype (~20 s); the long-context benchmark is the default-tier sibling
def test_cross_entropy_benchmark_reports_each_loss_and_its_saved_bytes():
    out = _run("bench_cross_entropy.py", "--seq", "64", "--batch", "2", "--vocab", "8192", "--rounds", "3")
    for dtype in ("float32", "bfloat16"):
        line = next(line for line in out.splitlines() if line.startswith(dtype))
        assert all(word in line for word in ("reference", "fused", "torch", "saves")), out
