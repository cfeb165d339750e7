"""pretrain_gpt.py under Megatron-FSDP's sharding strategies equals DDP + the distributed optimizer.

Each case trains the tiny GPT on mock data once with ``--use-distributed-optimizer`` (the reference)
and once per strategy with ``--use-megatron-fsdp --data-parallel-sharding-strategy S``, same layout.
The arithmetic is the same (the strategies only change what is kept and when parameters are
gathered), so the printed losses and grad norms and TensorBoard's float32 losses must be equal.
``optim_grads_params`` lays its buckets out per layer: the grad norm's partial sums group differently
(equal to rounding), so its cases run without clipping, where the norm changes nothing.

Default tier: TP=2 x DP=2 with sequence parallelism in bf16 under ``optim_grads_params`` (gathered
layer by layer). Full tier: DP=4 with every strategy, and EP=2 (MoE, experts sharded over expert-DP).
"""

from __future__ import annotations

from typing import Dict, List

import pytest

from tests.functional_tests.gpt_runs import (
    assert_ok,
    check_resume,
    mock_flags,
    run_gpt,
    tb_losses,
    tiny_gpt_flags,
    with_flags,
)

ITERS = 4
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]
# name -> (extra flags, strategies)
CASES: Dict[str, tuple] = {
    "tp2dp2": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16"], ["optim_grads_params"]),
    "dp4": ([], ["optim", "optim_grads", "optim_grads_params"]),
    "ep2": (MOE + ["--bf16"], ["optim_grads", "optim_grads_params"]),
}


def _run(flags: List[str], work) -> tuple:
    work.mkdir()
    tb = str(work / "tb")
    result = run_gpt(4, flags + ["--tensorboard-dir", tb], str(work))
    assert_ok(result, " ".join(flags[-6:]))
    return result, tb_losses(tb)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharding_strategies_equal_the_distributed_optimizer(case, tmp_path):
    extra, strategies = CASES[case]
    base = tiny_gpt_flags(ITERS) + mock_flags() + extra + ["--use-distributed-optimizer", "--overlap-grad-reduce"]
    references = {}
    for strategy in strategies:
        clip = "0.0" if strategy == "optim_grads_params" else "1.0"
        flags = with_flags(base, {"--clip-grad": clip})
        if clip not in references:
            references[clip] = _run(flags, tmp_path / f"reference-clip{clip}")
        ref, ref_tb = references[clip]
        got, got_tb = _run(
            flags + ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy], tmp_path / strategy
        )
        assert len(got.lines) == ITERS, got.output[-3000:]
        assert got.losses() == ref.losses(), (case, strategy)
        assert [x["grad norm"] for x in got.lines] == [x["grad norm"] for x in ref.lines], (case, strategy)
        assert got_tb == ref_tb, (case, strategy)  # float32 scalars, exactly


FSDP_PARAMS = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
# name -> ((ranks, flags) saving after 2 iterations, (ranks, flags) loading and running 2 more)
RESUMES = {
    "fsdp-dp2-to-fsdp-dp2": ((2, FSDP_PARAMS), (2, FSDP_PARAMS)),
    "fsdp-dp4-to-distopt-dp2": ((4, FSDP_PARAMS), (2, [])),
    "distopt-dp2-to-fsdp-dp4": ((2, []), (4, FSDP_PARAMS)),
}


@pytest.mark.parametrize("case", sorted(RESUMES))
def test_checkpoints_move_between_fsdp_and_the_distributed_optimizer(case, tmp_path):
    """torch_dist saved after 2 of 4 iterations, loaded (optimizer state included) and trained on: the
    losses are the uninterrupted run's under the loading layout (bitwise at the same layout; to the
    printed digits but for last-digit float noise when the DP size changes, as any layout change)."""
    base = tiny_gpt_flags(ITERS) + mock_flags() + ["--use-distributed-optimizer", "--clip-grad", "0.0"]
    check_resume(case, base, *RESUMES[case], str(tmp_path))
