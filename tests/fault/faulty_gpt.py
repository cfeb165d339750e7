"""pretrain_gpt.py with one injected fault (for the fault suite).

Usage: python faulty_gpt.py <fault> <argument> <Megatron flags...>

- ``kill-at-save N``: SIGKILL itself in the middle of its N-th checkpoint save, after every rank
  wrote its shard files and before ``metadata.json`` marks the directory complete (the moment a
  power cut or an OOM killer hurts most).
- ``file-size-limit BYTES``: no file this process writes may grow past BYTES (``RLIMIT_FSIZE``,
  SIGXFSZ ignored, so writes fail with EFBIG as on a full disk).
"""

import os
import resource
import runpy
import signal
import sys

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


def file_size_limit(nbytes: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


FAULTS = {"kill-at-save": kill_at_save, "file-size-limit": file_size_limit}


def main() -> None:
    fault, argument = sys.argv.pop(1), int(sys.argv.pop(1))
    FAULTS[fault](argument)
    sys.argv[0] = os.path.join(os.path.dirname(__file__), "..", "..", "pretrain_gpt.py")
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
