"""pretrain_gpt.py with Megatron's Llama-3 8B FP8 flag set, scaled down, on 2 CPU ranks; bitwise resume.

``--bf16 --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024
--fp8-amax-compute-algo max`` on a Llama-shaped model (RMSNorm, SwiGLU, RoPE, GQA, no biases,
untied) under TP=2 with sequence parallelism. A straight run of 4 iterations that saves at 2 (torch_dist), a
run resumed from that checkpoint, and 2 iterations saved with ``--ckpt-format torch`` and exited, resumed to 4:
the printed losses (and grad norms) are equal exactly,
which needs the amax histories and scales restored (a fresh state would quantize the first resumed
step with scale 1). The checkpoint holds every linear's 1024-entry histories, with amaxes recorded,
in fp32 although the model runs in bf16 (``Float16Module``'s cast leaves the scaling state alone).
"""

import os

import torch

from megatron.core.dist_checkpointing import load_plain_tensors
from tests.functional_tests.gpt_runs import assert_ok, mock_flags, run_gpt, tiny_gpt_flags

ITERS = 4
LLAMA = [
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--group-query-attention",
    "--num-query-groups",
    "2",
]
FP8 = [
    "--bf16",
    "--fp8-format",
    "hybrid",
    "--fp8-recipe",
    "delayed",
    "--fp8-amax-history-len",
    "1024",
    "--fp8-amax-compute-algo",
    "max",
]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


def _halves(base, directory, name, extra=()):
    """The first ITERS/2 iterations saved to ``directory/name`` and exited, then resumed to ITERS."""
    ckpt, half = os.path.join(directory, name), ITERS // 2
    save = ["--save", ckpt, "--save-interval", str(half), "--exit-interval", str(half)]
    first = run_gpt(2, base + list(extra) + save, directory)
    assert_ok(first, f"{name}: first half")
    second = run_gpt(2, base + list(extra) + ["--load", ckpt], directory)
    assert_ok(second, f"{name}: resumed half")
    assert [line["iteration"] for line in second.lines] == list(range(half + 1, ITERS + 1))
    return first, second, ckpt


def _assert_resumed_bitwise(straight, resumed):
    """The resumed run prints the straight run's losses and grad norms of its iterations exactly."""
    assert len(straight.losses()) == ITERS
    assert [line["iteration"] for line in resumed.lines] == list(range(ITERS // 2 + 1, ITERS + 1))
    assert resumed.losses() == straight.losses()[ITERS // 2 :]  # printed values, exactly
    for a, b in zip(resumed.lines, straight.lines[ITERS // 2 :]):
        assert a["grad norm"] == b["grad norm"]


def _straight_then_resumed(base, directory, name):
    """A straight run of ITERS that saves at ITERS/2 (as a long run saves on its way), and a run resumed from
    that checkpoint whose iterations equal the straight run's bitwise; the straight run and the checkpoint's
    iteration folder."""
    ckpt, half = os.path.join(directory, name), ITERS // 2
    straight = run_gpt(2, base + ["--save", ckpt, "--save-interval", str(half)], directory)
    assert_ok(straight, f"{name}: straight run")
    resumed = run_gpt(2, base + ["--load", ckpt, "--ckpt-step", str(half)], directory)
    assert_ok(resumed, f"{name}: resumed run")
    _assert_resumed_bitwise(straight, resumed)
    return straight, os.path.join(ckpt, f"iter_{half:07d}")


def test_llama3_fp8_flags_train_on_two_ranks_and_resume_bitwise(tmp_path):
    base = tiny_gpt_flags(ITERS) + mock_flags() + LLAMA + FP8 + TP2_SP
    half = ITERS // 2
    straight, saved = _straight_then_resumed(base, str(tmp_path), "ckpt")
    tensors = load_plain_tensors(saved)
    histories = {k: v for k, v in tensors.items() if k.endswith(".quantizer.delayed.input.amax_history")}
    assert len(histories) == 8, sorted(tensors)  # qkv, proj, fc1, fc2 in each of 2 layers
    assert all(v.shape == (1024,) and int((v > 0).sum()) >= half for v in histories.values())
    assert all(v.dtype == torch.float32 for k, v in tensors.items() if ".quantizer." in k)  # not cast to bf16
    # The legacy torch format carries the same state (the model's state_dict).
    first, second, _ = _halves(base, str(tmp_path), "legacy", ["--ckpt-format", "torch"])
    assert first.losses() + second.losses() == straight.losses()


def test_nvfp4_resumes_bitwise_with_the_stochastic_rounding_state(tmp_path):
    """``--fp4-format e2m1 --fp4-recipe nvfp4`` under TP=2 + SP: 2 resumed iterations equal the straight run's.

    Gradients are stochastically rounded; the checkpoint holds each linear's count of rounding
    calls (``sr_calls``), from which the resumed run seeds the draws the straight run made.
    """
    base = tiny_gpt_flags(ITERS) + mock_flags() + LLAMA + ["--bf16", "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"]
    _, saved = _straight_then_resumed(base + TP2_SP, str(tmp_path), "nvfp4")
    tensors = load_plain_tensors(saved)
    calls = {k: v for k, v in tensors.items() if k.endswith(".sr_calls")}
    microbatches = 8 // 2  # global batch / micro batch (TP=2: one data-parallel rank)
    assert len(calls) == 8, sorted(tensors)  # qkv, proj, fc1, fc2 in each of 2 layers
    # Two stochastically rounded gradients (dgrad, wgrad) per backward of each linear.
    assert all(v.dtype == torch.int64 and v.tolist() == [2 * microbatches * ITERS // 2] for v in calls.values())


def test_nvfp4_resumes_bitwise_from_the_legacy_checkpoint_format(tmp_path):
    """The same with ``--ckpt-format torch``: the legacy format carries the rounding state too."""
    base = tiny_gpt_flags(ITERS) + mock_flags() + LLAMA + ["--bf16", "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"]
    _straight_then_resumed(base + TP2_SP + ["--ckpt-format", "torch"], str(tmp_path), "nvfp4-legacy")


def test_fp8_param_gather_trains_on_two_dp_ranks_and_resumes_bitwise(tmp_path):
    """``--fp8-param-gather --use-distributed-optimizer`` (tensorwise) under DP=2: a straight run of 4
    iterations saving at 2 and the run resumed from there agree exactly, and differ from the run without the
    flag (whose forwards cast the bf16 weights); the checkpoint's linear weights are bf16 values."""
    recipe = FP8[:4] + ["tensorwise"]
    base = tiny_gpt_flags(ITERS) + mock_flags() + LLAMA + recipe + ["--use-distributed-optimizer", "--fp8-param-gather"]
    straight, saved = _straight_then_resumed(base, str(tmp_path), "ckpt")
    tensors = load_plain_tensors(saved)
    plain = run_gpt(2, base[:-1], str(tmp_path))  # without the flag: each forward casts the bf16 weights
    assert_ok(plain, "FP8 without param gather")
    assert plain.losses() != straight.losses()
    weights = {k: v for k, v in tensors.items() if k.endswith(("linear_qkv.weight", "linear_fc2.weight"))}
    assert len(weights) == 4 and all(v.dtype == torch.bfloat16 for v in weights.values()), weights.keys()
