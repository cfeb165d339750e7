"""``examples/slurm/pretrain_gpt.sbatch`` under a real Slurm cluster (``scripts/slurm_ci.sh`` starts a one-node one).

Marked ``slurm``: they run only with MEGATRON_SLURM_TESTS=1 (set by ``scripts/slurm_ci.sh``), which then requires
a cluster that answers ``sinfo``; otherwise they skip and say why (no Slurm commands, no controller, or a cluster
that did not ask for these jobs).

- The GPT script at toy size, sbatch'ed with 2 tasks (TP=2, srun starting one process per task), prints the losses
  of the same script under torchrun.
- A job hit by a SIGTERM saves a checkpoint, exits 0, requeues itself and resumes to the uninterrupted losses. The
  signal comes from ``scancel --signal=TERM``, which Slurm delivers to the job's tasks exactly as it delivers
  ``--signal=TERM@N`` (slurmctld -> slurmd -> every task of the step). The timed signal itself is not used: the
  time limit has a granularity of one minute and slurmctld checks it only about every 30 s, so it would land at
  an unpredictable iteration, making the test slow (a minute or more per run) or flaky (a toy run that finished
  first).
- A script with an impossible layout (TP=3 on 2 tasks) fails the job, and the log holds our validation message.

Every wait has a deadline; on failure the assertion carries the job log and ``scontrol show job``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from typing import Dict, List, Optional

import pytest

from megatron.training.initialize import expand_nodelist
from tests.functional_tests.example_runs import GPT3, REAL_TORCHRUN, SBATCH_GPT, run_script, toy_env
from tests.functional_tests.gpt_runs import REPO, RunResult, parse_run

pytestmark = pytest.mark.slurm

ITERS = 40
JOB_TIMEOUT_S = 240
COMMAND_TIMEOUT_S = 30
TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")
# A job whose header asks for 4 nodes of 8 GPUs, shrunk to this node's 2 CPUs.
TOY_ALLOCATION = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", "--time=10"]


def _cluster_problem() -> Optional[str]:
    """Why no Slurm cluster can take jobs here, or None."""
    missing = [cmd for cmd in ("sbatch", "sinfo", "scontrol", "scancel") if shutil.which(cmd) is None]
    if missing:
        return f"Slurm client commands not installed ({', '.join(missing)}); bash scripts/slurm_ci.sh starts a cluster"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"sinfo did not answer in {COMMAND_TIMEOUT_S}s"
    if proc.returncode != 0:
        said = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        return f"no Slurm controller answers sinfo ({said}); bash scripts/slurm_ci.sh starts one"
    if not set(proc.stdout.split()) & {"idle", "mix", "alloc"}:
        return f"no Slurm node can run jobs (sinfo states: {proc.stdout.split()})"
    return None


@pytest.fixture(scope="module", autouse=True)
def cluster() -> None:
    """Skip without a cluster, or with one that did not ask for these jobs; fail without one when asked."""
    problem = _cluster_problem()
    required = os.environ.get("MEGATRON_SLURM_TESTS") == "1"
    if problem is not None and required:
        pytest.fail(f"MEGATRON_SLURM_TESTS=1 but {problem}")
    if problem is not None:
        pytest.skip(problem)
    if not required:
        pytest.skip("a Slurm cluster answers sinfo, but these tests submit jobs to it: set MEGATRON_SLURM_TESTS=1")


# ----------------------------------------------------------------------------------
# Jobs.
# ----------------------------------------------------------------------------------
def _run(cmd: List[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}: {proc.stdout}{proc.stderr}"
    return proc.stdout


def slurm_env(**changes: str) -> Dict[str, str]:
    """The toy environment for a job: the script picks its launcher (srun), MASTER_ADDR comes from the node list.

    GPUS_PER_NODE=1: were torchrun started instead of srun, the job would hold one rank and TP=2 would fail.
    """
    return toy_env(ITERS, launcher=None, GPUS_PER_NODE="1", **changes)


def submit(tmp_path, env: Dict[str, str], name: str) -> str:
    """sbatch the GPT script at toy size (its output appended to tmp_path/NAME.log); the job id."""
    args = [str(tmp_path / f"{name}-ckpt"), str(tmp_path / "tb"), "-", "-", "MOCK"]
    log = tmp_path / f"{name}.log"
    cmd = ["sbatch", "--parsable", f"--job-name={name}", f"--output={log}", *TOY_ALLOCATION, SBATCH_GPT, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert proc.returncode == 0, f"sbatch refused the job: {proc.stderr}"
    return proc.stdout.strip().split(";")[0]


def job_fields(job_id: str) -> Dict[str, str]:
    """``scontrol show job -o``: Key=Value fields (JobState, Restarts, ExitCode, ...)."""
    return dict(re.findall(r"(\w+)=(\S*)", _run(["scontrol", "show", "job", "-o", job_id])))


def job_report(job_id: str, log) -> str:
    text = log.read_text() if log.exists() else "(no log written)"
    show = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    return f"--- {log} (end)\n{text[-6000:]}\n--- scontrol show job {job_id}\n{show.stdout}{show.stderr}"


def wait_until(job_id: str, log, done, what: str, timeout: float = JOB_TIMEOUT_S) -> None:
    """Poll until ``done()``; on timeout cancel the job and fail with its log."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            report = job_report(job_id, log)
            subprocess.run(["scancel", job_id], capture_output=True, timeout=COMMAND_TIMEOUT_S)
            raise AssertionError(f"job {job_id}: no {what} after {timeout}s\n{report}")
        time.sleep(0.5)


def wait_for_end(job_id: str, log) -> Dict[str, str]:
    """The job's final fields, once it reached a terminal state."""
    wait_until(job_id, log, lambda: job_fields(job_id)["JobState"] in TERMINAL_STATES, "end")
    return job_fields(job_id)


def logged(log) -> RunResult:
    return parse_run(0, log.read_text() if log.exists() else "")


def assert_job(job: Dict[str, str], state: str, restarts: int, job_id: str, log) -> None:
    got = (job["JobState"], int(job["Restarts"]))
    assert got == (state, restarts), f"job {job_id}: {got}, expected {(state, restarts)}\n{job_report(job_id, log)}"


# ----------------------------------------------------------------------------------
# Tests.
# ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torchrun_losses(tmp_path_factory) -> Dict[int, float]:
    """The GPT script at toy size under torchrun, outside Slurm: iteration -> lm loss."""
    tmp = tmp_path_factory.mktemp("torchrun")
    env = toy_env(ITERS, TORCHRUN=REAL_TORCHRUN)
    result = run_script(GPT3, [str(tmp / "ckpt"), str(tmp / "tb"), "-", "-", "MOCK"], env)
    assert result.returncode == 0, result.output[-6000:]
    assert len(result.lines) == ITERS, result.output[-6000:]
    return {line["iteration"]: line["lm loss"] for line in result.lines}


def test_sbatch_with_two_tasks_prints_the_torchrun_losses(tmp_path, torchrun_losses):
    job_id = submit(tmp_path, slurm_env(), "same-losses")
    log = tmp_path / "same-losses.log"
    assert_job(wait_for_end(job_id, log), "COMPLETED", 0, job_id, log)
    losses = {line["iteration"]: line["lm loss"] for line in logged(log).lines}
    assert losses == torchrun_losses, job_report(job_id, log)
    assert (tmp_path / "same-losses-ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)


def test_signal_saves_exits_zero_requeues_and_resumes(tmp_path, torchrun_losses):
    job_id = submit(tmp_path, slurm_env(), "requeue")
    log = tmp_path / "requeue.log"
    wait_until(job_id, log, lambda: len(logged(log).lines) >= 3, "3 logged iterations")
    _run(["scancel", "--signal=TERM", job_id])
    job = wait_for_end(job_id, log)
    assert_job(job, "COMPLETED", 1, job_id, log)
    text = log.read_text()
    first_start, resumed = text.split("requeue_if_unfinished: requeueing job", 1)
    saved = [int(x) for x in re.findall(r"iteration (\d+) of \d+ \(unfinished\)", first_start)]
    assert len(saved) == 1 and 3 <= saved[0] < ITERS, job_report(job_id, log)
    before = [line["iteration"] for line in parse_run(0, first_start).lines]
    after = [line["iteration"] for line in parse_run(0, resumed).lines]
    assert before == list(range(1, saved[0] + 1)) and after == list(range(saved[0] + 1, ITERS + 1)), text[-6000:]
    losses = {line["iteration"]: line["lm loss"] for line in logged(log).lines}
    assert losses == torchrun_losses, job_report(job_id, log)
    assert f"iteration {ITERS} of {ITERS} (finished)" in resumed


def test_impossible_layout_fails_the_job_with_the_validation_message(tmp_path):
    job_id = submit(tmp_path, slurm_env(TP="3", HIDDEN="48", HEADS="6"), "bad-layout")
    log = tmp_path / "bad-layout.log"
    job = wait_for_end(job_id, log)
    assert_job(job, "FAILED", 0, job_id, log)
    message = "world size 2 is not divisible by --tensor-model-parallel-size (3)"
    assert message in log.read_text(), job_report(job_id, log)
    assert not (tmp_path / "bad-layout-ckpt" / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.parametrize(
    "nodelist", ["a", "a,b", "node[1-3]", "node[01-04,07]", "rack[1-2]-node[1-2]", "n[9-11],login"]
)
def test_nodelist_expansion_is_scontrols(nodelist):
    assert expand_nodelist(nodelist) == _run(["scontrol", "show", "hostnames", nodelist]).split()
