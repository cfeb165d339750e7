"""TransformerConfig: the shape and numerics of a transformer, validated on creation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core.model_parallel_config import ModelParallelConfig, require_divisible, require_positive


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Initializer drawing from N(0, sigma^2)."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, (sigma / sqrt(2 * num_layers))^2): for layers that write into the residual stream."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


NORMALIZATIONS = ("LayerNorm", "RMSNorm")


@dataclass
class TransformerConfig(ModelParallelConfig):
    """Transformer hyper-parameters with Megatron Core's field names."""

    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    kv_channels: Optional[int] = None

    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    fp32_residual_connection: bool = False
    apply_residual_connection_post_layernorm: bool = False
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False
    normalization: str = "LayerNorm"
    qk_layernorm: bool = False

    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    gated_linear_unit: bool = False
    activation_func: Callable[[torch.Tensor], torch.Tensor] = F.gelu
    rotary_interleaved: bool = False
    window_size: Optional[tuple] = None

    init_method: Optional[Callable] = None
    output_layer_init_method: Optional[Callable] = None
    init_method_std: float = 0.02
    initialization_seed: Optional[int] = None
    """With use_cpu_initialization: seed each layer, the embeddings and the output layer from
    (this seed, their global name), so any TP/PP/VP layout starts from the same model."""

    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = True
    softmax_scale: Optional[float] = None
    attention_backend: str = "auto"
    calculate_per_token_loss: bool = False

    # Kernel-selection switches: accepted, mathematically identical either way.
    bias_activation_fusion: bool = False
    masked_softmax_fusion: bool = False
    persist_layer_norm: bool = False
    memory_efficient_layer_norm: bool = False
    bias_dropout_fusion: bool = False
    apply_rope_fusion: bool = False
    cross_entropy_loss_fusion: bool = False

    # Activation recomputation.
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    distribute_saved_activations: Optional[bool] = None

    # Uneven pipeline stages.
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            require_positive(name, getattr(self, name))
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        require_positive("num_query_groups", self.num_query_groups)
        require_divisible("num_attention_heads", self.num_attention_heads, "num_query_groups", self.num_query_groups)
        tp = self.tensor_model_parallel_size
        require_divisible("num_attention_heads", self.num_attention_heads, "tensor_model_parallel_size", tp)
        require_divisible("num_query_groups", self.num_query_groups, "tensor_model_parallel_size", tp)
        if self.kv_channels is None:
            require_divisible("hidden_size", self.hidden_size, "num_attention_heads", self.num_attention_heads)
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        require_divisible("ffn_hidden_size", self.ffn_hidden_size, "tensor_model_parallel_size", tp)
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization={self.normalization!r}: must be one of {NORMALIZATIONS}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)}: must be in [0, 1)")
        self._check_recompute()
        self._check_window()
        if self.initialization_seed is not None and not self.use_cpu_initialization:
            raise ValueError(f"initialization_seed={self.initialization_seed} needs use_cpu_initialization=True "
                             "(per-rank initialization draws from the model-parallel RNG instead)")
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(self.init_method_std, self.num_layers)
        if self.apply_query_key_layer_scaling:
            self.attention_softmax_in_fp32 = True
        if self.fp32_residual_connection:
            # The residual stream, and so what pipeline stages exchange, stays in fp32.
            self.pipeline_dtype = torch.float32

    def _check_window(self) -> None:
        if self.window_size is None:
            return
        window = tuple(self.window_size)
        if len(window) != 2 or not all(isinstance(w, int) and w >= -1 for w in window):
            raise ValueError(f"window_size={self.window_size!r} (--window-size): need (left, right) integers, "
                             "each >= 0 or -1 for unlimited")
        self.window_size = window

    def _check_recompute(self) -> None:
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity={self.recompute_granularity!r}: must be 'full' or 'selective'")
        if self.recompute_granularity == "full":
            if self.recompute_method not in ("uniform", "block"):
                raise ValueError(
                    f"recompute_method={self.recompute_method!r}: recompute_granularity='full' needs "
                    "'uniform' or 'block'"
                )
            require_positive("recompute_num_layers", self.recompute_num_layers)
