"""Data parallelism (with TP, overlap, buckets, the distributed optimizer) equals one rank.

Each spawned group trains a tiny GPT-2-style model for 5 iterations of 2 microbatches per
rank, and compares with a single-process reference (torch.optim.AdamW / SGD and
clip_grad_norm_ on the whole global batch, same initial weights) built on every rank.
Tolerance (fp32): losses and grad norms rtol 1e-6; every weight tensor within 1e-6 in
relative L2 norm (TP shards gathered). Only the order of float additions differs.
"""

import pytest

from megatron.core import parallel_state as ps
from tests.dist_harness import run_distributed
from tests.model_utils import gpt2_style
from tests.unit_tests.distributed.dp_training import (
    MICRO_BATCH,
    NUM_MICRO,
    assert_matches,
    parallel_run,
    reference_run,
)

RTOL = 1e-6
DIST = dict(use_distributed_optimizer=True)
OVERLAP = dict(overlap_grad_reduce=True, bucket_size=3000)  # several buckets in the tiny model

VARIANTS = {
    "plain": ({}, {}),
    "overlap": (OVERLAP, {}),
    "fp32_accum": (dict(grad_reduce_in_fp32=True, average_in_collective=True), {}),
    "distopt": (DIST, DIST),
    "distopt_overlap": (dict(DIST, **OVERLAP), dict(DIST, overlap_param_gather=True)),
    "sgd": ({}, dict(optimizer="sgd")),
    "sgd_distopt": (DIST, dict(DIST, optimizer="sgd")),
}


def _train_and_compare(rank, world_size, tp, names):
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    global_batch = MICRO_BATCH * NUM_MICRO * groups.size_of("dp")
    refs = {opt: reference_run(gpt2_style(), global_batch, optimizer=opt) for opt in ("adam", "sgd")}
    for name in names:
        ddp_kw, opt_kw = VARIANTS[name]
        got = parallel_run(groups, gpt2_style(), ddp_kw, opt_kw)
        assert_matches(f"tp={tp} world={world_size} {name}", got, refs[opt_kw.get("optimizer", "adam")], RTOL)
    got = parallel_run(groups, gpt2_style(), {}, {}, per_token=True)
    assert_matches(f"tp={tp} world={world_size} per-token loss", got, refs["adam"], RTOL)


@pytest.mark.parametrize("world_size,tp", [(2, 1), (4, 1), (4, 2)])
def test_dp_training_equals_single_rank(world_size, tp):
    run_distributed(_train_and_compare, world_size, tp, list(VARIANTS))
