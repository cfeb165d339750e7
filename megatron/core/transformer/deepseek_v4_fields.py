"""TransformerConfig's DeepSeek-V4 fields: compressed attention, hyper-connections, hash routing
(a base class of ``TransformerConfig``; their rules are in ``deepseek_v4_checks.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional


@dataclass
class DeepSeekV4Fields:
    """DeepSeek-V4 fields of ``TransformerConfig`` (validated by the whole config, never alone)."""

    # DeepSeek-V4 (experimental_attention_variant/compressed_attention.py, hyper_connection.py; checks in
    # deepseek_v4_checks.py). The indexer of CSA layers takes the dsa_indexer_* sizes.
    compressed_attention_layer_types: Optional[List[str]] = None
    """One per layer: 'sliding_attention', 'compressed_sparse_attention' (CSA) or
    'heavily_compressed_attention' (HCA), DeepSeek-V4's attention; None: not used."""
    csa_compress_rate: int = 4
    """Tokens pooled into one compressed key/value entry in CSA layers."""
    hca_compress_rate: int = 128
    """Tokens pooled into one compressed key/value entry in HCA layers."""
    compressed_attention_rotary_base: float = 160000.0
    """RoPE base of CSA/HCA layers (window and compressed entries); sliding layers take the model's angles."""
    attention_output_groups: Optional[int] = None
    """Head groups of DeepSeek-V4's grouped low-rank output projection."""
    attention_output_lora_rank: Optional[int] = None
    """Each head group's rank in the grouped output projection."""
    hyper_connection_streams: int = 1
    """Residual streams of manifold-constrained hyper-connections (DeepSeek-V4's hc_mult); 1: a plain residual."""
    hyper_connection_sinkhorn_iterations: int = 20
    hyper_connection_eps: float = 1e-6
    moe_num_hash_layers: int = 0
    """The first this many layers' MoE routers pick experts by a frozen table of the token id (hash_moe)."""
