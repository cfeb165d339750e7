"""The end-to-end tests' torchrun stand-in (``tests/entry_launcher.py``) against torchrun itself: the same
rank environment, ``sys.argv``, working directory and output, and torchrun's exit rule."""

import json
import os
import subprocess
import sys

import pytest

from tests.entry_launcher import LaunchTimeout, launch
from tests.functional_tests.gpt_runs import REPO, free_port, parse_run

SCRIPT = """
import atexit, json, os, sys, time
import torch, torch.distributed as dist

rank = int(os.environ["RANK"])
mode = sys.argv[1]
if mode == "report":
    dist.init_process_group("gloo")
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    atexit.register(print, f"atexit on rank {rank}")
    names = [k for k in os.environ if k.startswith(("TORCHELASTIC", "MASTER", "ROLE", "GROUP", "LOCAL")) or k in
             ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING")]
    with open(f"rank{rank}.json", "w") as f:
        json.dump({"env": {k: os.environ[k] for k in names}, "argv": sys.argv, "cwd": os.getcwd(),
                   "path0": sys.path[0], "total": total.item(), "main": __name__}, f)
    print(f"rank {rank} of {os.environ['WORLD_SIZE']} reduced {total.item()}")
elif mode == "lines":
    for i in range(2000):
        print(f"rank {rank} line {i} " + "x" * 40)
elif mode == "fail" and rank == 1:
    raise ValueError("boom on rank 1")
else:
    time.sleep(600)
"""
# Set by torchrun's agent for its own bookkeeping; the stand-in has no agent.
AGENT_ONLY = {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE"}


def _reports(folder):
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


def test_ranks_see_what_torchrun_gives_them(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    (tmp_path / "fork").mkdir()
    (tmp_path / "torchrun").mkdir()
    code, output, _ = launch(2, [str(script), "report"], str(tmp_path / "fork"), env, free_port(), timeout=120)
    assert code == 0, output
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), "report"]
    real = subprocess.run(cmd, cwd=tmp_path / "torchrun", env=env, capture_output=True, text=True, timeout=120)
    assert real.returncode == 0, real.stderr
    for ours, theirs in zip(_reports(tmp_path / "fork"), _reports(tmp_path / "torchrun")):
        assert set(ours["env"]) == set(theirs["env"]) - AGENT_ONLY
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK"):
            assert ours["env"][name] == theirs["env"][name], name
        assert ours["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "False"  # rank 0 hosts the store
        assert ours["argv"] == theirs["argv"] == [str(script), "report"]
        assert ours["cwd"].endswith("fork") and ours["path0"] == theirs["path0"] == str(tmp_path)
        assert ours["total"] == theirs["total"] == 3.0 and ours["main"] == "__main__"
    for rank in range(2):
        assert f"rank {rank} of 2 reduced 3.0" in output and f"atexit on rank {rank}" in output


def test_a_failing_rank_fails_the_run_and_stops_the_others(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    # Rank 0 sleeps 600 s: the run ends within its 120 s (else LaunchTimeout) only if rank 0 was terminated. (No
    # wall-clock bound of our own: the launcher's start, minutes on a loaded machine, would count in it.)
    code, _, output = launch(2, [str(script), "fail"], str(tmp_path), env, free_port(), timeout=120)
    assert code == 1
    assert "Traceback (most recent call last)" in output and "ValueError: boom on rank 1" in output
    with pytest.raises(LaunchTimeout, match="did not finish in 3s"):
        launch(1, [str(script), "sleep"], str(tmp_path), env, free_port(), timeout=3)


def test_ranks_lines_reach_the_shared_output_whole(tmp_path):
    """Two ranks printing at once: every line arrives whole (an unbuffered stream wrote a line and its newline
    apart, and CI parsed one rank's report glued into another's line)."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    code, output, _ = launch(2, [str(script), "lines"], str(tmp_path), env, free_port(), timeout=120)
    assert code == 0
    expected = {f"rank {r} line {i} " + "x" * 40 for r in range(2) for i in range(2000)}
    lines = output.splitlines()
    assert len(lines) == len(expected) and set(lines) == expected


def test_a_run_whose_import_time_variables_differ_is_refused(tmp_path):
    """The fork server imported torch under its own environment; a run asking for another one must go to torchrun."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, TORCHDYNAMO_PROBE_ONLY="1")
    code, _, err = launch(1, [str(script), "lines"], str(tmp_path), env, free_port(), timeout=120)
    assert code != 0 and "['TORCHDYNAMO_PROBE_ONLY'] differ from the launcher's" in err


def test_a_training_line_is_found_after_another_ranks_unfinished_line():
    """Under real torchrun the ranks' block-buffered stdouts share one pipe: a rank's partial line can precede
    the last rank's whole training line, which is still parsed (and nothing else becomes one)."""
    head = "[2026-12-02 12:00:00] iteration        2/       4 |"
    line = f"{head} consumed samples: 16 | lm loss: 6.912345E+00 | loss scale: 1.0 |"
    glued = f"rank 0 says some[thing\n{head[:-1]}x\nwarning: half a line{line}\nthe rest of rank 0's line\n"
    parsed = parse_run(0, glued)
    assert [(p["iteration"], p["lm loss"]) for p in parsed.lines] == [(2, 6.912345)]
