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
from megatron.core.transformer import moe_choices
from megatron.core.transformer.deepseek_v4_checks import check_deepseek_v4
from megatron.core.transformer.layer_layout import pipeline_layer_assignment
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


def linear_attention_layer(freq: Union[int, List[int]], layer_number: int) -> bool:
    """Whether global 1-based ``layer_number`` is a linear-attention (Gated DeltaNet) layer by ``freq``
    (Megatron's ``linear_attention_freq``: every ``freq``-th layer is full attention, or one 0/1 entry per layer)."""
    if isinstance(freq, int):
        return layer_number % freq != 0
    return bool(freq[layer_number - 1])


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

    # Mixture of experts (experts split over EP and expert-TP = TP; see moe/moe_layer.py).
    num_moe_experts: Optional[int] = None
    """Experts per MoE layer (--num-experts); None: dense MLPs."""
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    """Each expert's MLP width; default ffn_hidden_size."""
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_router_pre_softmax: bool = False
    """True: softmax over all experts, then top-k. False: top-k logits, softmax over those k."""
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_score_function: str = "softmax"
    """'softmax' or 'sigmoid' (top-k sigmoid scores renormalised); see moe/routing.py."""
    moe_router_num_groups: Optional[int] = None
    """Group-limited routing: experts in this many equal groups (with moe_router_group_topk)."""
    moe_router_group_topk: Optional[int] = None
    """Groups each token may route into: those with the largest sums of their topk/group_topk best scores."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias (sigmoid routing only) picks the experts, updated each step."""
    moe_router_bias_update_rate: float = 1e-3
    """How far each step moves the expert bias (sign of mean count minus the expert's count)."""
    moe_hash_router_vocab_size: Optional[int] = None
    """Token ids covered by a HashRouter's frozen token -> experts table (DeepSeek-V4 hash_moe); None: none."""
    moe_router_dtype: Optional[str] = None
    """'fp32' or 'fp64': router logits and routing computed in that dtype; None: the model's."""
    moe_router_force_load_balancing: bool = False
    """Benchmarking only: route on random logits (balanced on average), gradient straight through."""
    moe_input_jitter_eps: Optional[float] = None
    """Multiply router inputs by noise uniform in [1 - eps, 1 + eps] (in eval too, as Megatron does)."""
    moe_token_dispatcher_type: str = "allgather"
    """'allgather' or 'alltoall': the same computation here (tokens all-gathered over EP)."""
    moe_layer_freq: Union[int, List[int]] = 1
    """N: layers 0, N, 2N... (0-based) are MoE; or one 0/1 entry per layer."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of the shared experts' MLP (all shared experts as one), run on every token; None: none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(x . w), a learned [1, h] gate (Qwen2-MoE)."""
    moe_shared_expert_overlap: bool = False
    """Overlap the shared experts with dispatch on GPU streams; the same result (sequential here)."""
    moe_expert_capacity_factor: Optional[float] = None
    """Each expert keeps at most ceil(T * topk / E * factor) of a rank's T routed tokens; None (or < 0): dropless."""
    moe_token_drop_policy: str = "probs"
    """Which pairs an expert keeps: 'probs' (largest routing probs) or 'position' (earliest tokens)."""
    moe_pad_expert_input_to_capacity: bool = False
    """Pad each expert's tokens to its capacity with weight-0 tokens: the same result, fixed shapes."""
    moe_grouped_gemm: bool = False
    """Run the local experts as one grouped GEMM per projection (torch._grouped_mm), else a loop."""

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

    def _check_sinkhorn(self) -> None:
        """Sinkhorn routing picks experts itself: the settings of the other routers would be ignored."""
        if self.moe_router_load_balancing_type != "sinkhorn":
            return
        ignored = {
            "moe_aux_loss_coeff": (self.moe_aux_loss_coeff, 0.0),
            "moe_router_enable_expert_bias": (self.moe_router_enable_expert_bias, False),
            "moe_router_num_groups": (self.moe_router_num_groups, None),
            "moe_router_topk_scaling_factor": (self.moe_router_topk_scaling_factor, None),
            "moe_router_pre_softmax": (self.moe_router_pre_softmax, False),
            "moe_router_score_function": (self.moe_router_score_function, "softmax"),
        }
        for name, (value, default) in ignored.items():
            if value != default:
                raise ValueError(
                    f"{name}={value!r} does not apply with moe_router_load_balancing_type='sinkhorn' "
                    f"(Sinkhorn routing has no auxiliary loss and its own scores); leave it at {default!r}"
                )

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

    def _check_moe(self) -> None:
        if self.num_moe_experts is None:
            return
        require_positive("num_moe_experts", self.num_moe_experts)
        require_positive("moe_router_topk", self.moe_router_topk)
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(
                f"moe_router_topk={self.moe_router_topk} must be <= num_moe_experts={self.num_moe_experts}"
            )
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        require_positive("moe_ffn_hidden_size", self.moe_ffn_hidden_size)
        require_divisible(
            "moe_ffn_hidden_size",
            self.moe_ffn_hidden_size,
            "expert_tensor_parallel_size",
            self.expert_tensor_parallel_size,
        )
        choices = {
            "moe_router_load_balancing_type": moe_choices.BALANCE_TYPES,
            "moe_token_dispatcher_type": moe_choices.DISPATCHER_TYPES,
            "moe_router_score_function": moe_choices.SCORE_FUNCTIONS,
            "moe_router_dtype": moe_choices.ROUTER_DTYPES,
            "moe_token_drop_policy": moe_choices.DROP_POLICIES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be one of {allowed}")
        self._check_sinkhorn()
        if self.moe_aux_loss_coeff < 0 or (self.moe_z_loss_coeff is not None and self.moe_z_loss_coeff < 0):
            raise ValueError(
                f"moe_aux_loss_coeff={self.moe_aux_loss_coeff}, moe_z_loss_coeff="
                f"{self.moe_z_loss_coeff}: coefficients must be >= 0"
            )
        factor = self.moe_router_topk_scaling_factor
        if factor is not None and factor <= 0:
            raise ValueError(f"moe_router_topk_scaling_factor={factor}: must be > 0")
        self._check_router()
        self._check_capacity()
        self._check_shared_experts()
        require_divisible(
            "num_moe_experts", self.num_moe_experts, "expert_model_parallel_size", self.expert_model_parallel_size
        )
        self._check_moe_layer_freq()

    def _check_router(self) -> None:
        if self.moe_hash_router_vocab_size is not None:
            require_positive("moe_hash_router_vocab_size", self.moe_hash_router_vocab_size)
        eps = self.moe_input_jitter_eps
        if eps is not None and not 0 < eps < 1:
            raise ValueError(f"moe_input_jitter_eps={eps}: must be in (0, 1)")
        if (self.moe_router_num_groups is None) != (self.moe_router_group_topk is None):
            raise ValueError(
                f"moe_router_num_groups={self.moe_router_num_groups}, moe_router_group_topk="
                f"{self.moe_router_group_topk}: group-limited routing needs both"
            )
        if self.moe_router_group_topk is None:
            return
        groups, picked, k = self.moe_router_num_groups, self.moe_router_group_topk, self.moe_router_topk
        require_positive("moe_router_num_groups", groups)
        require_positive("moe_router_group_topk", picked)
        require_divisible("num_moe_experts", self.num_moe_experts, "moe_router_num_groups", groups)
        require_divisible("moe_router_topk", k, "moe_router_group_topk", picked)
        if picked > groups or k > picked * (self.num_moe_experts // groups):
            raise ValueError(
                f"moe_router_group_topk={picked}, moe_router_num_groups={groups}, moe_router_topk={k}: "
                "need group_topk <= num_groups and topk <= group_topk * experts per group"
            )

    def _check_capacity(self) -> None:
        factor = self.moe_expert_capacity_factor
        if factor is not None and factor < 0:
            self.moe_expert_capacity_factor = factor = None  # Megatron: a negative factor means dropless
        if factor == 0:
            raise ValueError("moe_expert_capacity_factor=0: must be > 0 (or negative / None for dropless)")

    def _check_shared_experts(self) -> None:
        size = self.moe_shared_expert_intermediate_size
        if size is None:
            return
        require_positive("moe_shared_expert_intermediate_size", size)
        require_divisible(
            "moe_shared_expert_intermediate_size", size, "tensor_model_parallel_size", self.tensor_model_parallel_size
        )

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

    def _check_moe_layer_freq(self) -> None:
        freq = self.moe_layer_freq
        if isinstance(freq, int) and not isinstance(freq, bool):
            require_positive("moe_layer_freq", freq)
            return
        pattern = list(freq)
        if len(pattern) != self.num_layers or any(p not in (0, 1) for p in pattern):
            raise ValueError(
                f"moe_layer_freq={freq!r}: a list needs one 0/1 entry per layer (num_layers={self.num_layers})"
            )
        self.moe_layer_freq = pattern

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether the global 1-based ``layer_number`` holds a MoE layer (``moe_layer_freq``)."""
        if self.num_moe_experts is None:
            return False
        if isinstance(self.moe_layer_freq, int):
            return (layer_number - 1) % self.moe_layer_freq == 0
        return bool(self.moe_layer_freq[layer_number - 1])

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
