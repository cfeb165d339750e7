"""The multi-rank harness itself: results, tracebacks and hangs come back to the test."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import DistributedTestError, run_distributed


def _sum_of_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _rank_one_raises(rank, world_size):
    if rank == 1:
        raise KeyError("boom on rank one")
    dist.barrier()


def _rank_one_sleeps(rank, world_size):
    if rank == 1:
        time.sleep(600)
    return rank


def test_results_come_back_per_rank():
    assert run_distributed(_sum_of_ranks, 3) == [3.0, 3.0, 3.0]


def test_failing_rank_reports_its_traceback():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_one_raises, 2, timeout=60)
    text = str(info.value)
    assert "rank 1 failed" in text and "boom on rank one" in text and "_rank_one_raises" in text


def test_hung_rank_is_killed_and_named():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_one_sleeps, 2, timeout=8)
    # Far below the 600 s sleep; room for the fork server's start (its imports), slow on a loaded machine.
    assert time.monotonic() - start < 120
    text = str(info.value)
    assert "rank 1 hung" in text and "_rank_one_sleeps" in text  # the stack dump names where it hung
    assert "rank 0" not in text
