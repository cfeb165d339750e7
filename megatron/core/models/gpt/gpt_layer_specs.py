"""Layer specs for GPT: which classes make up a decoder layer.

The functions take Megatron-core's keyword arguments, and nothing else (an unknown keyword is a
``TypeError``). What they cannot build is refused with ``NotImplementedError`` naming the argument;
arguments that in Megatron only pick a GPU kernel are accepted and said so in the docstrings.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Optional, Tuple

from megatron.core.extensions import transformer_engine as te_ext
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.compressed_attention import CompressedAttention
from megatron.core.transformer.experimental_attention_variant.dsa import get_dsa_module_spec
from megatron.core.transformer.hyper_connection import HyperConnectionTransformerLayer
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.hash_router import HashRouter
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.norms import Norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.utils import refuse_unimplemented

NORMALIZATIONS = (None, "LayerNorm", "RMSNorm")


def get_gpt_layer_local_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = None,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    use_kitchen: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
) -> ModuleSpec:
    """Pure-PyTorch decoder layer (Megatron-core's keyword arguments); with ``num_experts`` its MLP is a ``MoELayer``.

    Args:
        num_experts: experts of the MoE MLP; None for a dense MLP.
        moe_grouped_gemm: Megatron's GroupedMLP runs all experts in one grouped GEMM; here the
            spec is the same and ``config.moe_grouped_gemm`` (``--moe-grouped-gemm``) picks the
            ``GroupedMLP`` kernel over the same per-expert ``MLP`` parameters. ``moe_use_legacy_grouped_gemm``
            picks between two such kernels and is accepted without effect.
        qk_layernorm: True builds the query/key norms, False builds none, None (our default) follows
            ``config.qk_layernorm``. False with ``config.qk_layernorm`` True is refused when the
            layer is built (Megatron would silently build no norms).
        fp8: deprecated in Megatron, which warns and ignores it; so do we.
        normalization: ``"LayerNorm"`` / ``"RMSNorm"`` pick a norm kernel in Megatron's local spec,
            whose norms still compute ``config.normalization``; ours always compute
            ``config.normalization``.
        multi_latent_attention: the attention is an ``MLASelfAttention`` (its config needs
            ``multi_latent_attention=True``; its latent norms follow ``config.qk_layernorm``).
        qk_l2_norm, use_kitchen, use_kitchen_attention, kitchen_attention_backend:
            only their defaults are implemented; another value raises ``NotImplementedError``.
    """
    refuse_unimplemented(
        "get_gpt_layer_local_spec",
        qk_l2_norm=(qk_l2_norm, False),
        use_kitchen=(use_kitchen, False),
        use_kitchen_attention=(use_kitchen_attention, False),
        kitchen_attention_backend=(kitchen_attention_backend, "sdpa"),
    )
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r}: must be one of {NORMALIZATIONS}")
    if fp8 is not None:
        warnings.warn("get_gpt_layer_local_spec: the fp8 argument is deprecated and has no effect", stacklevel=2)
    attention_params = {"attn_mask_type": AttnMaskType.causal}
    if qk_layernorm is not None and not multi_latent_attention:
        attention_params["qk_layernorm"] = bool(qk_layernorm)
    mlp = get_mlp_module_spec(use_te=False, num_experts=num_experts)
    if multi_latent_attention:  # its latent norms follow config.qk_layernorm
        self_attention = ModuleSpec(module=MLASelfAttention, params=attention_params)
    else:
        qk_norm = Norm if qk_layernorm else None
        attention = SelfAttentionSubmodules(q_layernorm=qk_norm, k_layernorm=qk_norm)
        self_attention = ModuleSpec(module=SelfAttention, params=attention_params, submodules=attention)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=Norm,
            self_attention=self_attention,
            pre_mlp_layernorm=Norm,
            mlp=mlp,
        ),
    )


def get_mlp_module_spec(
    use_te: Optional[bool] = True,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    fp8: Optional[str] = None,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
    use_te_op_fuser: Optional[bool] = False,
) -> ModuleSpec:
    """The MLP of a layer: dense ``MLP``, or with ``num_experts`` a ``MoELayer`` of ``MLP`` experts.

    Megatron-core's arguments. ``use_te``: a dense MLP's linears are Transformer Engine's when it
    imports (``core/extensions/transformer_engine.py``), else the local ones; experts always use the
    local ones. ``moe_grouped_gemm``, ``moe_use_legacy_grouped_gemm`` and ``use_te_op_fuser`` choose
    GPU kernels computing the same, so the spec is the same; ``fp8`` is deprecated in Megatron, which
    warns and ignores it, as here.
    """
    del moe_grouped_gemm, moe_use_legacy_grouped_gemm, use_te_op_fuser  # kernel choices (docstring)
    if fp8 is not None:
        warnings.warn("get_mlp_module_spec: the fp8 argument is deprecated and has no effect", stacklevel=2)
    if num_experts:
        return ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=MLP))
    if use_te and te_ext.is_te_available():
        return ModuleSpec(module=MLP, submodules=MLPSubmodules(*_te_linears()))
    return ModuleSpec(module=MLP, submodules=MLPSubmodules())


def _te_linears() -> Tuple[type, type]:
    """Transformer Engine's (column, row) parallel linears (imports TE)."""
    return te_ext.TEColumnParallelLinear, te_ext.TERowParallelLinear


def _with_te_linears(layer: ModuleSpec) -> ModuleSpec:
    """A local layer spec with Transformer Engine's linears in self-attention and a dense MLP.

    MLA's projections and MoE experts keep the local linears (and their own quantizers under FP8).
    """
    column, row = _te_linears()
    attention, mlp = layer.submodules.self_attention, layer.submodules.mlp
    if isinstance(attention.submodules, SelfAttentionSubmodules):
        attention.submodules = replace(attention.submodules, linear_qkv=column, linear_proj=row)
    if mlp.module is MLP:
        mlp.submodules = MLPSubmodules(column, None, row)
    return layer


def get_gpt_decoder_block_spec(
    config: TransformerConfig,
    use_transformer_engine: bool = False,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """One layer spec per layer of the model: MoE where ``config.moe_layer_freq`` says so, dense elsewhere;
    with ``experimental_attention_variant='gated_delta_net'``, a ``GatedDeltaNet`` in place of self-attention
    where ``config.linear_attention_freq`` says so.

    Megatron-core's arguments. ``use_transformer_engine``: Transformer Engine's linears where it
    imports (in self-attention and dense MLPs), else the local layers. Megatron returns only the
    specs of the layers of ``(pp_rank, vp_stage)``; ``TransformerBlock`` here picks its stage's
    layers from the full list itself, so both arguments are accepted and the list always covers
    every layer.
    """
    spec = _layer_specs(config, normalization, qk_l2_norm)
    if use_transformer_engine and te_ext.is_te_available():
        spec.layer_specs = [_with_te_linears(layer) for layer in spec.layer_specs]
    return spec


def _layer_specs(
    config: TransformerConfig, normalization: Optional[str], qk_l2_norm: Optional[bool]
) -> TransformerBlockSubmodules:
    """The local spec of every layer (each its own objects, so one can be changed alone)."""

    def layer(n: int) -> ModuleSpec:
        spec = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts if config.is_moe_layer(n) else None,
            qk_layernorm=config.qk_layernorm,
            multi_latent_attention=config.multi_latent_attention,
            normalization=normalization,
            qk_l2_norm=qk_l2_norm,
        )
        if config.experimental_attention_variant == "dsa":  # DeepSeek-V3.2: MLA with the lightning indexer
            spec.submodules.self_attention = get_dsa_module_spec(spec.submodules.self_attention)
        if config.is_linear_attention_layer(n):  # Qwen3-Next: Gated DeltaNet where linear_attention_freq says
            spec.submodules.self_attention = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules())
        return _deepseek_v4_parts(spec, config, n)

    return TransformerBlockSubmodules(layer_specs=[layer(n) for n in range(1, config.num_layers + 1)])


def _deepseek_v4_parts(spec: ModuleSpec, config: TransformerConfig, n: int) -> ModuleSpec:
    """Layer ``n``'s spec with DeepSeek-V4's parts the config asks for: compressed attention, the
    hyper-connection layer, a hash router in the first ``moe_num_hash_layers`` layers."""
    if config.compressed_attention_layer_types is not None:
        layer_type = config.compressed_attention_layer_types[n - 1]
        spec.submodules.self_attention = ModuleSpec(
            module=CompressedAttention, params={"attn_mask_type": AttnMaskType.causal, "layer_type": layer_type}
        )
    if config.hyper_connection_streams > 1:
        spec.module = HyperConnectionTransformerLayer
    if n <= config.moe_num_hash_layers:
        spec.submodules.mlp.submodules = replace(spec.submodules.mlp.submodules, router=HashRouter)
    return spec


def get_gpt_layer_with_transformer_engine_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = None,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
    qk_l2_norm: Optional[bool] = False,
    use_te_op_fuser: Optional[bool] = False,
    use_kitchen: bool = False,
    use_te_activation_func: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
) -> ModuleSpec:
    """The local layer with Transformer Engine's linears in self-attention and a dense MLP where TE
    imports (``core/extensions/transformer_engine.py``); without TE, the local layer.

    Megatron-core's arguments; ``use_te_op_fuser`` and ``use_te_activation_func`` choose TE kernels
    and are accepted; the rest mean what they mean in ``get_gpt_layer_local_spec``. Unlike
    Megatron's, the input norms stay separate modules (no fused ``TELayerNormColumnParallelLinear``),
    so parameter names are the local layer's.
    """
    settings = dict(locals())
    del settings["use_te_op_fuser"], settings["use_te_activation_func"]
    layer = get_gpt_layer_local_spec(**settings)
    return _with_te_linears(layer) if te_ext.is_te_available() else layer
