"""The examples run as documented, and every entry point refuses a flag it does not know."""

import math
import os
import re
import subprocess

import pytest

from tests.entry_launcher import launch
from tests.functional_tests.example_runs import STANDIN_TORCHRUN_ARGV
from tests.functional_tests.gpt_runs import REPO, free_port


def test_simple_mcore_train_loop_on_two_ranks(tmp_path):
    """The README's ``torchrun --standalone --nproc-per-node 2 examples/run_simple_mcore_train_loop.py``, through
    torchrun's one-node stand-in (``tests/torchrun_standin.py``: the same worker environment, one interpreter
    start instead of three; the launch through torchrun itself is test_example_scripts[gpt3]'s)."""
    ckpt = tmp_path / "ckpt"
    cmd = [
        *STANDIN_TORCHRUN_ARGV,
        "--standalone",
        "--nproc-per-node=2",
        os.path.join(REPO, "examples", "run_simple_mcore_train_loop.py"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", CHECKPOINT_DIR=str(ckpt), PYTHONPATH=REPO)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"lm loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
    assert (ckpt / "metadata.json").exists()


@pytest.mark.parametrize("entry", ["pretrain_gpt.py", "pretrain_bert.py", "pretrain_t5.py"])
def test_entry_points_refuse_unknown_flags(entry, tmp_path):
    # One rank from the tests' preloaded launcher: the flag is refused before anything distributed starts.
    code, _, stderr = launch(
        1,
        [os.path.join(REPO, entry), "--no-such-flag"],
        str(tmp_path),
        dict(os.environ, PYTHONPATH=REPO),
        free_port(),
        120,
    )
    assert code != 0 and "unrecognized arguments: --no-such-flag" in stderr
