"""Gloo copies of process groups: only of the data-parallel groups, and none with ``--disable-gloo-process-groups``.

Over NCCL (``dist.get_backend`` reports nccl here; the groups themselves are gloo) every gloo group
creation is counted: the default builds exactly one per distinct rank list of the five groups
Megatron hands out gloo copies of (the rank lists gathered from every rank), ``get_*_group_gloo``
return groups over the right ranks, and ``--disable-gloo-process-groups`` through
``initialize_distributed`` builds none. On a gloo backend the groups are their own copies.
"""

import argparse

import pytest
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core import process_groups
from megatron.training.arguments import parse_args
from megatron.training.initialize import initialize_distributed
from tests.dist_harness import run_distributed

NAMES = ("dp", "dp_cp", "expt_dp", "intra_dp_cp", "intra_expt_dp")


def _count_gloo_creations(monkeypatch_log):
    real = process_groups.create_group

    def counted(ranks, *args, backend=None, **kwargs):
        if backend == "gloo":
            monkeypatch_log.append(tuple(ranks))
        return real(ranks, *args, backend=backend, **kwargs)

    process_groups.create_group = counted
    return lambda: setattr(process_groups, "create_group", real)


def _args(disable: bool) -> argparse.Namespace:
    flags = [
        "--num-layers",
        "1",
        "--hidden-size",
        "8",
        "--num-attention-heads",
        "2",
        "--tensor-model-parallel-size",
        "2",
    ]
    return parse_args(flags + (["--disable-gloo-process-groups"] if disable else []))


def _body(rank: int, world_size: int):
    created = {}
    real_backend = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"
    try:
        for disable in (False, True):
            log = []
            restore = _count_gloo_creations(log)
            try:
                groups = initialize_distributed(_args(disable))
            finally:
                restore()
            created[disable] = log
            if not disable:
                dp_gloo = ps.get_data_parallel_group_gloo()
                assert dist.get_process_group_ranks(dp_gloo) == groups.ranks["dp"]
                expert_gloo = ps.get_expert_data_parallel_group_gloo()
                assert dist.get_process_group_ranks(expert_gloo) == groups.ranks["expt_dp"]
                everyone = [None] * world_size
                dist.all_gather_object(everyone, [tuple(groups.ranks[n]) for n in NAMES])
                expected = {ranks for lists in everyone for ranks in lists}
            else:
                with pytest.raises(AssertionError, match="gloo process groups were not created"):
                    ps.get_data_parallel_group_gloo()
            ps.destroy_model_parallel()
    finally:
        dist.get_backend = real_backend
    groups = ps.initialize_model_parallel()  # the real backend, gloo: the groups are their own copies
    assert ps.get_data_parallel_group_gloo() is groups.dp
    return created, expected


def test_gloo_copies_only_of_data_parallel_groups_and_none_when_disabled():
    for created, expected in run_distributed(_body, 2):
        assert sorted(created[False]) == sorted(expected), (created[False], expected)
        assert created[True] == []
