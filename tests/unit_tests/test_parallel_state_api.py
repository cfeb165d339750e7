"""Megatron Core 0.16's ``parallel_state`` API, called the way upstream callers call it.

Expected rank sets are written from the grid arithmetic (rank = tp + TP * next dim + ...),
independently of the code under test.
"""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.parallel_state import RankGenerator, generate_masked_orthogonal_rank_groups
from megatron.core.rank_grid import hierarchical_rank_groups
from tests.dist_harness import run_distributed


def test_rank_generator_accepts_orders_without_size_one_dimensions():
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-pp-dp")
    assert gen.order == "tp-pp-dp-ep-cp" and gen.ordered_size == [2, 2, 2, 1, 1] and gen.world_size == 8
    assert gen.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert gen.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert gen.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert gen.get_ranks("tp-dp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert gen.get_mask(gen.order, "tp-dp") == [True, False, True, False, False]
    expert = RankGenerator(tp=1, ep=2, dp=2, pp=1, cp=1, order="tp-ep-dp-pp", rank_offset=4)
    assert expert.get_ranks("ep") == [[4, 5], [6, 7]] and expert.get_ranks("dp") == [[4, 6], [5, 7]]


def test_rank_generator_refuses_what_megatron_refuses():
    with pytest.raises(RuntimeError):
        RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp")  # pp=2 left out
    with pytest.raises(AssertionError):
        RankGenerator(tp=1, ep=2, dp=1, pp=1, cp=2, order="tp-cp-ep-dp-pp")


def test_masked_orthogonal_groups_of_a_three_dimensional_grid():
    groups = generate_masked_orthogonal_rank_groups(24, [2, 3, 4], [False, True, False])
    assert len(groups) == 8
    assert groups[0] == [0, 2, 4] and groups[1] == [1, 3, 5] and groups[-1] == [19, 21, 23]


def test_hierarchical_groups_and_nccl_config_helpers():
    levels = hierarchical_rank_groups(list(range(16)), [2, 2, 4])
    assert levels[0][:2] == [[0, 1], [2, 3]] and len(levels[0]) == 8
    assert levels[1][:2] == [[0, 2], [1, 3]] and levels[1][2] == [4, 6]
    assert levels[2] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    cfgs = {}
    ps.overwrite_nccl_comm_cfgs(cfgs, "dp", ("is_high_priority_stream", True))
    assert cfgs == {"dp": {"is_high_priority_stream": True}}
    assert ps.get_nccl_options("tp", cfgs) is None


def test_global_memory_buffer_reuses_storage_by_name():
    buffer = ps.get_global_memory_buffer()
    first = buffer.get_tensor((2, 3), torch.float32, "mpu")
    again = buffer.get_tensor([4], torch.float32, "mpu")
    assert first.shape == (2, 3) and again.data_ptr() == first.data_ptr()
    assert buffer.get_tensor((2,), torch.float32, "other").data_ptr() != first.data_ptr()
    assert buffer.get_tensor((10,), torch.float32, "mpu").numel() == 10  # grows
    ps.destroy_model_parallel()
    assert ps.get_global_memory_buffer() is not buffer


def test_setters_override_getters_without_groups():
    try:
        ps.set_tensor_model_parallel_world_size(2)
        ps.set_tensor_model_parallel_rank(1)
        ps.set_pipeline_model_parallel_world_size(4)
        ps.set_pipeline_model_parallel_rank(3)
        ps.set_expert_model_parallel_world_size(2)
        ps.set_expert_model_parallel_rank(0)
        ps.set_virtual_pipeline_model_parallel_world_size(2)
        ps.set_virtual_pipeline_model_parallel_rank(1)
        assert ps.get_tensor_model_parallel_world_size() == 2 and ps.get_tensor_model_parallel_rank() == 1
        assert ps.get_pipeline_model_parallel_world_size() == 4 and ps.get_pipeline_model_parallel_rank() == 3
        assert ps.get_expert_model_parallel_world_size() == 2 and ps.get_expert_model_parallel_rank() == 0
        # Without expert groups, the expert-TP getters fall back to the TP overrides.
        assert ps.get_expert_tensor_parallel_world_size() == 2 and ps.get_expert_tensor_parallel_rank() == 1
        ps.set_expert_tensor_parallel_world_size(1)
        assert ps.get_expert_tensor_parallel_world_size() == 1
        assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
        assert ps.is_pipeline_last_stage() and not ps.is_pipeline_first_stage()
        assert ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1)
        assert not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=0)
        assert not ps.model_parallel_is_initialized() and not ps.is_initialized()
    finally:
        ps.destroy_model_parallel()
    with pytest.raises(AssertionError, match="not initialized"):
        ps.get_tensor_model_parallel_world_size()
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None


def test_getters_before_initialization():
    for getter in (
        ps.get_tensor_model_parallel_group,
        ps.get_pipeline_model_parallel_group,
        ps.get_model_parallel_group,
        ps.get_context_parallel_group,
        ps.get_embedding_group,
        ps.get_expert_model_parallel_group,
        ps.get_expert_data_parallel_group,
        ps.get_intra_distributed_optimizer_instance_group,
    ):
        assert getter(check_initialized=False) is None, getter.__name__
        with pytest.raises(AssertionError):
            getter()
    assert ps.get_data_parallel_world_size() == 0 and ps.get_data_parallel_rank() == 0  # no torch.distributed
    assert not ps.is_rank_in_embedding_group()


def test_initialize_before_torch_distributed_asserts():
    assert not dist.is_initialized()
    with pytest.raises(AssertionError):
        ps.initialize_model_parallel(tensor_model_parallel_size=1)


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError):
        ps.initialize_model_parallel(tensor_model_parallel_sise=2)


def _group_ranks(group):
    return dist.get_process_group_ranks(group)


def _tp_pp_dp_order(rank):
    """TP=2, PP=2, order tp-pp-dp: rank = tp + 2 * pp + 4 * dp."""
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp-pp-dp")
    tp, pp, dp = rank % 2, rank // 2 % 2, rank // 4
    assert (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()) == (tp, pp)
    assert ps.get_data_parallel_rank() == dp and ps.get_data_parallel_world_size() == 2
    assert _group_ranks(ps.get_data_parallel_group()) == [rank % 4, rank % 4 + 4]
    assert _group_ranks(ps.get_data_parallel_group_gloo()) == [rank % 4, rank % 4 + 4]
    assert _group_ranks(ps.get_pipeline_model_parallel_group()) == [tp + 4 * dp, tp + 2 + 4 * dp]
    assert _group_ranks(ps.get_model_parallel_group()) == [4 * dp + i for i in range(4)]
    assert _group_ranks(ps.get_tensor_and_data_parallel_group()) == [
        tp2 + 2 * pp + 4 * d for d in (0, 1) for tp2 in (0, 1)
    ]
    assert ps.is_pipeline_first_stage() == (pp == 0) and ps.is_pipeline_last_stage() == (pp == 1)
    assert ps.get_pipeline_model_parallel_next_rank() == tp + 2 * (1 - pp) + 4 * dp
    assert ps.get_tensor_model_parallel_src_rank() == rank - tp
    assert ps.get_model_parallel_src_rank() == 4 * dp
    assert ps.is_rank_in_embedding_group() and ps.is_rank_in_position_embedding_group() == (pp == 0)
    assert ps.get_all_ranks() == f"{tp}_{dp}_0_{pp}_0"
    # A setter overrides the group's answer until reset.
    ps.set_tensor_model_parallel_rank(0)
    assert ps.get_tensor_model_parallel_rank() == 0
    ps.set_tensor_model_parallel_rank(None)
    assert ps.get_tensor_model_parallel_rank() == tp
    with pytest.raises(AssertionError):
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
    ps.destroy_model_parallel()
    with pytest.raises(RuntimeError):  # expert parallelism left out of the order
        ps.initialize_model_parallel(expert_model_parallel_size=2, order="tp-pp-dp")
    with pytest.raises(RuntimeError):  # world of 8 not divisible by 3
        ps.initialize_model_parallel(tensor_model_parallel_size=3)


def _expert_order(rank):
    """TP=2, EP=2, order tp-ep-dp-pp: expert grid rank = etp + 2 * ep + 4 * edp; dense dp = rank // 2."""
    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2, order="tp-ep-dp-pp")
    tp, ep, edp = rank % 2, rank // 2 % 2, rank // 4
    assert _group_ranks(ps.get_expert_model_parallel_group()) == [tp + 2 * e + 4 * edp for e in (0, 1)]
    assert _group_ranks(ps.get_expert_data_parallel_group()) == [tp + 2 * ep + 4 * d for d in (0, 1)]
    assert _group_ranks(ps.get_expert_tensor_and_model_parallel_group()) == [4 * edp + i for i in range(4)]
    assert _group_ranks(ps.get_data_parallel_group()) == [tp + 2 * d for d in range(4)]
    assert (ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()) == (ep, tp)
    assert ps.get_expert_tensor_and_model_parallel_world_size() == 4 and ps.get_expert_data_parallel_world_size() == 2
    ps.destroy_model_parallel()


def _distributed_optimizer_instances(rank):
    """TP=2, DP=4 split into 2 optimizer instances: intra halves, inter pairs across instances."""
    ps.initialize_model_parallel(tensor_model_parallel_size=2, num_distributed_optimizer_instances=2)
    tp, dp = rank % 2, rank // 2
    half = dp // 2
    intra = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
    assert _group_ranks(intra) == [tp + 2 * d for d in (2 * half, 2 * half + 1)]
    assert ps.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True) == 2
    with pytest.raises(AssertionError):  # partial DP is a part of DP x CP
        ps.get_data_parallel_group(partial_data_parallel=True)
    assert _group_ranks(ps.get_data_parallel_group(with_context_parallel=True)) == [tp + 2 * d for d in range(4)]
    assert _group_ranks(ps.get_inter_distributed_optimizer_instance_group()) == [rank % 4, rank % 4 + 4]
    assert _group_ranks(ps.get_intra_distributed_optimizer_instance_group()) == [4 * half + i for i in range(4)]
    assert _group_ranks(ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)) == _group_ranks(intra)
    ps.destroy_model_parallel()
    with pytest.raises(AssertionError):  # DP 4 cannot be split into 3 instances
        ps.initialize_model_parallel(tensor_model_parallel_size=2, num_distributed_optimizer_instances=3)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    assert ps.get_inter_distributed_optimizer_instance_group(check_initialized=False) is None
    assert _group_ranks(ps.get_intra_distributed_optimizer_instance_group()) == list(range(8))


def _group_helpers_and_embedding_choice(rank):
    """Custom embedding ranks, create_group / create_hierarchical_groups, update_pg_timeout."""
    ps.initialize_model_parallel(
        pipeline_model_parallel_size=4,
        get_embedding_ranks=lambda pp_ranks: [pp_ranks[-1]],
        get_position_embedding_ranks=lambda pp_ranks: pp_ranks[1:3],
    )
    stage = rank // 2  # PP=4 over 8 ranks: dp=2 is the fastest dimension
    assert ps.is_rank_in_embedding_group() == (stage == 3)
    assert ps.is_rank_in_position_embedding_group() == (stage in (1, 2))
    if stage in (1, 2):
        assert _group_ranks(ps.get_position_embedding_group()) == [rank % 2 + 2, rank % 2 + 4]
    halves = ps.create_group([0, 1, 2, 3]), ps.create_group([4, 5, 6, 7])
    assert _group_ranks(halves[rank // 4]) == [4 * (rank // 4) + i for i in range(4)]
    groups, gloo = ps.create_hierarchical_groups(rank, list(range(8)), [2, 4], create_gloo_process_groups=True)
    assert _group_ranks(groups[0]) == [rank - rank % 2, rank - rank % 2 + 1]
    assert _group_ranks(groups[1]) == [rank % 2 + 2 * i for i in range(4)] == _group_ranks(gloo[1])
    ps.update_pg_timeout(timedelta(minutes=3))
    ps.update_pg_timeout(timedelta(minutes=4), pg=ps.get_data_parallel_group())


def _upstream_calls_on_eight_ranks(rank, world_size):
    checks = (_tp_pp_dp_order, _expert_order, _distributed_optimizer_instances)
    for check in checks + (_group_helpers_and_embedding_choice,):
        check(rank)
        ps.destroy_model_parallel()


def test_upstream_calls_on_eight_ranks():
    run_distributed(_upstream_calls_on_eight_ranks, 8)
