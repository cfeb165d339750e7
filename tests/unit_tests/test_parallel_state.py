"""Rank grid arithmetic (pure) and the process groups built from it (gloo ranks)."""

import pytest
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.rank_grid import RankGrid
from tests.dist_harness import run_distributed


def _grid(tp=1, cp=1, ep=1, dp=1, pp=1, order="tp-cp-ep-dp-pp"):
    return RankGrid({"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}, order)


def test_tp_ranks_adjacent_pp_slowest():
    grid = _grid(tp=2, dp=2, pp=2)
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.groups("tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_every_rank_in_exactly_one_group_of_each_kind():
    grid = _grid(tp=2, cp=2, dp=2, pp=2)
    for token in ("tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-cp-ep-dp-pp"):
        flat = sorted(r for g in grid.groups(token) for r in g)
        assert flat == list(range(16)), token


def test_coordinates_follow_order():
    grid = _grid(tp=2, cp=2, dp=2, pp=2)
    # rank = tp + 2*cp + 4*dp + 8*pp
    assert [grid.coordinate(13, d) for d in ("tp", "cp", "dp", "pp")] == [1, 0, 1, 1]


def test_custom_order_moves_dp_fastest():
    grid = _grid(tp=2, dp=2, order="dp-tp-cp-ep-pp")
    assert grid.groups("dp") == [[0, 1], [2, 3]]
    assert grid.groups("tp") == [[0, 2], [1, 3]]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(world_size=6, tensor_model_parallel_size=4), ["world size 6", "tensor_model_parallel_size (4)"]),
        (dict(world_size=8, pipeline_model_parallel_size=3), ["pipeline_model_parallel_size (3)"]),
        (dict(world_size=4, expert_model_parallel_size=3), ["expert_model_parallel_size (3)"]),
        (dict(world_size=4, tensor_model_parallel_size=0), ["tensor_model_parallel_size=0"]),
        (dict(world_size=4, virtual_pipeline_model_parallel_size=2), ["virtual_pipeline_model_parallel_size=2"]),
    ],
)
def test_impossible_layouts_name_the_setting(kwargs, words):
    with pytest.raises(ValueError) as info:
        ps.ParallelLayout(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_bad_order_is_rejected():
    # Leaving out a dimension is allowed only when its size is 1 (Megatron's rule).
    with pytest.raises(ValueError, match="order"):
        _grid(cp=2, order="tp-dp-pp")
    with pytest.raises(ValueError, match="order"):
        _grid(order="tp-dp-pp-xx")
    assert _grid(tp=2, dp=2, order="tp-dp-pp").groups("dp") == [[0, 2], [1, 3]]


def _check_groups_on_eight_ranks(rank, world_size):
    pgs = ps.initialize_model_parallel(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2
    )
    out = {}
    # facade and explicit object agree, and the groups really communicate over those ranks
    for name in ("tp", "pp", "dp", "mp", "embd", "ep", "expt_dp"):
        group = getattr(pgs, name)
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, rank, group=group)
        out[name] = gathered
        assert gathered == pgs.ranks[name]
    out["tp_rank"] = ps.get_tensor_model_parallel_rank()
    out["pp_rank"] = ps.get_pipeline_model_parallel_rank()
    out["dp_size"] = ps.get_data_parallel_world_size()
    out["first"] = ps.is_pipeline_first_stage()
    out["last"] = ps.is_pipeline_last_stage()
    out["next"] = ps.get_pipeline_model_parallel_next_rank()
    with pytest.raises(RuntimeError, match="already initialized"):
        ps.initialize_model_parallel(2, 2)
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        ps.get_tensor_model_parallel_group()
    with pytest.raises(ValueError, match="not divisible"):
        ps.initialize_model_parallel(tensor_model_parallel_size=3)
    return out


def test_groups_on_eight_ranks():
    res = run_distributed(_check_groups_on_eight_ranks, 8)
    grid = _grid(tp=2, dp=2, pp=2)
    for rank, out in enumerate(res):
        for token, name in (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("tp-pp", "mp")):
            expected = next(g for g in grid.groups(token) if rank in g)
            assert out[name] == expected, (rank, name)
        pp_group = next(g for g in grid.groups("pp") if rank in g)
        assert out["embd"] == [pp_group[0], pp_group[-1]]
        assert out["tp_rank"] == rank % 2 and out["pp_rank"] == rank // 4 and out["dp_size"] == 2
        assert out["first"] == (rank < 4) and out["last"] == (rank >= 4)
        assert out["next"] == (rank + 4) % 8
        # expert grid: etp=2 (defaults to tp), ep=2, edp=1, pp=2
        assert out["ep"] == [r for r in range(8) if r // 4 == rank // 4 and r % 2 == rank % 2]
        assert out["expt_dp"] == [rank]


def test_tp_group_without_check_is_none_before_initialization():
    assert not ps.model_parallel_is_initialized()
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    with pytest.raises(RuntimeError, match="not initialized"):
        ps.get_tensor_model_parallel_group()


# ----------------------------------------------------------------------------------
# The expert grid with expert-TP != TP, against megatron-core 0.16.1's rank generators.
# ----------------------------------------------------------------------------------
ORACLE_CASES = [
    dict(world=4, tp=2, cp=1, pp=1, ep=2, etp=1, order="tp-cp-ep-dp-pp"),
    dict(world=8, tp=2, cp=1, pp=2, ep=2, etp=1, order="tp-cp-ep-dp-pp"),
    dict(world=8, tp=1, cp=1, pp=2, ep=2, etp=2, order="tp-cp-ep-dp-pp"),
    dict(world=16, tp=2, cp=2, pp=2, ep=4, etp=1, order="tp-cp-ep-dp-pp"),
    dict(world=16, tp=4, cp=1, pp=1, ep=2, etp=2, order="tp-cp-ep-pp-dp"),
]


def _layout(case) -> ps.ParallelLayout:
    return ps.ParallelLayout(
        world_size=case["world"],
        tensor_model_parallel_size=case["tp"],
        context_parallel_size=case["cp"],
        pipeline_model_parallel_size=case["pp"],
        expert_model_parallel_size=case["ep"],
        expert_tensor_parallel_size=case["etp"],
        order=case["order"],
    )


def test_expert_grid_with_expert_tp_equals_megatron_core(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from tests.unit_tests.datasets.masked_oracle import REPO, oracle_dir

    env = dict(os.environ, PYTHONPATH=oracle_dir())
    cases_path = tmp_path / "cases.json"
    cases_path.write_text(json.dumps(ORACLE_CASES))
    script = os.path.join(REPO, "tests", "oracles", "mcore_rank_groups.py")
    proc = subprocess.run(
        [sys.executable, script, str(cases_path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case, theirs in zip(ORACLE_CASES, json.loads(proc.stdout.splitlines()[-1])):
        layout = _layout(case)
        for key, ranks in theirs.items():
            kind, token = key.split(":")
            grid = layout.expert_grid() if kind == "expert" else layout.dense_grid()
            assert grid.groups(token) == ranks, (case, key)
        # The collection's expert groups are those grids' groups (names of process_groups._EXPERT_GROUPS).
        assert layout.expert_data_parallel_size == case["world"] // (case["etp"] * case["ep"] * case["pp"])


def _os_threads() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


def _check_group_if_none_helper(rank):
    """megatron.core.utils.get_tensor_model_parallel_group_if_none: pass-through, then the defaults."""
    import warnings

    from megatron.core.utils import get_tensor_model_parallel_group_if_none as if_none

    assert if_none(None) is None and if_none(dist.group.WORLD) is dist.group.WORLD  # no default groups yet
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert if_none(None) is groups.tp and if_none(None, is_expert=True) is groups.expt_tp
    assert [w.category for w in caught] == [DeprecationWarning] * 2 * (rank == 0)
    assert if_none(groups.dp) is groups.dp
    ps.destroy_model_parallel()


def _check_hierarchical_cp_getter(rank):
    """hierarchical_context_parallel_sizes [1, 2]: the getter returns this rank's group per level (levels
    as rank_grid.hierarchical_rank_groups), raises without them, and destroy_model_parallel frees them."""
    assert ps.get_hierarchical_context_parallel_groups(check_initialized=False) is None
    ps.initialize_model_parallel(context_parallel_size=2)
    with pytest.raises(RuntimeError, match="hierarchical_context_parallel_sizes"):
        ps.get_hierarchical_context_parallel_groups()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=2, hierarchical_context_parallel_sizes=[1, 2])
    levels = ps.get_hierarchical_context_parallel_groups()
    assert [dist.get_process_group_ranks(g) for g in levels] == [[rank], [0, 1]]
    ps.destroy_model_parallel()
    assert not any(g in dist.distributed_c10d._world.pg_map for g in levels)


def _init_destroy_cycles(rank, world_size, cycles):
    import threading

    _check_group_if_none_helper(rank)
    _check_hierarchical_cp_getter(rank)
    counts = []
    for cycle in range(cycles):
        groups = ps.initialize_model_parallel(tensor_model_parallel_size=1 + cycle % 2)
        ps.destroy_model_parallel()
        # The collection's own groups are gone from torch's registry, not just forgotten by us.
        assert groups.tp not in dist.distributed_c10d._world.pg_map
        if cycle in (10, cycles - 1):  # after a warm-up, and at the end
            counts.append((_os_threads(), threading.active_count()))
    return counts


def test_destroy_model_parallel_frees_the_groups_it_built():
    """60 init/destroy cycles keep a rank's thread count flat (each leaked gloo group holds threads: a
    leak of one group per cycle would add about 50 between cycle 10 and the last; the bound is 2)."""
    for (os_warm, py_warm), (os_end, py_end) in run_distributed(_init_destroy_cycles, 2, 60):
        assert os_end <= os_warm + 2 and py_end <= py_warm + 1, (os_warm, os_end, py_warm, py_end)
