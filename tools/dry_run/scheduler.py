"""Dry-run jobs (a flag set played as one rank): two phases each, forked children, a verdict.

A job trains ``iters`` iterations and saves a checkpoint (phase ``train``), then a new
process loads it and trains ``resume_iters`` more (phase ``resume``). Each phase runs in a
child forked from this process (which imported torch after the CUDA shim, and nothing
else has run), so every phase starts from clean global state; up to ``parallel`` children
run at once. The verdict: no error in either phase, the resume phase loaded the
checkpoint, no iteration skipped its optimizer step (a stand-in value read as an overflow),
and no steady-state iteration (any but the first of a phase) made more host
synchronisations than ``max_syncs`` (when given).
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from tools.dry_run.runner import Phase, redirected_output, result_to_json, run_phase

_OWN_FLAGS = {
    "--train-iters": 1,
    "--train-samples": 1,
    "--save": 1,
    "--load": 1,
    "--save-interval": 1,
    "--exit-interval": 1,
    "--fake-process-group": 0,
}
PHASE_TIMEOUT_S = 600


def without_flags(flags: Sequence[str], names: Dict[str, int]) -> List[str]:
    """``flags`` without each flag of ``names`` (name -> how many values follow it)."""
    out, i = [], 0
    while i < len(flags):
        if flags[i] in names:
            i += 1 + names[flags[i]]
            continue
        out.append(flags[i])
        i += 1
    return out


def flag_value(flags: Sequence[str], name: str) -> Optional[str]:
    return flags[flags.index(name) + 1] if name in flags and flags.index(name) + 1 < len(flags) else None


@dataclass
class Job:
    """One flag set as one rank of ``world_size``; ``workdir`` holds its checkpoint and logs."""

    name: str
    flags: List[str]
    rank: int
    world_size: int
    workdir: str
    iters: int = 3
    resume_iters: int = 2
    checkpoint: bool = True
    max_syncs: Optional[int] = None
    python_path: List[str] = field(default_factory=list)  # put first on sys.path in each phase (a fake package)
    entry_point: str = "gpt"  # pretrain_gpt.py or pretrain_mamba.py

    def phases(self) -> List[Phase]:
        """``train`` stops after ``iters`` (``--exit-interval``) and saves; ``resume`` loads and finishes.

        Both phases have the same ``--train-iters``, so the LR schedule in the checkpoint matches.
        ``--eval-iters`` defaults to 1 (evaluation at the end runs once, not Megatron's 100 times).
        """
        base = without_flags(self.flags, _OWN_FLAGS)
        if "--eval-iters" not in base:
            base += ["--eval-iters", "1"]
        total = self.iters + (self.resume_iters if self.checkpoint else 0)
        ckpt = os.path.join(self.workdir, "checkpoint")
        train = base + ["--train-iters", str(total)]
        if not self.checkpoint:
            return [Phase("train", train, self.rank, self.world_size, self.entry_point)]
        save = ["--exit-interval", str(self.iters), "--save", ckpt]
        return [
            Phase("train", train + save, self.rank, self.world_size, self.entry_point),
            Phase("resume", train + ["--load", ckpt], self.rank, self.world_size, self.entry_point),
        ]


@dataclass
class Outcome:
    """A finished job: its phases' results, the problems found (none: passed), wall time."""

    job: Job
    results: List[Dict[str, Any]] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def steady_syncs(self) -> Dict[str, int]:
        """Host syncs of each iteration after the first of its phase."""
        out: Dict[str, int] = {}
        for result in self.results:
            per_iteration = result["recorder"].get("syncs_per_iteration", {})
            out.update(dict(list(per_iteration.items())[1:]))
        return out


def judge(outcome: Outcome) -> None:
    """Fill ``outcome.problems`` (see the module docstring)."""
    job = outcome.job
    for result in outcome.results:
        error = result.get("error")
        if error:
            outcome.problems.append(
                f"{result['phase']['name']} phase: {error['kind']}: {error['message']} "
                f"at {error['site']}: {error['code']}"
            )
    if job.checkpoint and not outcome.problems:
        resume = outcome.results[-1]["recorder"]
        reads = [e for e in resume["events"] if e["segment"] == "load"]
        if not reads:
            outcome.problems.append("resume phase: no checkpoint was loaded")
    for result in outcome.results:
        for info in result["recorder"].get("iterations", []):
            if info["skipped"]:
                outcome.problems.append(
                    f"{info['segment']}: skipped (an inf/NaN stand-in): its optimizer step went unchecked"
                )
    if job.max_syncs is not None:
        for segment, count in outcome.steady_syncs().items():
            if count > job.max_syncs:
                outcome.problems.append(f"{segment}: {count} host syncs > --max-syncs-per-iter {job.max_syncs}")


def _child(phase: Phase, result_path: str, log_path: str, python_path: Sequence[str] = ()) -> None:
    import sys

    import torch

    sys.path[:0] = list(python_path)

    torch.set_num_threads(1)
    with redirected_output(log_path):
        result = result_to_json(run_phase(phase))
    with open(result_path, "w") as f:
        json.dump(result, f)


class _Running:
    def __init__(self, outcome: Outcome, index: int, process: Any, result_path: str, started: float) -> None:
        self.outcome, self.index, self.process, self.result_path, self.started = (
            outcome,
            index,
            process,
            result_path,
            started,
        )


def _start(outcome: Outcome, index: int) -> _Running:
    phase = outcome.job.phases()[index]
    os.makedirs(outcome.job.workdir, exist_ok=True)
    if index == 0:  # a fresh start: a checkpoint left by an earlier run in this directory would be refused
        shutil.rmtree(os.path.join(outcome.job.workdir, "checkpoint"), ignore_errors=True)
    result_path = os.path.join(outcome.job.workdir, f"{phase.name}.json")
    log_path = os.path.join(outcome.job.workdir, f"{phase.name}.log")
    process = multiprocessing.get_context("fork").Process(
        target=_child, args=(phase, result_path, log_path, outcome.job.python_path)
    )
    process.start()
    return _Running(outcome, index, process, result_path, time.time())


def _collect(running: _Running) -> bool:
    """Read a finished phase's result into its outcome; True if the job goes on to its next phase."""
    outcome, phase = running.outcome, running.outcome.job.phases()[running.index]
    running.process.join()
    if os.path.isfile(running.result_path):
        with open(running.result_path) as f:
            outcome.results.append(json.load(f))
    else:
        log = os.path.join(outcome.job.workdir, f"{phase.name}.log")
        outcome.results.append(
            {
                "phase": {"name": phase.name},
                "recorder": {"events": []},
                "error": {
                    "kind": "crash",
                    "message": f"exit code {running.process.exitcode} (see {log})",
                    "site": "",
                    "code": "",
                },
            }
        )
    failed = outcome.results[-1].get("error") is not None
    return not failed and running.index + 1 < len(outcome.job.phases())


def run_jobs(jobs: Sequence[Job], parallel: int = 1) -> List[Outcome]:
    """Run every job's phases in forked children, ``parallel`` at a time; returns judged outcomes."""
    outcomes = [Outcome(job) for job in jobs]
    waiting = [(o, 0) for o in outcomes]
    running: List[_Running] = []
    started_at = {id(o): 0.0 for o in outcomes}
    while waiting or running:
        while waiting and len(running) < max(1, parallel):
            outcome, index = waiting.pop(0)
            started_at[id(outcome)] = started_at[id(outcome)] or time.time()
            running.append(_start(outcome, index))
        ready = multiprocessing.connection.wait([r.process.sentinel for r in running], timeout=5.0)
        for item in list(running):
            overdue = time.time() - item.started > PHASE_TIMEOUT_S
            if item.process.sentinel not in ready and not overdue:
                continue
            if overdue:
                item.process.kill()
            running.remove(item)
            if _collect(item):
                waiting.insert(0, (item.outcome, item.index + 1))
            else:
                item.outcome.seconds = time.time() - started_at[id(item.outcome)]
                judge(item.outcome)
    return outcomes
