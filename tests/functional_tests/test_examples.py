"""The examples run as documented, and the not-yet-implemented entry points say so."""

import math
import os
import re
import subprocess
import sys

import pytest

from tests.functional_tests.gpt_runs import REPO


def test_simple_mcore_train_loop_on_two_ranks(tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        os.path.join(REPO, "examples", "run_simple_mcore_train_loop.py"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", CHECKPOINT_DIR=str(ckpt))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"lm loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
    assert (ckpt / "metadata.json").exists()


@pytest.mark.parametrize("entry", ["pretrain_t5.py"])
def test_unimplemented_entry_points_parse_flags_then_stop(entry):
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, entry), *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert proc.returncode != 0
    assert "not implemented yet" in proc.stderr and "unrecognized arguments" not in proc.stderr
    bad = subprocess.run(
        [sys.executable, os.path.join(REPO, entry), "--no-such-flag"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert bad.returncode != 0 and "unrecognized arguments" in bad.stderr
