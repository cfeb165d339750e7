"""Fake-CUDA dry run: would a training step of this layout crash on GPUs with NCCL? Checked on CPU.

Plays one rank (``--dry-run-rank``) of a world of any size (``--dry-run-world-size``) in one
process: ``pretrain_gpt.py`` with the given flags over torch.distributed's ``fake`` backend
(``--fake-process-group``), every tensor a fake tensor on ``cuda:0``. It trains N iterations
(``--train-iters``, default 3), saves a checkpoint, resumes from it in a new process and
trains ``--dry-run-resume-iters`` more. It fails (exit 1) on a device mismatch, a CPU
tensor in an NCCL collective or p2p call, or more than ``--max-syncs-per-iter`` host
synchronisations in a steady-state iteration, and prints, per iteration, each host sync
and attention call with its source line.

    python tools/gpu_dry_run.py --dry-run-rank 5 --dry-run-world-size 8 -- \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 \\
        --global-batch-size 16 --lr 1e-3 --bf16 --use-distributed-optimizer --mock-data \\
        --tokenizer-type NullTokenizer --vocab-size 128 --num-workers 0

    python tools/gpu_dry_run.py --dry-run-grid all    # the checked grid (first, middle, last rank)

This script loads a CUDA shim before torch is imported (see
``tools/dry_run/cuda_shim.py``): run it as a script, not from a process that
imported torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.dry_run.cuda_shim import load_cuda_shim  # noqa: E402 - imports no torch


def parse(argv: Sequence[str]) -> Tuple[argparse.Namespace, List[str]]:
    """The tool's own flags (``--dry-run-*``, ``--max-syncs-per-iter``); the rest go to pretrain_gpt.py."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument(
        "--dry-run-rank",
        default="first,middle,last",
        help="rank(s) to play: an integer, first/middle/last, a comma list, or all",
    )
    parser.add_argument(
        "--dry-run-world-size",
        type=int,
        default=None,
        help="world size (default: TP x PP x CP of the flags, i.e. DP 1)",
    )
    parser.add_argument("--dry-run-resume-iters", type=int, default=2, help="iterations after the resume")
    parser.add_argument("--dry-run-no-checkpoint", action="store_true", help="no save and no resume")
    parser.add_argument(
        "--max-syncs-per-iter", type=int, default=None, help="fail if a steady-state iteration makes more host syncs"
    )
    parser.add_argument("--dry-run-parallel", type=int, default=os.cpu_count() or 1, help="processes at once")
    parser.add_argument("--dry-run-workdir", default=None, help="checkpoints and logs (default: a temp dir)")
    parser.add_argument("--dry-run-json", default=None, help="write the summary of every job as JSON here")
    parser.add_argument(
        "--dry-run-grid",
        default=None,
        metavar="CASES",
        help="run the built-in grid (all, or comma-separated case names, each optionally NAME:RANKS with ranks "
        "joined by +, e.g. cp2-tp2-dp2-bf16:first) instead of given flags",
    )
    parser.add_argument("--dry-run-verbose", action="store_true", help="per-iteration report of every job")
    args, rest = parser.parse_known_args(list(argv))
    return args, [a for a in rest if a != "--"]


def _int_flag(flags: Sequence[str], name: str, default: int) -> int:
    from tools.dry_run.scheduler import flag_value

    value = flag_value(flags, name)
    return int(value) if value is not None else default


def build_jobs(args: argparse.Namespace, flags: List[str], workdir: str) -> list:
    """Jobs for the grid, or for the given flags at the chosen ranks."""
    from tools.dry_run import grid
    from tools.dry_run.scheduler import Job

    if args.dry_run_grid is not None:
        return grid.grid_jobs(
            grid.select_cases(args.dry_run_grid),
            args.dry_run_rank,
            workdir,
            resume_iters=args.dry_run_resume_iters,
            case_ranks=grid.case_ranks(args.dry_run_grid),
        )
    world = args.dry_run_world_size or (
        _int_flag(flags, "--tensor-model-parallel-size", 1)
        * _int_flag(flags, "--pipeline-model-parallel-size", 1)
        * _int_flag(flags, "--context-parallel-size", 1)
    )
    return [
        Job(
            name="flags",
            flags=flags,
            rank=rank,
            world_size=world,
            workdir=os.path.join(workdir, f"rank{rank}"),
            iters=_int_flag(flags, "--train-iters", 3),
            resume_iters=args.dry_run_resume_iters,
            checkpoint=not args.dry_run_no_checkpoint,
            max_syncs=args.max_syncs_per_iter,
        )
        for rank in grid.pick_ranks(args.dry_run_rank, world)
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, flags = parse(sys.argv[1:] if argv is None else argv)
    if args.dry_run_grid is None and not flags:
        print("give pretrain_gpt.py flags after --, or --dry-run-grid all", file=sys.stderr)
        return 2
    print(f"CUDA: {load_cuda_shim()} (shim: a paper GPU for fake tensors in a CPU-only torch)", flush=True)
    from tools.dry_run import summary
    from tools.dry_run.runner import preload
    from tools.dry_run.scheduler import run_jobs

    preload()
    workdir = args.dry_run_workdir or tempfile.mkdtemp(prefix="gpu-dry-run-")
    jobs = build_jobs(args, flags, workdir)
    started = time.time()
    outcomes = run_jobs(jobs, parallel=args.dry_run_parallel)
    verbose = args.dry_run_verbose or len(jobs) == 1
    print(summary.render(outcomes, verbose=verbose, seconds=time.time() - started), flush=True)
    if args.dry_run_json:
        with open(args.dry_run_json, "w") as f:
            json.dump(summary.as_json(outcomes), f, indent=1)
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
