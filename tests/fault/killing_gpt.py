"""pretrain_gpt.py that SIGKILLs itself in the middle of its N-th checkpoint save (for the fault suite).

Usage: python killing_gpt.py <N> <Megatron flags...>
The kill lands after every rank wrote its shard files and before ``metadata.json`` marks the
directory complete: the moment a power cut or an OOM killer hurts most.
"""

import os
import runpy
import signal
import sys

from megatron.core.dist_checkpointing import serialization


def main() -> None:
    target, seen = int(sys.argv.pop(1)), {"n": 0}
    write = serialization.write_json_atomic

    def write_or_die(path, data):
        if os.path.basename(path) == serialization.METADATA_FILE:
            seen["n"] += 1
            if seen["n"] == target:
                os.kill(os.getpid(), signal.SIGKILL)
        return write(path, data)

    serialization.write_json_atomic = write_or_die
    sys.argv[0] = os.path.join(os.path.dirname(__file__), "..", "..", "pretrain_gpt.py")
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
