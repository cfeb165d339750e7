"""Which Megatron flags change nothing here, and which we refuse for now.

``NOT_SUPPORTED_YET`` maps a flag's destination to its harmless value (its
Megatron default, or ``AnyOf`` the values we implement). Giving such a flag any
other value stops the run with ``not supported yet: --flag``: a flag that would
change what is trained is never accepted and ignored. When a feature lands,
delete its lines here and map the flag in ``arguments.py``.

``NO_OP_FLAGS`` only pick a GPU kernel, a fusion, an overlap strategy or a
profiling aid; the result is mathematically the same, so they are accepted and
do nothing. Their ``--help`` says so.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple


class AnyOf:
    """Several harmless values for one flag (e.g. the choices we implement)."""

    def __init__(self, *values: Any) -> None:
        self.values: Tuple[Any, ...] = values

    def __contains__(self, value: Any) -> bool:
        return value in self.values

    def __repr__(self) -> str:
        return f"AnyOf{self.values!r}"


NOT_SUPPORTED_YET: Dict[str, Any] = {
    # Context-parallel variants, expert parallelism, other data-parallel sharding schemes.
    "hierarchical_context_parallel_sizes": None,
    "max_seqlen_per_dp_cp_rank": None,
    "hybrid_context_parallel": False,
    "expert_tensor_parallel_size": None,
    "moe_extended_tp": False,
    "use_megatron_fsdp": False,
    "use_torch_fsdp2": False,
    "num_distributed_optimizer_instances": 1,
    # Pipeline layouts beyond even (or first/last-stage uneven) splits.
    "pipeline_model_parallel_layout": None,
    "microbatch_group_size_per_vp_stage": None,
    "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False,
    # Mixture of experts beyond dropless top-k softmax routing with a Switch aux loss / z-loss.
    "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False,
    "moe_enable_routing_replay": False,
    "moe_router_padding_for_quantization": False,
    "moe_router_padding_for_fp8": False,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_score_function": "softmax",
    "moe_router_dtype": None,
    "moe_router_enable_expert_bias": False,
    "moe_router_bias_update_rate": 0.001,
    "moe_router_force_load_balancing": False,
    "moe_input_jitter_eps": None,
    "moe_token_dispatcher_type": AnyOf("allgather", "alltoall"),
    "moe_enable_deepep": False,
    "moe_per_layer_logging": False,
    "moe_expert_capacity_factor": None,
    "moe_pad_expert_input_to_capacity": False,
    "moe_token_drop_policy": "probs",
    "moe_layer_recompute": False,
    "moe_apply_probs_on_input": False,
    "moe_latent_size": None,
    "moe_use_upcycling": False,
    "moe_upcycling_granularity": 1,
    "moe_router_load_balancing_type": AnyOf("aux_loss", "none", ["aux_loss"], ["none"]),
    # Multi-token prediction, latent / hybrid / experimental attention.
    "mtp_num_layers": None,
    "mtp_standalone": False,
    "multi_latent_attention": False,
    "experimental_attention_variant": None,
    "is_hybrid_model": False,
    "qk_l2_norm": False,
    "qk_clip": False,
    "attention_output_gate": False,
    "softmax_type": "vanilla",
    "window_attn_skip_freq": None,  # --window-size is implemented; mixing in full-attention layers is not
    "use_kitchen_attention": False,
    # Activations, positions and initialisations we do not implement.
    "glu_linear_offset": 0.0,
    "activation_func_clamp_value": None,
    "quick_geglu": False,
    "use_fused_weighted_squared_relu": False,
    "position_embedding_type": AnyOf("learned_absolute", "rope", "none"),
    "rope_type": AnyOf(None, "rope"),
    "no_rope_freq": None,
    "mrope_section": None,
    "init_model_with_meta_device": False,
    # Low precision formats and precision variants.
    "fp8": None,
    "fp8_param_gather": False,
    "fp4": None,
    "fp4_param": False,
    "first_last_layers_bf16": False,
    "te_precision_config_file": None,
    # T5 / BERT specifics.
    "encoder_num_layers": None,
    "decoder_num_layers": None,
    "encoder_seq_length": None,
    "decoder_seq_length": None,
    "bert_binary_head": True,
    # Data sources and validation modes.
    "data_args_path": None,
    "per_split_data_args_path": None,
    "per_dataset_sequences_path": None,
    "object_storage_cache_path": None,
    "phase_transition_iterations": None,
    "fim_data": False,
    "multiple_validation_sets": False,
    "full_validation": False,
    "dataloader_type": AnyOf(None, "single", "cyclic"),
    # Optimizer variants.
    "optimizer": AnyOf("adam", "sgd"),
    "optimizer_cpu_offload": False,
    "apply_wd_to_qk_layernorm": False,
    "no_weight_decay_cond_type": None,
    "dump_param_to_param_group_map": None,
    # Training-loop features.
    "iterations_to_skip": [],
    "result_rejected_tracker_filename": None,
    "check_for_large_grads": False,
    "use_legacy_models": False,
    "adlr_autoresume": False,
    "transformer_impl": AnyOf("local", "transformer_engine"),
    # Checkpoint formats and modes.
    "ckpt_format": AnyOf("torch", "torch_dist"),
    "non_persistent_save_interval": None,
    "replication": False,
    "ckpt_convert_format": None,
    "pretrained_checkpoint": None,
    "use_mp_args_from_checkpoint_args": False,
    "save_wgrads_interval": None,
    "save_dgrads_interval": None,
}


NO_OP_FLAGS = frozenset(
    """
pipeline_model_parallel_comm_backend async_tensor_model_parallel_allreduce tp_comm_overlap tp_comm_bulk_wgrad
tp_comm_bulk_dgrad tp_comm_overlap_ag tp_comm_overlap_rs tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_split_rs
tp_comm_bootstrap_backend tp_comm_overlap_cfg cross_entropy_loss_fusion cross_entropy_fusion_impl
overlap_moe_expert_parallel_comm delay_wgrad_compute ep_overlap_early_attn_memory_release use_ring_exchange_p2p
defer_embedding_wgrad_compute wgrad_deferral_limit overlap_p2p_comm_warmup_flush cpu_offloading_num_layers
attention_backend disable_bf16_reduced_precision_matmul enable_cuda_graph external_cuda_graph
cuda_graph_warmup_steps cuda_graph_impl clone_scatter_output_in_embedding flash_decode use_te_activation_func
inference_fuse_tp_communication symmetric_ar_type offload_modules min_offloaded_tensor_size
fine_grained_activation_offloading mlp_chunks_for_prefill masked_softmax_fusion bias_gelu_fusion
bias_swiglu_fusion bias_dropout_fusion apply_rope_fusion use_flash_attn no_persist_layer_norm
disable_jit_fuser high_priority_stream_groups te_rng_tracker inference_rng_tracker
overlap_p2p_comm align_grad_reduce ddp_pad_buckets_for_high_nccl_busbw
overlap_param_gather_with_optimizer_step align_param_gather scatter_gather_tensors_in_pipeline nccl_ub
disable_symmetric_registration fsdp_manual_registration use_sharp sharp_enabled_group create_all_gather_group
gradient_reduce_div_fusion fsdp_double_buffer keep_fp8_transpose_cache nccl_communicator_config_path
empty_unused_memory_level deprecated_use_mcore_models kitchen_attention_backend
moe_grouped_gemm moe_use_legacy_grouped_gemm moe_permute_fusion moe_router_fusion moe_shared_expert_overlap
moe_flex_dispatcher_backend moe_deepep_num_sms moe_hybridep_num_sms moe_pad_experts_for_cuda_graph_inference
""".split()
)
