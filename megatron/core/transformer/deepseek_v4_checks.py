"""TransformerConfig's rules for DeepSeek-V4's fields (compressed attention, hyper-connections, hash MoE).

Called once from ``TransformerConfig.__post_init__``; kept here so the config file stays readable.
Errors name the field, its value and the rule.
"""

from __future__ import annotations

from typing import Any

from megatron.core.model_parallel_config import require_divisible, require_positive

COMPRESSED_ATTENTION_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


def check_deepseek_v4(config: Any) -> None:
    """Validate the DeepSeek-V4 fields of a ``TransformerConfig`` (see the module docstring)."""
    _check_compressed_attention(config)
    _check_hyper_connections(config)
    if not isinstance(config.moe_num_hash_layers, int) or config.moe_num_hash_layers < 0:
        raise ValueError(f"moe_num_hash_layers={config.moe_num_hash_layers!r}: must be an integer >= 0")
    if config.moe_num_hash_layers and config.num_moe_experts is None:
        raise ValueError(f"moe_num_hash_layers={config.moe_num_hash_layers}: needs num_moe_experts (MoE layers)")
    if config.moe_num_hash_layers > config.num_layers:
        raise ValueError(f"moe_num_hash_layers={config.moe_num_hash_layers}: must be <= num_layers={config.num_layers}")


def _check_hyper_connections(config: Any) -> None:
    require_positive("hyper_connection_streams", config.hyper_connection_streams)
    require_positive("hyper_connection_sinkhorn_iterations", config.hyper_connection_sinkhorn_iterations)
    if not config.hyper_connection_eps > 0:
        raise ValueError(f"hyper_connection_eps={config.hyper_connection_eps}: must be > 0")


def _check_compressed_attention(config: Any) -> None:
    types = config.compressed_attention_layer_types
    if types is None:
        for name in ("attention_output_groups", "attention_output_lora_rank"):
            if getattr(config, name) is not None:
                raise ValueError(f"{name}={getattr(config, name)}: needs compressed_attention_layer_types")
        return
    types = list(types)
    if len(types) != config.num_layers or any(t not in COMPRESSED_ATTENTION_TYPES for t in types):
        raise ValueError(
            f"compressed_attention_layer_types={types!r}: need one of {COMPRESSED_ATTENTION_TYPES} per layer "
            f"(num_layers={config.num_layers})"
        )
    config.compressed_attention_layer_types = types
    if config.multi_latent_attention or config.experimental_attention_variant is not None:
        raise ValueError(
            "compressed_attention_layer_types: DeepSeek-V4's attention replaces multi-latent attention and "
            f"experimental_attention_variant (got {config.multi_latent_attention}, "
            f"{config.experimental_attention_variant!r})"
        )
    for name in ("q_lora_rank", "attention_output_groups", "attention_output_lora_rank"):
        require_positive(name, getattr(config, name))
    for name in ("csa_compress_rate", "hca_compress_rate"):
        require_positive(name, getattr(config, name))
    require_divisible(
        "num_attention_heads", config.num_attention_heads, "attention_output_groups", config.attention_output_groups
    )
    window = config.window_size
    if window is None or window[0] < 0 or window[1] != 0:
        raise ValueError(
            f"window_size={window!r}: compressed_attention_layer_types needs a causal sliding window "
            "(W - 1, 0) (DeepSeek-V4's sliding_window W)"
        )
    if config.normalization != "RMSNorm":
        raise ValueError(f"normalization={config.normalization!r}: DeepSeek-V4's attention needs 'RMSNorm'")
    if "compressed_sparse_attention" in types:
        for name in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk"):
            require_positive(name, getattr(config, name))
    if config.context_parallel_size > 1:
        raise ValueError(
            f"compressed_attention_layer_types with context_parallel_size={config.context_parallel_size}: not "
            "supported (a query's compressed entries and indexer candidates span every earlier window, "
            "which CP splits over ranks; compressing per CP chunk would need the pooled entries exchanged)"
        )
