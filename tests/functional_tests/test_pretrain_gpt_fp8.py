"""pretrain_gpt.py with Megatron's Llama-3 8B FP8 flag set, scaled down, on 2 CPU ranks; bitwise resume.

``--bf16 --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024
--fp8-amax-compute-algo max`` on a Llama-shaped model (RMSNorm, SwiGLU, RoPE, GQA, no biases,
untied) under TP=2 with sequence parallelism. A straight run of 4 iterations, then 2 iterations
saved (torch_dist, then again with ``--ckpt-format torch``) and exited, resumed to 4: the printed
losses (and grad norms) are equal exactly,
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


def test_llama3_fp8_flags_train_on_two_ranks_and_resume_bitwise(tmp_path):
    base = tiny_gpt_flags(ITERS) + mock_flags() + LLAMA + FP8 + TP2_SP
    ckpt, half = str(tmp_path / "ckpt"), ITERS // 2
    straight = run_gpt(2, base, str(tmp_path))
    assert_ok(straight, "FP8 straight run")
    first = run_gpt(
        2, base + ["--save", ckpt, "--save-interval", str(half), "--exit-interval", str(half)], str(tmp_path)
    )
    assert_ok(first, "FP8 first half")
    second = run_gpt(2, base + ["--load", ckpt], str(tmp_path))
    assert_ok(second, "FP8 resumed half")
    assert [line["iteration"] for line in second.lines] == list(range(half + 1, ITERS + 1))
    assert len(straight.losses()) == ITERS
    assert first.losses() + second.losses() == straight.losses()  # printed values, exactly
    for a, b in zip(second.lines, straight.lines[half:]):
        assert a["grad norm"] == b["grad norm"]
    tensors = load_plain_tensors(os.path.join(ckpt, f"iter_{half:07d}"))
    histories = {k: v for k, v in tensors.items() if k.endswith(".quantizer.delayed.input.amax_history")}
    assert len(histories) == 8, sorted(tensors)  # qkv, proj, fc1, fc2 in each of 2 layers
    assert all(v.shape == (1024,) and int((v > 0).sum()) >= half for v in histories.values())
    assert all(v.dtype == torch.float32 for k, v in tensors.items() if ".quantizer." in k)  # not cast to bf16
    # The legacy torch format carries the same state (the model's state_dict).
    legacy, torch_fmt = str(tmp_path / "legacy"), ["--ckpt-format", "torch"]
    save = ["--save", legacy, "--save-interval", str(half), "--exit-interval", str(half)]
    first = run_gpt(2, base + torch_fmt + save, str(tmp_path))
    assert_ok(first, "FP8 first half, torch format")
    second = run_gpt(2, base + torch_fmt + ["--load", legacy], str(tmp_path))
    assert_ok(second, "FP8 resumed half, torch format")
    assert first.losses() + second.losses() == straight.losses()


def test_fp8_param_gather_trains_on_two_dp_ranks_and_resumes_bitwise(tmp_path):
    """``--fp8-param-gather --use-distributed-optimizer`` (tensorwise) under DP=2: a straight run of 4
    iterations equals 2 saved + 2 resumed exactly, and differs from the run without the flag (whose
    forwards cast the bf16 weights); the checkpoint's linear weights are bf16 values."""
    recipe = FP8[:4] + ["tensorwise"]
    base = tiny_gpt_flags(ITERS) + mock_flags() + LLAMA + recipe + ["--use-distributed-optimizer", "--fp8-param-gather"]
    ckpt, half = str(tmp_path / "ckpt"), ITERS // 2
    straight = run_gpt(2, base, str(tmp_path))
    assert_ok(straight, "FP8 param gather straight run")
    save = ["--save", ckpt, "--save-interval", str(half), "--exit-interval", str(half)]
    first = run_gpt(2, base + save, str(tmp_path))
    assert_ok(first, "FP8 param gather first half")
    second = run_gpt(2, base + ["--load", ckpt], str(tmp_path))
    assert_ok(second, "FP8 param gather resumed half")
    assert len(straight.losses()) == ITERS
    assert first.losses() + second.losses() == straight.losses()  # printed values, exactly
    plain = run_gpt(2, base[:-1], str(tmp_path))  # without the flag: each forward casts the bf16 weights
    assert_ok(plain, "FP8 without param gather")
    assert plain.losses() != straight.losses()
    tensors = load_plain_tensors(os.path.join(ckpt, f"iter_{half:07d}"))
    weights = {k: v for k, v in tensors.items() if k.endswith(("linear_qkv.weight", "linear_fc2.weight"))}
    assert len(weights) == 4 and all(v.dtype == torch.bfloat16 for v in weights.values()), weights.keys()
