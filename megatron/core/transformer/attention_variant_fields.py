"""TransformerConfig's experimental attention variants: DeepSeek Sparse Attention and Gated DeltaNet
(Qwen3-Next) fields and their rules (a base class of ``TransformerConfig``; the rules run from its
``__post_init__`` and read the fields of the whole config).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Union

from megatron.core.model_parallel_config import require_divisible, require_positive


def linear_attention_layer(freq: Union[int, List[int]], layer_number: int) -> bool:
    """Whether global 1-based ``layer_number`` is a linear-attention (Gated DeltaNet) layer by ``freq``
    (Megatron's ``linear_attention_freq``: every ``freq``-th layer is full attention, or one 0/1 entry per layer)."""
    if isinstance(freq, int):
        return layer_number % freq != 0
    return bool(freq[layer_number - 1])


@dataclass
class AttentionVariantFields:
    """``experimental_attention_variant`` fields of ``TransformerConfig`` (validated by the whole config)."""

    # DeepSeek Sparse Attention (DeepSeek-V3.2; see experimental_attention_variant/dsa.py).
    experimental_attention_variant: Optional[str] = None
    """'dsa': multi-latent attention where a lightning indexer picks dsa_indexer_topk keys per query."""
    dsa_indexer_n_heads: Optional[int] = None
    dsa_indexer_head_dim: Optional[int] = None
    """The indexer's per-head channels; its first qk_pos_emb_head_dim are rotated (half-split RoPE)."""
    dsa_indexer_topk: Optional[int] = None

    # Gated DeltaNet layers (experimental_attention_variant='gated_delta_net'; megatron/core/ssm/gated_delta_net.py).
    linear_attention_freq: Optional[Union[int, List[int]]] = None
    """Which layers are Gated DeltaNet: an int N makes every N-th layer full attention and the rest GDN;
    a list gives one entry per layer, 1 = GDN, 0 = full attention (Megatron-core's meaning)."""
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32

    def _check_sparse_attention(self) -> None:
        variant = self.experimental_attention_variant
        if variant is None and "compressed_sparse_attention" in (self.compressed_attention_layer_types or ()):
            return  # DeepSeek-V4's CSA indexer takes these sizes (deepseek_v4_checks.py)
        if variant is None:
            for name in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name}={getattr(self, name)}: needs experimental_attention_variant='dsa' or a "
                        "'compressed_sparse_attention' layer in compressed_attention_layer_types"
                    )
            return
        if variant == "gated_delta_net":
            return self._check_gated_delta_net()
        if variant != "dsa":
            raise ValueError(f"experimental_attention_variant={variant!r}: must be 'dsa' or 'gated_delta_net'")
        if not self.multi_latent_attention or self.q_lora_rank is None:
            raise ValueError(
                "experimental_attention_variant='dsa' needs multi_latent_attention=True and q_lora_rank set "
                f"(the indexer's queries come from the query latent); got {self.multi_latent_attention}, "
                f"{self.q_lora_rank}"
            )
        for name in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk"):
            require_positive(name, getattr(self, name))
        if self.dsa_indexer_head_dim < self.qk_pos_emb_head_dim:
            raise ValueError(
                f"dsa_indexer_head_dim={self.dsa_indexer_head_dim}: must be >= qk_pos_emb_head_dim="
                f"{self.qk_pos_emb_head_dim} (the indexer rotates that many channels)"
            )
        if self.context_parallel_size > 1:
            raise ValueError(
                f"experimental_attention_variant='dsa' with context_parallel_size={self.context_parallel_size}: "
                "not supported (the indexer scores every earlier key of a query, which CP splits over ranks)"
            )

    def _check_gated_delta_net(self) -> None:
        """GDN sizes positive, value heads a multiple of key heads, both split over TP; the layer pattern set."""
        for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim"):
            require_positive(name, getattr(self, name))
        keys, values, tp = self.linear_num_key_heads, self.linear_num_value_heads, self.tensor_model_parallel_size
        require_divisible("linear_num_value_heads", values, "linear_num_key_heads", keys)
        require_divisible("linear_num_key_heads", keys, "tensor_model_parallel_size", tp)
        freq = self.linear_attention_freq
        if freq is None:
            raise ValueError("experimental_attention_variant='gated_delta_net' needs linear_attention_freq set")
        if isinstance(freq, int) and not isinstance(freq, bool):
            return require_positive("linear_attention_freq", freq)
        if len(freq) != self.num_layers or any(p not in (0, 1) for p in freq):
            raise ValueError(f"linear_attention_freq={freq!r}: must be an int or {self.num_layers} entries of 0/1")
        if self.context_parallel_size > 1:
            raise ValueError(
                f"experimental_attention_variant='gated_delta_net' with context_parallel_size="
                f"{self.context_parallel_size}: not supported (the recurrence would restart on every rank's chunk)"
            )

    def is_linear_attention_layer(self, layer_number: int) -> bool:
        """Whether the global 1-based ``layer_number`` is a Gated DeltaNet layer (``linear_attention_freq``)."""
        if self.experimental_attention_variant != "gated_delta_net":
            return False
        return linear_attention_layer(self.linear_attention_freq, layer_number)
