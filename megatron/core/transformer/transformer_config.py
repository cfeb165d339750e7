"""TransformerConfig: the shape and numerics of a transformer, validated on creation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Union

import torch
import torch.nn.functional as F

from megatron.core import compatibility
from megatron.core.context_parallel import CP_COMM_TYPES as CP_SCHEMES
from megatron.core.model_parallel_config import ModelParallelConfig, require_divisible, require_positive
from megatron.core.quantization.fp8 import AMAX_COMPUTE_ALGOS
from megatron.core.quantization.recipes import FP4_FORMATS, FP4_RECIPES, FP8_FORMATS, FP8_RECIPES
from megatron.core.transformer.attention_variant_fields import AttentionVariantFields
from megatron.core.transformer.deepseek_v4_checks import check_deepseek_v4
from megatron.core.transformer.deepseek_v4_fields import DeepSeekV4Fields
from megatron.core.transformer.layer_layout import pipeline_layer_assignment
from megatron.core.transformer.moe_fields import MoEFields
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

CP_COMM_TYPES = (None, "allgather") + CP_SCHEMES  # config.cp_comm_type values (Megatron-core's spellings)

TRANSFORMER_IMPLS = ("local", "transformer_engine")
SYMMETRIC_AR_TYPES = (None, "two_shot", "one_shot", "multimem_all_reduce")


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
class TransformerConfig(DeepSeekV4Fields, AttentionVariantFields, MoEFields, ModelParallelConfig):
    """Transformer hyper-parameters with Megatron Core's field names.

    The mixture-of-experts, attention-variant (DSA, Gated DeltaNet) and DeepSeek-V4 fields and their
    rules live in the base classes ``MoEFields``, ``AttentionVariantFields`` and ``DeepSeekV4Fields``
    (their own modules); ``dataclasses.fields`` lists them after ``ModelParallelConfig``'s, before these.
    """

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
    attention_output_gate: bool = False  # sigmoid gate from the query projection on the attention output

    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    gated_linear_unit: bool = False
    activation_func: Callable[[torch.Tensor], torch.Tensor] = F.gelu
    activation_func_clamp_value: Optional[float] = None
    """Gated MLPs: clamp the gate to <= c and the linear half to [-c, c] before act(gate) * up
    (DeepSeek-V4's swiglu_limit); None: no clamp."""
    rotary_interleaved: bool = False
    window_size: Optional[tuple] = None
    cp_comm_type: Optional[Union[str, List[str]]] = None
    """Context-parallel scheme, one value or one per layer: 'p2p' (ring; None means it), 'a2a' (Ulysses),
    'all_gather' ('allgather'), 'a2a+p2p' (all-to-all inside the first of hierarchical_context_parallel_sizes,
    the ring over the second)."""

    init_method: Optional[Callable] = None
    output_layer_init_method: Optional[Callable] = None
    init_method_std: float = 0.02
    embedding_init_method: Optional[Callable] = None
    embedding_init_method_std: Optional[float] = None
    initialization_seed: Optional[int] = None
    """With use_cpu_initialization: seed each layer, the embeddings and the output layer from
    (this seed, their global name), so any TP/PP/VP layout starts from the same model."""

    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = True
    softmax_scale: Optional[float] = None
    attention_backend: str = "auto"
    calculate_per_token_loss: bool = False

    # Kernel-selection switches (megatron/core/fusions): the fused forms or the unfused references, the same
    # math up to rounding order; memory_efficient_layer_norm is accepted only.
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
    pipeline_model_parallel_layout: Optional[Union[str, list, PipelineParallelLayerLayout]] = None
    """Custom layers per stage (see ``pipeline_parallel_layer_layout``); converted to the class on creation."""
    account_for_embedding_in_pipeline_split: bool = False
    """The embedding counts as one layer when layers are split over pipeline stages."""
    account_for_loss_in_pipeline_split: bool = False
    """The loss counts as one layer when layers are split over pipeline stages."""

    # Multi-token prediction (DeepSeek-V3; see multi_token_prediction.py).
    mtp_num_layers: Optional[int] = None
    """Prediction modules after the decoder (module k predicts the token k+1 ahead); None: none."""
    mtp_loss_scaling_factor: float = 0.1
    """Their losses' weight in the gradient, shared equally between the modules."""

    # Multi-latent attention (DeepSeek-V2/V3; see multi_latent_attention.py).
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    """Rank of the query compression; None: queries projected directly from the hidden state."""
    kv_lora_rank: int = 32
    """Rank of the shared key/value latent."""
    qk_head_dim: int = 128
    """Per-head query/key channels without position (the 'nope' part)."""
    qk_pos_emb_head_dim: int = 64
    """Per-head query/key channels rotated by RoPE (the key's are shared by all heads)."""
    v_head_dim: int = 128
    rope_type: Optional[str] = None
    """'rope' or 'yarn' (multi-latent attention only); None: 'yarn' under multi-latent attention."""
    rotary_scaling_factor: float = 1.0
    """YaRN's context extension factor (s)."""
    mscale: float = 1.0
    """YaRN: cos/sin scale numerator 0.1*mscale*ln(s)+1 (over the mscale_all_dim one)."""
    mscale_all_dim: float = 0.0
    """YaRN: softmax scale multiplied by (0.1*mscale_all_dim*ln(s)+1)^2."""
    original_max_position_embeddings: int = 4096
    """YaRN: the context length the model was trained with before extension."""

    # Mamba-2 mixers of hybrid models (megatron/core/ssm).
    mamba_state_dim: int = 128
    """State size n of each head (--mamba-state-dim)."""
    mamba_head_dim: int = 64
    """Channels p per head (--mamba-head-dim)."""
    mamba_num_groups: int = 8
    """Groups sharing B and C (--mamba-num-groups)."""
    mamba_num_heads: Optional[int] = None
    """Heads (--mamba-num-heads); None: 2 * hidden_size / mamba_head_dim."""
    use_mamba_mem_eff_path: bool = True
    """Megatron's fused CUDA scan kernel; the plain PyTorch scan here computes the same either way."""
    beta_fast: float = 32.0
    """YaRN: frequencies turning more than this often over the original context keep their value."""
    beta_slow: float = 1.0
    """YaRN: frequencies turning less than this often are divided by rotary_scaling_factor."""

    # FP8 GEMMs in the transformer layers' linears (see megatron/core/quantization/recipes.py).
    fp8: Optional[str] = None
    """'e4m3' (every operand e4m3) or 'hybrid' (e5m2 output gradients) (--fp8-format); None: off."""
    fp8_recipe: str = "delayed"
    """'tensorwise' (current scaling), 'delayed' (amax history), 'blockwise' or 'mxfp8'."""
    fp8_margin: int = 0
    """Delayed scaling: the scale is divided by 2**margin."""
    fp8_interval: int = 1
    """Deprecated and ignored, as by Transformer Engine >= 1.8 and Megatron-core 0.16."""
    fp8_amax_history_len: int = 1
    """Delayed scaling: amaxes remembered per tensor."""
    fp8_amax_compute_algo: str = "most_recent"
    """Delayed scaling: the scale's amax is the history's 'max' or its 'most_recent' entry."""
    fp8_wgrad: bool = True
    """False (--no-fp8-wgrad): weight-gradient GEMMs in the activation dtype."""
    first_last_layers_bf16: bool = False
    """Keep the first num_layers_at_start_in_bf16 and last num_layers_at_end_in_bf16 layers out of FP8."""
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    fp4: Optional[str] = None
    """'e2m1' (--fp4-format): FP4 GEMMs with fp4_recipe instead of FP8; None: off."""
    fp4_recipe: str = "nvfp4"
    """'nvfp4': 16-element e2m1 blocks, e4m3 block scales times a per-tensor fp32 scale."""
    symmetric_ar_type: Optional[str] = None
    """'two_shot', 'one_shot' or 'multimem_all_reduce': NCCL symmetric-memory all-reduce kernels for the
    tensor-parallel linears on GPUs (a communication kernel: the sums are the same); None: the ordinary one."""
    transformer_impl: str = "transformer_engine"
    """'transformer_engine' (Megatron's default): the layers' linears are Transformer Engine's where it
    imports (``core/extensions/transformer_engine.py``), else the local ones; 'local': always the local ones."""
    heterogeneous_block_specs: bool = False
    """Layers differ in shape: ``TransformerBlock`` builds layer n with ``get_config_for_layer(n)`` (set by
    ``transformer/heterogeneous``'s ``HeterogeneousTransformerConfig``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_layers", "num_attention_heads"):
            require_positive(name, getattr(self, name))
        if not isinstance(self.hidden_size, int) or isinstance(self.hidden_size, bool) or self.hidden_size < 0:
            raise ValueError(f"hidden_size={self.hidden_size!r}: must be a positive integer (or 0, see require_width)")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        require_positive("num_query_groups", self.num_query_groups)
        compatibility.check(self)  # the pairs of features that do not combine (megatron/core/compatibility.py)
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
        self._check_pipeline_split()
        if self.symmetric_ar_type not in SYMMETRIC_AR_TYPES:
            raise ValueError(f"symmetric_ar_type={self.symmetric_ar_type!r}: must be one of {SYMMETRIC_AR_TYPES}")
        self._check_window()
        self._check_activation_clamp()
        self._check_cp_comm_type()
        self._check_moe()
        self._check_latent_attention()
        self._check_sparse_attention()
        check_deepseek_v4(self)
        self._check_multi_token_prediction()
        self._check_fp8()
        self._check_mamba()
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(
                f"transformer_impl={self.transformer_impl!r}: must be one of {TRANSFORMER_IMPLS} "
                "('inference_optimized' is not supported yet)"
            )
        if self.initialization_seed is not None and not self.use_cpu_initialization:
            raise ValueError(
                f"initialization_seed={self.initialization_seed} needs use_cpu_initialization=True "
                "(per-rank initialization draws from the model-parallel RNG instead)"
            )
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(self.init_method_std, self.num_layers)
        if self.embedding_init_method is None:
            # Word and position embeddings: N(0, std^2), std defaulting to init_method_std.
            if self.embedding_init_method_std is None:
                self.embedding_init_method_std = self.init_method_std
            if not self.embedding_init_method_std > 0:
                raise ValueError(f"embedding_init_method_std={self.embedding_init_method_std}: must be positive")
            self.embedding_init_method = init_method_normal(self.embedding_init_method_std)
        if self.apply_query_key_layer_scaling:
            self.attention_softmax_in_fp32 = True
        if self.fp32_residual_connection:
            # The residual stream, and so what pipeline stages exchange, stays in fp32.
            self.pipeline_dtype = torch.float32

    def require_width(self, who: str) -> None:
        """Raise naming ``who`` when ``hidden_size`` is 0.

        Megatron-core accepts ``hidden_size=0`` (its default) for configs that only carry parallel
        sizes and precision, e.g. to build gradient buffers over a model of plain layers; a
        transformer layer or embedding needs a width, so those refuse such a config.
        """
        if self.hidden_size == 0:
            raise ValueError(f"{who}: hidden_size=0 (the default) gives no width; set hidden_size")

    def _check_pipeline_split(self) -> None:
        """The three ways to shape pipeline stages exclude each other; a layout must hold this model."""
        uneven = (self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage) != (None, None)
        slots = self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split
        if uneven and slots:
            raise ValueError(
                "num_layers_in_first/last_pipeline_stage cannot be combined with "
                "account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split"
            )
        layout = self.pipeline_model_parallel_layout
        if layout is None and slots:  # the embedding / loss slots must split evenly over the stages
            pipeline_layer_assignment(
                self.num_layers,
                self.pipeline_model_parallel_size,
                self.virtual_pipeline_model_parallel_size,
                embedding_slot=self.account_for_embedding_in_pipeline_split,
                loss_slot=self.account_for_loss_in_pipeline_split,
            )
        if layout is None:
            return
        if uneven or slots:
            raise ValueError(
                f"pipeline_model_parallel_layout={layout!r} cannot be combined with "
                "num_layers_in_first/last_pipeline_stage or account_for_{embedding,loss}_in_pipeline_split"
            )
        pp = self.pipeline_model_parallel_size
        if isinstance(layout, str):
            layout = PipelineParallelLayerLayout.from_str(layout, pp)
        elif isinstance(layout, list):
            layout = PipelineParallelLayerLayout(layout, pp)
        vp = layout.virtual_pipeline_model_parallel_size
        if self.virtual_pipeline_model_parallel_size is None and vp > 1:
            self.virtual_pipeline_model_parallel_size = vp  # the layout says how many chunks (Megatron-LM's rule)
        if (self.virtual_pipeline_model_parallel_size or 1) != vp:
            raise ValueError(
                f"pipeline_model_parallel_layout={layout!r} has {vp} chunk(s) per pipeline rank, "
                f"virtual_pipeline_model_parallel_size={self.virtual_pipeline_model_parallel_size}"
            )
        layout.validate_layer_layout(self.num_layers, self.mtp_num_layers)
        self.pipeline_model_parallel_layout = layout

    def _check_activation_clamp(self) -> None:
        clamp = self.activation_func_clamp_value
        if clamp is None:
            return
        if not (isinstance(clamp, (int, float)) and math.isfinite(clamp) and clamp > 0):
            raise ValueError(f"activation_func_clamp_value={clamp!r}: must be a positive finite number")
        if not self.gated_linear_unit:
            raise ValueError(
                f"activation_func_clamp_value={clamp}: needs gated_linear_unit=True (it clamps the gate and up halves)"
            )

    def _check_window(self) -> None:
        if self.window_size is None:
            return
        window = tuple(self.window_size)
        if len(window) != 2 or not all(isinstance(w, int) and w >= -1 for w in window):
            raise ValueError(
                f"window_size={self.window_size!r}: need (left, right) integers, each >= 0 or -1 for unlimited"
            )
        self.window_size = window

    def _check_cp_comm_type(self) -> None:
        value = self.cp_comm_type
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if len(values) not in (1, self.num_layers):
            raise ValueError(f"cp_comm_type={value!r}: give one value or one per layer (num_layers={self.num_layers})")
        for one in values:
            if one not in CP_COMM_TYPES:
                raise ValueError(f"cp_comm_type={one!r}: must be one of {CP_COMM_TYPES}")
            sizes = self.hierarchical_context_parallel_sizes
            if one == "a2a+p2p" and self.context_parallel_size > 1 and (sizes is None or len(sizes) != 2):
                raise ValueError(
                    f"cp_comm_type='a2a+p2p' with hierarchical_context_parallel_sizes={sizes}: needs two sizes "
                    f"[a2a, p2p] whose product is context_parallel_size={self.context_parallel_size}"
                )
        self.cp_comm_type = values[0] if len(values) == 1 else values

    def _check_multi_token_prediction(self) -> None:
        if self.mtp_num_layers is None:
            return
        require_positive("mtp_num_layers", self.mtp_num_layers)

    def _check_latent_attention(self) -> None:
        if self.rope_type not in (None, "rope", "yarn"):
            raise ValueError(f"rope_type={self.rope_type!r}: must be 'rope' or 'yarn'")
        if not self.multi_latent_attention:
            return
        if self.attention_output_gate:
            raise ValueError(
                "attention_output_gate=True: not supported with multi_latent_attention=True (as in megatron-core)"
            )
        if self.rope_type is None:
            self.rope_type = "yarn"
        for name in (
            "kv_lora_rank",
            "qk_head_dim",
            "qk_pos_emb_head_dim",
            "v_head_dim",
            "original_max_position_embeddings",
        ):
            require_positive(name, getattr(self, name))
        if self.q_lora_rank is not None:
            require_positive("q_lora_rank", self.q_lora_rank)
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"qk_pos_emb_head_dim={self.qk_pos_emb_head_dim}: must be even (RoPE rotates pairs)")
        if self.rotary_scaling_factor < 1.0:
            raise ValueError(f"rotary_scaling_factor={self.rotary_scaling_factor}: must be >= 1")

    def _check_recompute(self) -> None:
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity={self.recompute_granularity!r}: must be 'full' or 'selective'")
        if self.recompute_method not in (None, "uniform", "block"):
            raise ValueError(f"recompute_method={self.recompute_method!r}: must be 'uniform' or 'block'")
        if self.recompute_granularity == "full":
            require_positive("recompute_num_layers", self.recompute_num_layers)

    def _check_fp8(self) -> None:
        """FP8/FP4 settings: known format, recipe and algorithm, bf16 layer counts (pairs: the matrix's)."""
        if self.fp4 is not None:
            self._check_fp4()
        if self.fp8 is None:
            return
        if self.fp8 not in FP8_FORMATS:
            raise ValueError(f"fp8={self.fp8!r}: must be one of {FP8_FORMATS}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"fp8_recipe={self.fp8_recipe!r}: must be one of {FP8_RECIPES}")
        if self.fp8_amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"fp8_amax_compute_algo={self.fp8_amax_compute_algo!r}: must be one of {AMAX_COMPUTE_ALGOS}"
            )
        require_positive("fp8_amax_history_len", self.fp8_amax_history_len)
        if self.fp8_margin < 0:
            raise ValueError(f"fp8_margin={self.fp8_margin}: must be >= 0")
        if self.first_last_layers_bf16:
            self._check_bf16_layers()

    def _check_mamba(self) -> None:
        """The Mamba sizes are positive (how they split is checked where a mixer is built)."""
        for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups"):
            require_positive(name, getattr(self, name))
        if self.mamba_num_heads is not None:
            require_positive("mamba_num_heads", self.mamba_num_heads)

    def _check_fp4(self) -> None:
        """FP4 settings: e2m1 with a known recipe (FP8 or fp32 beside it: the matrix's rows)."""
        if self.fp4 not in FP4_FORMATS:
            raise ValueError(f"fp4={self.fp4!r}: must be one of {FP4_FORMATS}")
        if self.fp4_recipe not in FP4_RECIPES:
            raise ValueError(f"fp4_recipe={self.fp4_recipe!r}: must be one of {FP4_RECIPES}")

    def _check_bf16_layers(self) -> None:
        """Megatron's rule for first_last_layers_bf16: counts within a stage (delayed scaling: the matrix's)."""
        per_stage = self.num_layers // self.pipeline_model_parallel_size
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            value = getattr(self, name)
            if not 0 <= value <= per_stage:
                raise ValueError(
                    f"{name}={value}: must be between 0 and the layers per pipeline stage "
                    f"(num_layers={self.num_layers} / pipeline_model_parallel_size="
                    f"{self.pipeline_model_parallel_size} = {per_stage})"
                )


@dataclass
class MLATransformerConfig(TransformerConfig):
    """A ``TransformerConfig`` with multi-latent attention on, and Megatron-core's MLA defaults.

    The MLA fields live on ``TransformerConfig`` (the command line fills them there); this class
    only changes defaults: RMSNorm, YaRN, ranks 512, head dims 128/64/128, scaling factor 40.
    """

    multi_latent_attention: bool = True
    q_lora_rank: Optional[int] = 512
    kv_lora_rank: int = 512
    normalization: str = "RMSNorm"
    rope_type: Optional[str] = "yarn"
    rotary_scaling_factor: float = 40.0
