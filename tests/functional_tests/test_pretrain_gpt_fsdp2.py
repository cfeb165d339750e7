"""pretrain_gpt.py under ``--use-torch-fsdp2`` equals DDP + the distributed optimizer; checkpoints move.

Each case trains the tiny untied GPT on mock data with ``--use-distributed-optimizer`` (the reference)
and with ``--use-torch-fsdp2``, same layout, fp32, clipping off (FSDP2's shards regroup the grad norm's
partial sums: equal to rounding, so clipping by it would differ in the last bit). The arithmetic of
the losses is the same, so the printed losses and grad norms and TensorBoard's float32 losses must
be equal.

Default tier: TP=2 x DP=2 with sequence parallelism, and a torch_dist checkpoint saved under FSDP2 at
DP=2 resumed under the distributed optimizer at DP=1. Full tier: DP=4 and EP=2 (experts sharded over
expert-DP), and resumes DP=2 distributed optimizer -> DP=4 FSDP2 and DP=4 FSDP2 -> DP=2 distributed
optimizer.
"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from tests.functional_tests.gpt_runs import assert_ok, mock_flags, run_gpt, tiny_gpt_flags
from tests.functional_tests.test_pretrain_gpt import _tb_losses

ITERS = 4
FSDP2 = ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]
DIST_OPT = ["--use-distributed-optimizer"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]
CASES: Dict[str, List[str]] = {
    "tp2dp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "dp4": [],
    "ep2": MOE,
}


def _base(iters: int = ITERS) -> List[str]:
    return tiny_gpt_flags(iters) + mock_flags() + ["--untie-embeddings-and-output-weights", "--clip-grad", "0.0"]


def _run(ranks: int, flags: List[str], work) -> tuple:
    work.mkdir()
    tb = str(work / "tb")
    result = run_gpt(ranks, flags + ["--tensorboard-dir", tb], str(work))
    assert_ok(result, " ".join(flags[-6:]))
    return result, _tb_losses(tb)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fsdp2_equals_the_distributed_optimizer(case, tmp_path):
    ref, ref_tb = _run(4, _base() + CASES[case] + DIST_OPT, tmp_path / "distopt")
    got, got_tb = _run(4, _base() + CASES[case] + FSDP2, tmp_path / "fsdp2")
    assert len(got.lines) == ITERS, got.output[-3000:]
    assert got.losses() == ref.losses(), case
    assert [x["grad norm"] for x in got.lines] == [x["grad norm"] for x in ref.lines], case
    assert got_tb == ref_tb, case  # float32 scalars, exactly


# name -> ((ranks, flags) saving after 2 iterations, (ranks, flags) loading and running 2 more)
RESUMES = {
    "fsdp2-dp2-to-distopt-dp1": ((2, FSDP2), (1, DIST_OPT)),
    "distopt-dp2-to-fsdp2-dp4": ((2, DIST_OPT), (4, FSDP2)),
    "fsdp2-dp4-to-distopt-dp2": ((4, FSDP2), (2, DIST_OPT)),
}


@pytest.mark.parametrize("case", sorted(RESUMES))
def test_checkpoints_move_between_fsdp2_and_the_distributed_optimizer(case, tmp_path):
    """torch_dist saved after 2 of 4 iterations, loaded (optimizer state included) at another DP size and
    trained on: the losses are the uninterrupted run's under the loading layout, to rtol 1e-6 (a change of
    DP size regroups the sums: the last printed digit may differ; a missing optimizer state moves the
    resumed losses by far more)."""
    (save_ranks, save_flags), (load_ranks, load_flags) = RESUMES[case]
    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    straight = run_gpt(load_ranks, _base() + load_flags, str(tmp_path))
    assert_ok(straight, f"{case}: uninterrupted")
    save = ["--save", ckpt, "--save-interval", "2", "--exit-interval", "2", "--tensorboard-dir", tb]
    first = run_gpt(save_ranks, _base() + save_flags + save, str(tmp_path))
    assert_ok(first, f"{case}: first half")
    second = run_gpt(load_ranks, _base() + load_flags + ["--load", ckpt], str(tmp_path))
    assert_ok(second, f"{case}: resumed")
    assert [line["iteration"] for line in second.lines] == [3, 4]
    got, want = torch.tensor(first.losses() + second.losses()), torch.tensor(straight.losses())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=case)
    assert second.lines[-1]["grad norm"] == straight.lines[-1]["grad norm"], case
