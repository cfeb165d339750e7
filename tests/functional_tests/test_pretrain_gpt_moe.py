"""pretrain_gpt.py with mixture-of-experts flags end to end: TP=2 (with sequence parallelism)
prints the TP=1 ``lm loss`` and ``load_balancing_loss`` of every iteration (mock data, CPU
initialization, dropout off; relative 2e-6: the printed 7 digits but for last-digit float noise).
On 2 ranks, --expert-model-parallel-size 2 prints the losses of the same run with EP=1 (DP=2).
With capacity factor 0.5 (EP=2, dropping by probs), padding each expert's input to capacity with the
sequential experts prints the losses of the unpadded run with --moe-grouped-gemm (padding changes
only shapes, grouped GEMM only the kernel), and those differ from the dropless run's.
On 4 ranks, TP=2 with SP, EP=2, expert-TP=1 and the all-to-all dispatcher prints the one-rank
losses (the balance loss too: every microbatch is routed whole by one data-parallel replica).
"""

import math
import os

import pytest

from tests.functional_tests.gpt_runs import REPO, assert_ok, mock_flags, run_gpt, tiny_gpt_flags

ITERS = 3
REL_TOL = 2e-6
MOE_FLAGS = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-aux-loss-coeff",
    "1e-2",
    "--moe-z-loss-coeff",
    "1e-3",
    "--swiglu",
    "--disable-bias-linear",
]
CAPACITY_FLAGS = ["--moe-expert-capacity-factor", "0.5", "--moe-token-drop-policy", "probs"]


def _assert_same_losses(reference, result, what):
    for key in ("lm loss", "load_balancing_loss", "z_loss"):
        for i, (a, b) in enumerate(zip(reference.lines, result.lines)):
            assert key in a and key in b, f"'{key}' missing in iteration {i + 1}: {a}"
            assert math.isfinite(a[key]) and math.isclose(a[key], b[key], rel_tol=REL_TOL), (
                f"{key} iteration {i + 1}: reference {a[key]} vs {what} {b[key]}"
            )


def test_moe_ep2_prints_the_ep1_losses(tmp_path):
    base = tiny_gpt_flags(ITERS) + mock_flags() + MOE_FLAGS
    ep1 = run_gpt(2, base, str(tmp_path))
    ep2 = run_gpt(2, base + ["--expert-model-parallel-size", "2"], str(tmp_path))
    for name, result in (("ep1", ep1), ("ep2", ep2)):
        assert_ok(result, name)
        assert [line["iteration"] for line in result.lines] == list(range(1, ITERS + 1)), name
    _assert_same_losses(ep1, ep2, "EP=2")
    capacity = base + ["--expert-model-parallel-size", "2"] + CAPACITY_FLAGS
    padded = run_gpt(2, capacity + ["--moe-pad-expert-input-to-capacity"], str(tmp_path))
    grouped = run_gpt(2, capacity + ["--moe-grouped-gemm"], str(tmp_path))
    for name, result in (("capacity padded", padded), ("capacity grouped gemm", grouped)):
        assert_ok(result, name)
        assert [line["iteration"] for line in result.lines] == list(range(1, ITERS + 1)), name
    _assert_same_losses(padded, grouped, "capacity with --moe-grouped-gemm, unpadded")
    pairs = [(a["lm loss"], b["lm loss"]) for a, b in zip(padded.lines, ep1.lines)]
    # The near-uniform tiny model's loss barely depends on its experts, so even capacity 0.5 (about half the routed
    # pairs dropped) moves it little; by iteration 3 several times the 2e-6 that equal runs differ by. That dropping
    # picks exactly the policy's pairs is proven token by token in tests/unit_tests/transformer/test_moe_capacity.py.
    assert any(not math.isclose(a, b, rel_tol=REL_TOL) for a, b in pairs), f"capacity dropped nothing: {pairs}"


def test_moe_tp2_prints_the_single_rank_losses(tmp_path):
    base = tiny_gpt_flags(ITERS) + mock_flags() + MOE_FLAGS
    single = run_gpt(1, base, str(tmp_path))
    tp2 = run_gpt(2, base + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], str(tmp_path))
    for name, result in (("single", single), ("tp2", tp2)):
        assert_ok(result, name)
        assert [line["iteration"] for line in result.lines] == list(range(1, ITERS + 1)), name
    _assert_same_losses(single, tp2, "TP=2")
    # Uniform routing gives exactly 1; a random router starts close to it.
    assert all(0.9 < line["load_balancing_loss"] < 2.0 for line in single.lines), single.lines


def test_moe_alltoall_etp1_tp2_ep2_prints_the_single_rank_losses(tmp_path):
    base = tiny_gpt_flags(ITERS) + mock_flags() + MOE_FLAGS
    single = run_gpt(1, base, str(tmp_path))
    layout = [
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--expert-model-parallel-size",
        "2",
        "--expert-tensor-parallel-size",
        "1",
        "--moe-token-dispatcher-type",
        "alltoall",
    ]
    four = run_gpt(4, base + layout, str(tmp_path))
    for name, result in (("single", single), ("tp2 ep2 etp1 alltoall", four)):
        assert_ok(result, name)
        assert [line["iteration"] for line in result.lines] == list(range(1, ITERS + 1)), name
    _assert_same_losses(single, four, "TP=2 SP EP=2 ETP=1 alltoall")


ISSUE_27 = (  # the report's command: Megatron's DeepSeek-V3 launch turns both of these on
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32"
    " --micro-batch-size 2 --global-batch-size 8 --train-iters 6 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer"
    " --vocab-size 1000 --log-interval 1 --eval-iters 0 --eval-interval 1000 --num-experts 4 --moe-router-topk 2"
    " --moe-grouped-gemm --use-distributed-optimizer --hidden-dropout 0 --attention-dropout 0"
    " --use-cpu-initialization --distributed-backend gloo"
).split()
LATE_GATHER_SCRIPT = [os.path.join(REPO, "tests", "functional_tests", "late_gather_gpt.py")]


@pytest.mark.slow  # tests/unit_tests/distributed/test_param_gather_reads.py proves every read waits
def test_grouped_gemm_with_overlapped_param_gather_prints_the_same_losses(tmp_path):
    """Without overlap, with it, and with it while every all-gather lands only when waited for."""
    overlap = ISSUE_27 + ["--overlap-param-gather", "--overlap-grad-reduce"]
    plain = run_gpt(2, ISSUE_27, str(tmp_path))
    overlapped = run_gpt(2, overlap, str(tmp_path))
    late = run_gpt(2, overlap, str(tmp_path), script=LATE_GATHER_SCRIPT)
    for name, result in (("plain", plain), ("overlapped", overlapped), ("late gathers", late)):
        assert_ok(result, name)
        assert [line["iteration"] for line in result.lines] == list(range(1, 7)), name
    assert overlapped.losses() == plain.losses(), (overlapped.losses(), plain.losses())
    assert late.losses() == plain.losses(), (late.losses(), plain.losses())
