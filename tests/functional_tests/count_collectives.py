"""Run a training script and print how often each rank called some torch.distributed collectives.

``python count_collectives.py SCRIPT ARGS...`` wraps ``COUNTED`` in ``torch.distributed`` (the code
calls them as ``dist.<name>``, looked up at call time), runs ``SCRIPT`` as ``__main__`` and, however
it ends, prints one line ``collective counts <rank> <json>``.
"""

import collections
import json
import os
import re
import runpy
import sys

import torch.distributed as dist

# torch.distributed function -> what it does (all_gather_single is the newer name of all_gather_into_tensor)
COUNTED = {
    "batch_isend_irecv": "p2p",
    "all_to_all_single": "all-to-all",
    "all_gather_into_tensor": "all-gather",
    "all_gather_single": "all-gather",
}
PREFIX = "collective counts"
# found anywhere in the output: ranks share one pipe, so a rank's line can be glued to another's
_REPORT = re.compile(re.escape(PREFIX) + r" (\d+) (\{[^{}]*\})")


def _wrap(name: str, counts: collections.Counter) -> None:
    original = getattr(dist, name)

    def counted(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)

    setattr(dist, name, counted)


def parse(output: str) -> dict:
    """``{rank: {kind of collective: calls}}`` from a run's output."""
    found = {}
    for rank, counts in _REPORT.findall(output):
        by_kind = collections.Counter({kind: 0 for kind in COUNTED.values()})
        for name, calls in json.loads(counts).items():
            by_kind[COUNTED[name]] += calls
        found[int(rank)] = dict(by_kind)
    return found


if __name__ == "__main__":
    calls: collections.Counter = collections.Counter()
    for collective in COUNTED:
        if hasattr(dist, collective):
            _wrap(collective, calls)
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        # one write, newline included, so the report is not split from its own line end
        sys.stdout.write(f"\n{PREFIX} {os.environ.get('RANK', '0')} {json.dumps(calls)}\n")
        sys.stdout.flush()
