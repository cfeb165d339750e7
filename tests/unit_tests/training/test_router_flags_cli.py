"""DeepSeek-style router flags through pretrain_gpt.py on 2 data-parallel ranks (CPU, gloo).

Sigmoid scores, group-limited top-k with a scaling factor, the aux-loss-free expert bias,
the sequence-wise balance loss, fp32 router, z-loss and input jitter: the run trains, logs the
sequence balance loss, and its checkpoint holds each MoE layer's expert bias, moved by whole
multiples of the update rate (one per step: +-1 three times cannot sum to 0) from zero.
"""

import torch

from megatron.training import arguments as A
from tests.functional_tests.gpt_runs import assert_ok, mock_flags, run_gpt, tiny_gpt_flags
from tests.unit_tests.training.test_arguments import BASE
from tools.checkpoint import convert

RATE = 0.01
ROUTER_FLAGS = [
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
    "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
    "--moe-router-topk-scaling-factor", "2.5", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", str(RATE), "--moe-router-load-balancing-type", "seq_aux_loss",
    "--moe-aux-loss-coeff", "1e-3", "--moe-router-dtype", "fp32", "--moe-z-loss-coeff", "1e-3",
    "--moe-input-jitter-eps", "0.01", "--no-save-optim", "--no-save-rng", "--lr-warmup-iters", "1",
]  # fmt: skip


def test_deepseek_router_flags_train_and_checkpoint_the_bias(tmp_path):
    save = str(tmp_path / "ckpt")
    flags = tiny_gpt_flags(3) + mock_flags() + ROUTER_FLAGS + ["--save", save, "--save-interval", "3"]
    result = run_gpt(2, flags, cwd=str(tmp_path))
    assert_ok(result, "pretrain_gpt.py with the router flags")
    assert "seq_load_balancing_loss" in result.output
    with convert.single_process_group() as groups:
        sd = convert.load_megatron(save, groups)[0]
    biases = [v for k, v in sd.items() if k.endswith("router.expert_bias")]
    assert len(biases) == 2  # --moe-layer-freq 1: both layers
    for bias in biases:
        steps = bias / RATE
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 3
        assert (steps.abs() > 0).any()  # 3 steps of +-1 (0 only if an expert met the mean exactly)


def _config_of(extra):
    args = A.parse_args(BASE + ["--num-experts", "4"] + list(extra), entry_point="gpt")
    return A.core_transformer_config_from_args(A.validate_args(args, 1))


def test_router_flags_fill_the_config():
    cfg = _config_of(ROUTER_FLAGS[4:] + ["--moe-router-force-load-balancing"])
    assert (cfg.moe_router_score_function, cfg.moe_router_num_groups, cfg.moe_router_group_topk) == ("sigmoid", 2, 1)
    assert cfg.moe_router_enable_expert_bias and cfg.moe_router_bias_update_rate == RATE
    assert (cfg.moe_router_load_balancing_type, cfg.moe_router_dtype, cfg.moe_input_jitter_eps) == (
        "seq_aux_loss",
        "fp32",
        0.01,
    )
    assert cfg.moe_router_force_load_balancing and cfg.moe_router_topk_scaling_factor == 2.5
    assert _config_of(["--moe-router-load-balancing-type", "global_aux_loss"]).moe_router_load_balancing_type == (
        "global_aux_loss"
    )
    sinkhorn = _config_of(["--moe-router-load-balancing-type", "sinkhorn"])
    assert sinkhorn.moe_router_load_balancing_type == "sinkhorn"
