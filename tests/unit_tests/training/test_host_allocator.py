"""``retain_freed_host_memory``: after it, re-allocating a large freed tensor faults in no new pages.

Each case runs in a fresh interpreter (glibc's settings are per process): it allocates, fills and
frees a 64 MiB tensor 20 times and reports the page faults of the last four rounds. Without the
setting glibc maps every such block afresh (16384 4-KiB pages per round); with it the heap is
reused once glibc's aligned blocks have settled (up to 9 rounds seen here; a training step's mix
settles in 2-3 steps). A user's own ``MALLOC_MMAP_MAX_`` wins.
"""

import json
import os
import subprocess
import sys

import pytest

from megatron.training.host_allocator import _glibc, retain_freed_host_memory

PAGES_PER_ROUND = 64 * 2**20 // 4096

# The child turns transparent huge pages off for itself (prctl PR_SET_THP_DISABLE): where the host kernel has
# them "always" on, a fresh 64 MiB block faults in 32 huge pages, not 16,384 small ones, and the reference
# below could not tell fresh pages from reused ones (here the host has "madvise", which torch never asks for).
CHILD = """
import ctypes, json, resource, sys
ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
import torch
from megatron.training.host_allocator import retain_freed_host_memory
report = retain_freed_host_memory() if sys.argv[1] == "retain" else ""
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(16 * 2**20, dtype=torch.float32).fill_(1.0)  # 64 MiB, every page touched
    del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"report": report, "faults": sum(faults[16:]), "each": faults}))
"""


def _run(mode: str, **env: str) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environ.update(env, PYTHONPATH=repo)
    out = subprocess.run([sys.executable, "-c", CHILD, mode], env=environ, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(_glibc() is None, reason="needs glibc")
def test_freed_memory_is_reused_without_page_faults():
    retained = _run("retain")
    assert retained["faults"] < PAGES_PER_ROUND // 16, retained
    assert "kept for reuse" in retained["report"]
    # The reference: the user's own glibc setting (here glibc's default, as without the call) is left
    # alone, and fresh pages fault in every round.
    user = _run("retain", MALLOC_MMAP_MAX_="65536")
    assert user["faults"] > 3 * PAGES_PER_ROUND and "left as set by MALLOC_MMAP_MAX_" in user["report"], user


def test_user_settings_are_reported_not_overridden():
    report = retain_freed_host_memory({"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert report == "host allocator: left as set by MALLOC_TRIM_THRESHOLD_"
