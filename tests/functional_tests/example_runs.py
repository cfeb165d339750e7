"""Run the launch scripts under ``examples/`` at toy size on CPU and read back what they printed.

The scripts read every size from the environment (see their headers); ``toy_env`` sets the sizes of a 2-layer,
hidden-32 GPT on 2 gloo ranks, mock data, and the launcher: torchrun (``TORCHRUN``: the one-node stand-in
``tests/torchrun_standin.py`` unless a test sets ``REAL_TORCHRUN``), or, with ``launcher=None``, whatever the script
picks (srun inside a Slurm job). Shared by the loop over all
example scripts and the tests under a real Slurm cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, Optional, Sequence

from tests.functional_tests.gpt_runs import REPO, RUN_TIMEOUT_S, RunResult, free_port, parse_run

# The GPT family scripts (gpt3, llama, mixtral) at toy size: DECAY_ITERS and warm-up short enough that the
# learning rate moves, evaluation only at the end, one checkpoint at the end.
TOY_GPT = dict(
    NUM_LAYERS="2",
    HIDDEN="32",
    FFN="64",
    HEADS="4",
    QUERY_GROUPS="2",
    EXPERTS="4",
    SEQ="32",
    MBS="2",
    GBS="8",
    RAMPUP="",
    WARMUP_ITERS="1",
    PRECISION="",
    VOCAB_SIZE="600",
    LOG_INTERVAL="1",
    SAVE_INTERVAL="1000",
    EVAL_INTERVAL="1000",
    EVAL_ITERS="1",
    TP="2",
    PP="1",
    EP="1",
)
GPT3 = os.path.join("examples", "gpt3", "train_gpt3_175b_distributed.sh")
SBATCH_GPT = os.path.join("examples", "slurm", "pretrain_gpt.sbatch")
# torchrun itself, and the one-node stand-in (tests/torchrun_standin.py: the ranks forked from one interpreter that
# imported torch and the entry points once, instead of torchrun's agent and one interpreter per rank): a test about
# a script's flags uses the stand-in, a test of the launch through torchrun sets TORCHRUN=REAL_TORCHRUN.
REAL_TORCHRUN = f"{sys.executable} -m torch.distributed.run"
STANDIN_TORCHRUN_ARGV = [sys.executable, "-m", "tests.torchrun_standin"]
STANDIN_TORCHRUN = " ".join(STANDIN_TORCHRUN_ARGV)
# Variables of an enclosing job that would change how a script launches: Slurm's (srun) and torchrun's.
LAUNCH_VARS = ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_NODELIST", "LAUNCHER")
LAUNCH_VARS += ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "EXTRA")


def toy_env(iters: int, launcher: Optional[str] = "torchrun", **changes: str) -> Dict[str, str]:
    """The environment for a toy run of ``iters`` iterations on 2 ranks; ``changes`` override any variable."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(TOY_GPT, ITERS=str(iters), DECAY_ITERS=str(iters), GPUS_PER_NODE="2")
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO, PYTHON=sys.executable, MASTER_PORT=str(free_port()))
    env.update(TORCHRUN=STANDIN_TORCHRUN, TOKENIZERS_PARALLELISM="false")
    env.update(EXTRA="--distributed-backend gloo --num-workers 0")
    if launcher is not None:
        env["LAUNCHER"] = launcher
    env.update(changes)
    return env


def run_script(script: str, args: Sequence[str], env: Dict[str, str], timeout: float = RUN_TIMEOUT_S) -> RunResult:
    """``bash script args`` from the repository root with a hard timeout; its output parsed."""
    cmd = ["bash", os.path.join(REPO, script), *args]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(
            f"{script} did not finish in {timeout}s:\n{(err.stdout or b'')[-4000:]!r}\n{(err.stderr or b'')[-4000:]!r}"
        ) from err
    return parse_run(proc.returncode, proc.stdout + proc.stderr)
