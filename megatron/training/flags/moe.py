"""Records of the mixture-of-experts flags: experts, routing, balance losses, dispatch, capacity."""

from __future__ import annotations

from megatron.core.transformer.moe_choices import BALANCE_TYPES, DISPATCHER_TYPES, SCORE_FUNCTIONS
from megatron.core.transformer.transformer_config import TransformerConfig as TC
from megatron.training.flags import reasons
from megatron.training.flags.derive import num_moe_layers, zero_if_none
from megatron.training.flags.record import (
    IMPLEMENTED,
    SPEED_BITWISE,
    SPEED_RTOL,
    Flag,
    always,
    no_op,
    not_yet,
    same,
    to,
    with_moe,
)
from megatron.training.flags_table import moe_layer_freq
from megatron.training.training_log import FlopsConfig as FL

RECORDS = (
    Flag("moe_extended_tp", not_yet(False)),
    Flag(
        "moe_shared_expert_intermediate_size",
        IMPLEMENTED,
        type=int,
        help="Width of the shared experts' MLP, run on every token beside the routed experts.",
        fills=same(TC, FL),
    ),
    Flag(
        "moe_shared_expert_gate",
        IMPLEMENTED,
        help="Scale the shared experts' output by a sigmoid gate.",
        fills=same(TC),
    ),
    Flag("moe_shared_expert_overlap", no_op(reasons.OVERLAP), fills=same(TC)),
    Flag(
        "moe_ffn_hidden_size",
        IMPLEMENTED,
        type=int,
        fills=(*same(TC), to(FL, "moe_ffn_hidden_size", zero_if_none("moe_ffn_hidden_size"))),
        architecture=with_moe,
    ),
    Flag(
        "moe_router_topk",
        IMPLEMENTED,
        fills=(*same(TC), to(FL, "moe_router_topk", zero_if_none("moe_router_topk"))),
        architecture=with_moe,
    ),
    Flag("moe_enable_routing_replay", not_yet(False)),
    Flag("moe_router_padding_for_quantization", not_yet(False)),
    Flag("moe_router_padding_for_fp8", not_yet(False)),
    Flag("moe_router_num_groups", IMPLEMENTED, type=int, fills=same(TC), architecture=with_moe),
    Flag("moe_router_group_topk", IMPLEMENTED, type=int, fills=same(TC), architecture=with_moe),
    Flag("moe_router_pre_softmax", IMPLEMENTED, fills=same(TC), architecture=with_moe),
    Flag("moe_router_topk_scaling_factor", IMPLEMENTED, type=float, fills=same(TC), architecture=with_moe),
    Flag(
        "moe_router_score_function",
        IMPLEMENTED,
        help="How router logits become expert scores: softmax over the experts, or per expert sigmoid or "
        "sqrtsoftplus (sqrt(softplus(x)), DeepSeek-V4's; this project's extension of Megatron-LM's choices).",
        fills=same(TC),
        architecture=with_moe,
        choices=SCORE_FUNCTIONS,
    ),
    Flag("moe_router_dtype", IMPLEMENTED, fills=same(TC)),
    Flag("moe_router_enable_expert_bias", IMPLEMENTED, fills=same(TC), architecture=with_moe),
    Flag("moe_router_bias_update_rate", IMPLEMENTED, type=float, fills=same(TC)),
    Flag("moe_router_force_load_balancing", IMPLEMENTED, fills=same(TC)),
    Flag("moe_grouped_gemm", IMPLEMENTED, fills=same(TC), speed_only=SPEED_RTOL),
    Flag("moe_use_legacy_grouped_gemm", no_op(reasons.KERNEL)),
    Flag("moe_z_loss_coeff", IMPLEMENTED, type=float, fills=same(TC)),
    Flag("moe_input_jitter_eps", IMPLEMENTED, type=float, fills=same(TC)),
    # Both implemented (token_dispatcher.py); 'flex' (DeepEP / HybridEP kernels, GPU only) stays refused.
    Flag("moe_token_dispatcher_type", not_yet(*DISPATCHER_TYPES), fills=same(TC), speed_only=SPEED_RTOL),
    Flag("moe_enable_deepep", not_yet(False)),
    Flag("moe_flex_dispatcher_backend", no_op(reasons.KERNEL)),
    Flag("moe_per_layer_logging", not_yet(False)),
    Flag("moe_expert_capacity_factor", IMPLEMENTED, type=float, fills=same(TC)),
    Flag("moe_pad_expert_input_to_capacity", IMPLEMENTED, fills=same(TC)),
    Flag("moe_token_drop_policy", IMPLEMENTED, fills=same(TC)),
    Flag("moe_layer_recompute", not_yet(False)),
    Flag("moe_permute_fusion", no_op(reasons.KERNEL), speed_only=SPEED_BITWISE),
    Flag("moe_router_fusion", no_op(reasons.KERNEL)),
    Flag("moe_apply_probs_on_input", not_yet(False)),
    Flag("moe_latent_size", not_yet(None), type=int),
    Flag("moe_deepep_num_sms", no_op(reasons.KERNEL)),
    Flag("moe_hybridep_num_sms", no_op(reasons.KERNEL)),
    Flag(
        "num_experts",
        IMPLEMENTED,
        type=int,
        fills=(to(TC, "num_moe_experts"), to(FL, "num_moe_layers", num_moe_layers)),
        architecture=always,
    ),
    Flag("moe_layer_freq", IMPLEMENTED, type=moe_layer_freq, fills=same(TC), architecture=with_moe),
    Flag("moe_use_upcycling", not_yet(False)),
    Flag(
        "moe_router_load_balancing_type",
        not_yet(*BALANCE_TYPES, *([t] for t in BALANCE_TYPES)),  # sinkhorn and several at once: refused
        fills=same(TC),
        one_value=True,
    ),
    Flag("moe_aux_loss_coeff", IMPLEMENTED, fills=same(TC), one_value=True),
    Flag("moe_upcycling_granularity", not_yet(1)),
    Flag("moe_pad_experts_for_cuda_graph_inference", no_op(reasons.CUDA_GRAPHS)),
)
