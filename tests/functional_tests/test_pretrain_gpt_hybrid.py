"""pretrain_gpt.py with hybrid sharding (``--num-distributed-optimizer-instances 2`` at DP=4).

Equality: the tiny GPT on mock data under DDP + the distributed optimizer sharded over all four ranks
(the reference), then with two instances of two ranks, under the distributed optimizer and under
Megatron-FSDP's ``optim_grads_params``. The gradient of each element is summed as (a + b) + (c + d)
(reduce-scatter within an instance, all-reduce across) instead of the reference's order, so losses and
grad norms agree to rounding: rtol 1e-5 on the printed values (TensorBoard's float32 losses too).
Clipping is off: ``optim_grads_params``' norm groups by per-layer shards (rounding only, as without
instances).

The same with expert parallelism (EP=2: expert buffers split expert-DP 2 into instances of one rank).

Checkpoints (torch_dist, and the legacy torch format one way; optimizer state included): saved after 2
of 4 iterations with two instances and loaded by the plain distributed optimizer at DP=2, and the
reverse; the resumed losses are the uninterrupted run's under the loading layout, to the printed
digits but for last-digit float noise (as any change of DP size); saved and loaded with two instances,
TensorBoard's float32 losses equal the uninterrupted run's bitwise.

All full tier (``FULL_ONLY``): ``tests/unit_tests/distributed/test_hybrid_sharding.py`` is the default-tier sibling
(the same reduction at DP=4 in one spawn, the state split, the reduction order, the replica ids a
checkpoint is written with).
"""

from __future__ import annotations

from typing import List

import pytest
import torch

from tests.functional_tests.gpt_runs import assert_ok, check_resume, mock_flags, run_gpt, tb_losses, tiny_gpt_flags

ITERS, RTOL = 4, 1e-5
BASE = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--clip-grad", "0.0"]
HYBRID = ["--num-distributed-optimizer-instances", "2"]
FSDP_PARAMS = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
LEGACY = ["--ckpt-format", "torch"]


def _close(got: List[float], ref: List[float], what: str) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=RTOL, atol=0, msg=lambda m: f"{what}: {m}")


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]
# name -> (layout flags, the runs compared with the reference)
CASES = {
    "dp4": ([], {"hybrid": HYBRID, "fsdp-hybrid": HYBRID + FSDP_PARAMS}),
    "ep2": (MOE, {"hybrid": HYBRID}),  # experts: expert-DP 2 split into 2 instances of 1 rank
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_instances_equal_the_distributed_optimizer(case, tmp_path):
    layout, compared = CASES[case]
    runs = {}
    for name, extra in [("reference", [])] + list(compared.items()):
        tb = str(tmp_path / name / "tb")
        (tmp_path / name).mkdir()
        flags = tiny_gpt_flags(ITERS) + mock_flags() + BASE + layout + extra + ["--tensorboard-dir", tb]
        result = run_gpt(4, flags, str(tmp_path))
        assert_ok(result, name)
        assert len(result.lines) == ITERS, result.output[-3000:]
        runs[name] = (result, tb_losses(tb))
    ref, ref_tb = runs.pop("reference")
    for name, (got, got_tb) in runs.items():
        _close(got.losses(), ref.losses(), f"{name} losses")
        _close([x["grad norm"] for x in got.lines], [x["grad norm"] for x in ref.lines], f"{name} grad norms")
        assert sorted(got_tb) == sorted(ref_tb) == list(range(1, ITERS + 1)), name
        _close([got_tb[i] for i in sorted(got_tb)], [ref_tb[i] for i in sorted(ref_tb)], f"{name} TensorBoard losses")


# name -> ((ranks, flags) saving after 2 iterations, (ranks, flags) loading and running 2 more)
RESUMES = {
    "hybrid-dp4-to-hybrid-dp4": ((4, HYBRID), (4, HYBRID)),
    "hybrid-dp4-to-distopt-dp2": ((4, HYBRID), (2, [])),
    "distopt-dp2-to-hybrid-dp4": ((2, []), (4, HYBRID)),
    # The legacy per-rank files: DP rank 0 writes the state gathered within its instance.
    "legacy-hybrid-dp4-to-distopt-dp2": ((4, HYBRID + LEGACY), (2, LEGACY)),
}


@pytest.mark.parametrize("case", sorted(RESUMES))
def test_checkpoints_move_between_instance_counts(case, tmp_path):
    base = tiny_gpt_flags(ITERS) + mock_flags() + BASE
    check_resume(case, base, *RESUMES[case], str(tmp_path))
