"""``torchrun`` for one node, as a launch script calls it, at the cost of one interpreter start: a stand-in
the example-script tests give the scripts as ``TORCHRUN`` when the test is about the script, not torchrun.

    python -m tests.torchrun_standin --nproc_per_node 2 --nnodes 1 --node_rank 0 \\
        --master_addr localhost --master_port 6000 pretrain_gpt.py FLAGS...

It imports what ``tests/entry_launcher.py`` preloads once, then forks one process per rank with the
environment torchrun gives its workers (``entry_launcher.rank_environment``); the ranks write to this
process's stdout and stderr, as torchrun's workers do. The exit status is torchrun's: 0 when every rank
exits 0, else 1 (the other ranks are then stopped). SIGTERM and SIGINT are passed on to the ranks. Only a
single-node launch is accepted: any other ``--nnodes``, ``--node_rank`` or master address, or a torchrun
option it does not know, is refused (exit 2) rather than ignored.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import List, Optional, Sequence

from tests.entry_launcher import fork_rank, preload, wait_ranks
from tests.ports import free_port

LOCAL_HOSTS = ("localhost", "127.0.0.1")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """torchrun's single-node options (both spellings), then the entry point and its arguments."""
    parser = argparse.ArgumentParser(prog="torchrun_standin", allow_abbrev=False)
    parser.add_argument("--nproc_per_node", "--nproc-per-node", type=int, required=True)
    parser.add_argument("--nnodes", default="1")
    parser.add_argument("--node_rank", "--node-rank", type=int, default=0)
    parser.add_argument("--master_addr", "--master-addr", default="localhost")
    parser.add_argument("--master_port", "--master-port", type=int, default=None)
    parser.add_argument("--standalone", action="store_true")
    parser.add_argument("entry")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(list(argv))
    if args.nnodes not in ("1", "1:1") or args.node_rank != 0 or args.master_addr not in LOCAL_HOSTS:
        parser.error(
            f"one local node only: --nnodes {args.nnodes} --node_rank {args.node_rank} "
            f"--master_addr {args.master_addr} need real torchrun"
        )
    if args.master_port is None:
        if not args.standalone:
            parser.error("--master_port is required without --standalone")
        args.master_port = free_port()  # a port nothing listens on now, as torchrun --standalone picks one
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    preload()
    sys.stdout.flush()
    sys.stderr.flush()
    request = dict(
        nproc=args.nproc_per_node,
        argv=[args.entry, *args.args],
        cwd=os.getcwd(),
        env=dict(os.environ),
        port=args.master_port,
        stdout=None,
        stderr=None,
    )
    pids: List[int] = []

    def forward(signum: int, _frame: object) -> None:
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    pids.extend(fork_rank(request, rank) for rank in range(args.nproc_per_node))
    return wait_ranks(pids)


if __name__ == "__main__":
    sys.exit(main())
