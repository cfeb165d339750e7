"""Flags -> configs: the validated flags reach TransformerConfig, the scheduler and the entry point's model."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training import arguments as A
from tests.dist_harness import run_distributed
from tests.unit_tests.training.test_arguments import BASE, _validated


def test_context_parallel_size_is_accepted_and_reaches_the_config():
    args = _validated(
        [
            "--context-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--cp-comm-type",
            "all_gather",
        ],
        world_size=8,
    )
    assert args.data_parallel_size == 2
    config = A.core_transformer_config_from_args(args)
    assert config.context_parallel_size == 2 and config.sequence_parallel
    per_layer = _validated(
        ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a", "all_gather", "p2p"], world_size=2
    )
    assert per_layer.cp_comm_type == ["p2p", "a2a", "all_gather", "p2p"]
    assert A.core_transformer_config_from_args(per_layer).cp_comm_type == ["p2p", "a2a", "all_gather", "p2p"]
    nested = _validated(
        [
            "--context-parallel-size",
            "4",
            "--cp-comm-type",
            "a2a+p2p",
            "--hierarchical-context-parallel-sizes",
            "2",
            "2",
        ],
        world_size=4,
    )
    assert A.core_transformer_config_from_args(nested).hierarchical_context_parallel_sizes == [2, 2]


def test_expert_model_parallel_size_is_accepted_and_reaches_the_config():
    args = _validated(
        ["--num-experts", "4", "--expert-model-parallel-size", "2", "--global-batch-size", "8"], world_size=4
    )
    assert args.data_parallel_size == 4
    assert A.core_transformer_config_from_args(args).expert_model_parallel_size == 2


def test_moe_flags_map_to_config():
    args = _validated(
        [
            "--num-experts",
            "8",
            "--moe-router-topk",
            "2",
            "--moe-aux-loss-coeff",
            "1e-2",
            "--moe-z-loss-coeff",
            "1e-3",
            "--moe-layer-freq",
            "([1]*1+[0])*2",
            "--moe-router-pre-softmax",
            "--moe-token-dispatcher-type",
            "alltoall",
            "--moe-grouped-gemm",
        ]
    )
    cfg = A.core_transformer_config_from_args(args)
    moe = (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff)
    assert moe == (8, 2, 1e-2, 1e-3)
    assert cfg.moe_layer_freq == [1, 0, 1, 0] and cfg.moe_router_pre_softmax
    assert cfg.moe_ffn_hidden_size == cfg.ffn_hidden_size == 256
    assert cfg.moe_router_load_balancing_type == "aux_loss" and cfg.moe_token_dispatcher_type == "alltoall"
    assert (
        A.core_transformer_config_from_args(_validated(["--num-experts", "4", "--moe-layer-freq", "2"])).moe_layer_freq
        == 2
    )
    with pytest.raises(A.ArgumentsError, match="--moe-router-topk 9 must be <= --num-experts 8"):
        _validated(["--num-experts", "8", "--moe-router-topk", "9"])
    with pytest.raises(A.ArgumentsError, match="--moe-layer-freq"):
        _validated(["--num-experts", "8", "--moe-layer-freq", "[1,0]"])


def test_transformer_config_from_args():
    args = _validated(
        [
            "--swiglu",
            "--disable-bias-linear",
            "--add-qkv-bias",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--normalization",
            "RMSNorm",
            "--bf16",
            "--hidden-dropout",
            "0.0",
            "--attention-dropout",
            "0.05",
            "--init-method-std",
            "0.01",
            "--qk-layernorm",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--recompute-activations",
            "--calculate-per-token-loss",
            "--apply-layernorm-1p",
            "--norm-epsilon",
            "1e-6",
            "--window-size",
            "(7, 0)",
            "--embedding-init-method-std",
            "0.05",
            "--init-method-xavier-uniform",
        ],
        world_size=2,
    )
    cfg = A.core_transformer_config_from_args(args)
    assert cfg.gated_linear_unit and cfg.activation_func is F.silu
    assert cfg.add_bias_linear is False and cfg.add_qkv_bias is True
    assert cfg.num_query_groups == 2 and cfg.normalization == "RMSNorm"
    assert cfg.params_dtype is torch.bfloat16 and cfg.pipeline_dtype is torch.bfloat16
    assert (cfg.hidden_dropout, cfg.attention_dropout, cfg.init_method_std) == (0.0, 0.05, 0.01)
    assert cfg.qk_layernorm and cfg.sequence_parallel and cfg.tensor_model_parallel_size == 2
    assert cfg.recompute_granularity == "selective" and cfg.calculate_per_token_loss
    assert cfg.layernorm_zero_centered_gamma and cfg.layernorm_epsilon == 1e-6 and cfg.window_size == (7, 0)
    assert cfg.embedding_init_method_std == 0.05
    assert cfg.init_method is torch.nn.init.xavier_uniform_ and cfg.output_layer_init_method is cfg.init_method
    assert cfg.ffn_hidden_size == args.ffn_hidden_size and cfg.num_attention_heads == 4
    plain = A.core_transformer_config_from_args(_validated())
    assert plain.activation_func is F.gelu and plain.num_query_groups == 4 and plain.params_dtype is torch.float32
    assert plain.embedding_init_method_std == plain.init_method_std
    assert plain.init_method is not torch.nn.init.xavier_uniform_


def _entry_point_rotary(rank, world_size, extra):
    import pretrain_gpt
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    args = _validated(extra)
    model = pretrain_gpt.model_provider(config=A.core_transformer_config_from_args(args), args=args)
    return model.rotary_pos_emb.inv_freq


def test_rope_flags_reach_the_entry_point_model():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import llama3_scaled_frequencies

    rope = ["--position-embedding-type", "rope", "--rotary-base", "500000"]
    plain = run_distributed(_entry_point_rotary, 1, rope)[0]
    scaled = run_distributed(_entry_point_rotary, 1, rope + ["--use-rope-scaling", "--rope-scaling-factor", "4"])[0]
    assert torch.equal(plain, 1.0 / 500000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))  # kv_channels 16
    assert torch.equal(scaled, llama3_scaled_frequencies(plain, factor=4.0))


def test_scheduler_kwargs_count_samples():
    args = _validated(
        [
            "--global-batch-size",
            "8",
            "--train-iters",
            "100",
            "--lr-warmup-iters",
            "10",
            "--lr-decay-style",
            "cosine",
            "--min-lr",
            "1e-5",
        ]
    )
    kw = A.optimizer_param_scheduler_kwargs(args)
    assert (kw["lr_warmup_steps"], kw["lr_decay_steps"], kw["wd_incr_steps"]) == (10 * 8, 100 * 8, 100 * 8)
    model = torch.nn.Linear(2, 2)
    sched = OptimizerParamScheduler(torch.optim.SGD(model.parameters(), lr=0.0), **kw)
    sched.step(10 * 8)
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    frac = _validated(["--train-iters", "100", "--lr-warmup-fraction", "0.25", "--lr-decay-iters", "40"])
    kw = A.optimizer_param_scheduler_kwargs(frac)
    assert kw["lr_warmup_steps"] == pytest.approx(0.25 * 40 * A.training_config_from_args(frac).global_batch_size)


def test_encoder_flags_stand_for_num_layers_and_seq_length():
    """Megatron's T5 flags: --encoder-num-layers / --encoder-seq-length instead of --num-layers / --seq-length."""
    plain = list(BASE)
    for flag in ("--num-layers", "--seq-length"):
        del plain[plain.index(flag) : plain.index(flag) + 2]
    t5 = ["--encoder-num-layers", "3", "--encoder-seq-length", "48", "--decoder-seq-length", "16"]
    args = A.validate_args(A.parse_args(plain + t5, entry_point="t5"), 1)
    assert (args.num_layers, args.encoder_num_layers, args.decoder_num_layers) == (3, 3, 3)
    assert (args.seq_length, args.encoder_seq_length, args.decoder_seq_length) == (48, 48, 16)
    assert _validated(["--decoder-num-layers", "2"]).decoder_num_layers == 2
    with pytest.raises(A.ArgumentsError, match=r"--encoder-num-layers=3 and --num-layers=4: give one of the two"):
        _validated(["--encoder-num-layers", "3"])
