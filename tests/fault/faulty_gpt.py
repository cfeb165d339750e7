"""pretrain_gpt.py with one injected fault (for the fault suite).

Usage: python faulty_gpt.py <fault> <argument> <Megatron flags...>

- ``kill-at-save N``: SIGKILL itself in the middle of its N-th checkpoint save, after every rank
  wrote its shard files and before ``metadata.json`` marks the directory complete (the moment a
  power cut or an OOM killer hurts most).
- ``kill-writer N``: rank 1's background writer (``--async-save``) kills the process in the N-th save,
  after its shard files and before their checksums (the writer dies mid-save).
- ``kill-before-publish N``: rank 0 is killed as the N-th asynchronous save starts its finalization (every
  rank's files written, nothing published).
- ``kill-before-tracker N``: rank 0 is killed in the N-th save after ``metadata.json``, before the tracker.
- ``kill-rank1-once N``: on torchrun's first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), rank 1
  SIGKILLs itself before training step N+1 (a rank failure that an in-job restart survives).
- ``kill-all-at N``: every rank SIGKILLs itself before training step N+1 (the job dies: no exit save).
- ``slow-rank R``: rank R sleeps 150 ms in every forward of its model (a straggler).
- ``file-size-limit BYTES``: no file this process writes may grow past BYTES (``RLIMIT_FSIZE``,
  SIGXFSZ ignored, so writes fail with EFBIG as on a full disk).
"""

import os
import resource
import runpy
import signal
import sys
import threading

from megatron.core.dist_checkpointing import serialization


def kill_at_save(target: int) -> None:
    seen = {"n": 0}
    write = serialization.write_json_atomic

    def write_or_die(path, data):
        if os.path.basename(path) == serialization.METADATA_FILE:
            seen["n"] += 1
            if seen["n"] == target:
                os.kill(os.getpid(), signal.SIGKILL)
        return write(path, data)

    serialization.write_json_atomic = write_or_die


def _kill_on_call(owner, name: str, target: int, rank: int, writer_thread: bool = False) -> None:
    """Replace ``owner.name`` with a wrapper that SIGKILLs this process at its ``target``-th call on ``rank``
    (with ``writer_thread``, counting only calls from a thread other than the main one)."""
    original, seen = getattr(owner, name), {"n": 0}

    def call_or_die(*args, **kwargs):
        if not writer_thread or threading.current_thread() is not threading.main_thread():
            seen["n"] += 1
        if seen["n"] == target and int(os.environ.get("RANK", "0")) == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(owner, name, call_or_die)


def kill_writer(target: int) -> None:
    from megatron.core.dist_checkpointing import checksums

    _kill_on_call(checksums, "hash_files", target, rank=1, writer_thread=True)


def kill_before_publish(target: int) -> None:
    _kill_on_call(serialization.StagedSave, "finalize", target, rank=0)


def kill_before_tracker(target: int) -> None:
    from megatron.training import checkpointing

    _kill_on_call(checkpointing, "update_tracker", target, rank=0)


def kill_rank1_once(iteration: int) -> None:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or int(os.environ.get("RANK", "0")) != 1:
        return
    kill_all_at(iteration)


def kill_all_at(iteration: int) -> None:
    from megatron.training import training

    step = training.train_step

    def step_or_die(loop):
        if loop.state.iteration == iteration:
            os.kill(os.getpid(), signal.SIGKILL)
        return step(loop)

    training.train_step = step_or_die


def slow_rank(rank: int) -> None:
    if int(os.environ.get("RANK", "0")) != rank:
        return
    import time

    from megatron.core.models.gpt.gpt_model import GPTModel

    forward = GPTModel.forward

    def slow_forward(self, *args, **kwargs):
        time.sleep(0.15)
        return forward(self, *args, **kwargs)

    GPTModel.forward = slow_forward


def file_size_limit(nbytes: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


FAULTS = {
    "kill-at-save": kill_at_save,
    "kill-writer": kill_writer,
    "kill-before-publish": kill_before_publish,
    "kill-before-tracker": kill_before_tracker,
    "kill-rank1-once": kill_rank1_once,
    "kill-all-at": kill_all_at,
    "slow-rank": slow_rank,
    "file-size-limit": file_size_limit,
}


def main() -> None:
    fault, argument = sys.argv.pop(1), int(sys.argv.pop(1))
    FAULTS[fault](argument)
    sys.argv[0] = os.path.join(os.path.dirname(__file__), "..", "..", "pretrain_gpt.py")
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
