"""How far a run saved under a ``--save`` directory got: its last checkpoint against its ``--train-iters``.

A job script asks this after the training processes exited 0 (``requeue_if_unfinished`` in
``examples/lib/launch.bash``): a run that ``--exit-signal-handler`` (or ``--exit-duration-in-mins``,
``--exit-interval``) stopped early saved a checkpoint short of its last iteration, so the job goes back into the
queue and resumes from that checkpoint with ``--load``.

    python -m megatron.training.run_progress CKPT    # exit 0: finished, 1: unfinished, 2: nothing to resume
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron.core.dist_checkpointing import CheckpointingError
from megatron.training.checkpoint_dirs import checkpoint_dir, read_tracker
from megatron.training.checkpointing import saved_args
from megatron.training.flags.derive import total_train_iters

FINISHED, UNFINISHED, NO_CHECKPOINT = 0, 1, 2


@dataclass(frozen=True)
class RunProgress:
    """The iteration of the last complete checkpoint and the iterations the run was started for."""

    iteration: int
    train_iters: int

    @property
    def finished(self) -> bool:
        return self.iteration >= self.train_iters


def run_progress(root: str) -> Optional[RunProgress]:
    """The progress recorded under ``root``; None when it holds no checkpoint yet.

    Raises:
        CheckpointingError: the tracker names a release checkpoint (no training run) or the
            checkpoint holds no arguments to read ``--train-iters`` / ``--train-samples`` from.
    """
    found = read_tracker(root)
    if found is None:
        return None
    iteration, release = found
    if release:
        raise CheckpointingError(f"{root}: the tracker names a release checkpoint, not a run in progress")
    iter_dir = checkpoint_dir(root, iteration)
    args = saved_args(iter_dir)
    if not isinstance(args, dict):
        raise CheckpointingError(f"{iter_dir} holds no arguments: cannot tell how many iterations the run has")
    return RunProgress(iteration, total_train_iters(argparse.Namespace(**args)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("save_dir", help="the run's --save directory")
    root = parser.parse_args(argv).save_dir
    progress = run_progress(root)
    if progress is None:
        print(f"{root}: no checkpoint to resume from")
        return NO_CHECKPOINT
    state = "finished" if progress.finished else "unfinished"
    print(f"{root}: iteration {progress.iteration} of {progress.train_iters} ({state})")
    return FINISHED if progress.finished else UNFINISHED


if __name__ == "__main__":
    sys.exit(main())
