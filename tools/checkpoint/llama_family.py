"""The Llama-like Hugging Face decoders as data: what each adds to Llama, and its config both ways.

Every family here is Llama's layout (RMSNorm, SwiGLU, RoPE, grouped-query attention, no
linear biases) plus a few switches: Qwen2 a QKV bias (``--add-qkv-bias``), Qwen3 a per-head
RMSNorm on queries and keys (``--qk-layernorm``), Qwen3-MoE that and MoE MLPs (softmax
routing; ``norm_topk_prob`` renormalises the top k, which is our top-k-then-softmax, else
``--moe-router-pre-softmax``), Mistral a sliding window (``--window-size``), Mixtral that and
MoE MLPs in every layer (experts of ``intermediate_size``, the top k always renormalised),
DeepSeek-V3 multi-latent attention and a sigmoid router with shared experts (``deepseek.py``),
DeepSeek-V3.2 that and the sparse attention's lightning indexer, Qwen3-Next Qwen3-MoE with Gated DeltaNet
layers (``qwen3_next.py``).
The weight names are one mapping for all of them (``megatron.core.models.gpt.hf_state_dict``);
this module holds only what differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from tools.checkpoint import deepseek, qwen3_next
from tools.checkpoint.errors import Args, ConversionError


@dataclass(frozen=True)
class DecoderFamily:
    """One Hugging Face decoder class: its ``transformers`` names and what it adds to Llama."""

    hf_class: str
    config_class: str
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    moe: bool = False
    sliding_window: bool = False
    """Mistral/Mixtral: ``sliding_window`` W lets a query see the W keys up to itself (``--window-size W-1,0``)."""
    mixtral: bool = False
    """Mixtral's MoE config: ``num_local_experts``, every layer MoE, experts of ``intermediate_size``."""
    mla: bool = False
    """DeepSeek-V3: multi-latent attention (its latent norms are ``qk_layernorm``), DeepSeek's router."""
    dsa: bool = False
    """DeepSeek-V3.2: MLA with the lightning indexer (``--experimental-attention-variant dsa``)."""
    gdn: bool = False
    """Qwen3-Next: Gated DeltaNet layers, gated attention, 1+w norms, a gated shared expert (``qwen3_next.py``)."""
    config_extras: Tuple[Tuple[str, Any], ...] = field(default=())
    """Fields the config class has and our model fixes (biases off)."""


NO_ATTENTION_BIAS = (("attention_bias", False),)
DECODER_FAMILIES: Dict[str, DecoderFamily] = {
    "llama": DecoderFamily("LlamaForCausalLM", "LlamaConfig", config_extras=NO_ATTENTION_BIAS + (("mlp_bias", False),)),
    "qwen2": DecoderFamily("Qwen2ForCausalLM", "Qwen2Config", add_qkv_bias=True),
    "qwen3": DecoderFamily("Qwen3ForCausalLM", "Qwen3Config", qk_layernorm=True, config_extras=NO_ATTENTION_BIAS),
    "mistral": DecoderFamily("MistralForCausalLM", "MistralConfig", sliding_window=True),
    "qwen3_moe": DecoderFamily(
        "Qwen3MoeForCausalLM", "Qwen3MoeConfig", qk_layernorm=True, moe=True, config_extras=NO_ATTENTION_BIAS
    ),
    "qwen3_next": DecoderFamily(
        "Qwen3NextForCausalLM",
        "Qwen3NextConfig",
        qk_layernorm=True,
        moe=True,
        gdn=True,
        config_extras=NO_ATTENTION_BIAS,
    ),
    "mixtral": DecoderFamily("MixtralForCausalLM", "MixtralConfig", sliding_window=True, moe=True, mixtral=True),
    "deepseek_v3": DecoderFamily(
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        qk_layernorm=True,
        moe=True,
        mla=True,
        config_extras=NO_ATTENTION_BIAS,
    ),
    "deepseek_v32": DecoderFamily(
        "DeepseekV32ForCausalLM",
        "DeepseekV32Config",
        qk_layernorm=True,
        moe=True,
        mla=True,
        dsa=True,
        config_extras=NO_ATTENTION_BIAS,
    ),
}
ARCHITECTURES = {f.hf_class: kind for kind, f in DECODER_FAMILIES.items()}


def moe_args_from_hf(hf: Dict[str, Any], num_layers: int, mixtral: bool = False) -> Args:
    """MoE flags (by destination) of a Qwen3-MoE config: a layer is MoE unless listed in
    ``mlp_only_layers`` or skipped by ``decoder_sparse_step`` (layer i when (i+1) % step == 0).
    Mixtral's (``mixtral``): every layer MoE, the top k renormalised (our top-k-then-softmax)."""
    if mixtral:
        return dict(
            num_experts=hf["num_local_experts"],
            moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf["intermediate_size"],
            moe_router_pre_softmax=False,
            moe_layer_freq=1,
        )
    step, dense = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)]
    return dict(
        num_experts=hf["num_experts"]
        if "num_experts" in hf
        else hf["num_local_experts"],  # transformers v5 saves the latter
        moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
        moe_layer_freq=1 if all(pattern) else pattern,
    )


def window_from_hf(hf: Dict[str, Any], kind: str, where: str) -> Optional[Tuple[int, int]]:
    """``--window-size`` of a config's ``sliding_window`` W: ``(W-1, 0)``; None when it covers every position.

    Qwen configs carry a ``sliding_window`` that only ``use_sliding_window`` switches on (and then per layer:
    refused); Llama has none."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if window is None or window >= hf["max_position_embeddings"]:
        return None
    if not DECODER_FAMILIES[kind].sliding_window:
        raise ConversionError(
            f"{where}: field 'sliding_window' is {window}; sliding-window attention is supported for Mistral and "
            "Mixtral only (null or >= max_position_embeddings is)"
        )
    return (window - 1, 0)


def window_to_hf(args: Args, kind: str, where: str) -> Dict[str, Any]:
    """``sliding_window`` of the config of ``kind`` for ``--window-size`` (None: full causal attention)."""
    window = args.get("window_size")
    if not DECODER_FAMILIES[kind].sliding_window:
        if window is not None:
            raise ConversionError(f"{where}: flag window_size is {window!r}; --model-type {kind} has no sliding window")
        return {}
    if window is not None and (len(window) != 2 or window[1] != 0 or window[0] < 0):
        raise ConversionError(f"{where}: flag window_size is {window!r}; --model-type {kind} needs (W-1, 0)")
    return dict(sliding_window=None if window is None else int(window[0]) + 1)


def moe_pattern(args: Args) -> List[int]:
    """One 0/1 per layer: whether ``--moe-layer-freq`` makes it MoE (an int N: layers 0, N, 2N...)."""
    freq = args.get("moe_layer_freq", 1)
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(args["num_layers"])]
    return [int(p) for p in freq]


def family_flags(args: Args) -> List[Any]:
    """``pretrain_gpt.py`` flags for the QKV bias, query/key norms and MoE MLPs ``args`` describe."""
    flags: List[Any] = []
    if args.get("add_qkv_bias"):
        flags.append("--add-qkv-bias")
    if args.get("qk_layernorm"):
        flags.append("--qk-layernorm")
    if args.get("window_size") is not None:
        flags += ["--window-size", ",".join(map(str, args["window_size"]))]
    if args.get("num_experts"):
        flags += ["--num-experts", args["num_experts"], "--moe-router-topk", args["moe_router_topk"]]
        flags += ["--moe-ffn-hidden-size", args["moe_ffn_hidden_size"]]
        if args.get("moe_router_pre_softmax"):
            flags.append("--moe-router-pre-softmax")
        if args.get("moe_layer_freq", 1) != 1:
            flags += ["--moe-layer-freq", "[" + ",".join(map(str, moe_pattern(args))) + "]"]
        flags += deepseek.router_flags(args)
    return flags + deepseek.mla_flags(args) + qwen3_next.flags(args)


# What a Hugging Face MoE block cannot express (the router of transformers' Qwen3-MoE is a plain softmax;
# DeepSeek-V3's always sigmoid with the expert bias).
_HF_ROUTER = dict(
    moe_router_topk_scaling_factor=None,
    moe_router_score_function="softmax",
    moe_router_num_groups=None,
    moe_router_enable_expert_bias=False,
    moe_shared_expert_intermediate_size=None,
)
_DEEPSEEK_ROUTER = dict(
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_pre_softmax=False
)


def expected_args(kind: str) -> Args:
    """Flag values (by destination) the Hugging Face class of ``kind`` needs; ``_check_supported`` adds
    what all families share."""
    family = DECODER_FAMILIES[kind]
    expected: Args = dict(
        normalization="RMSNorm",
        position_embedding_type="rope",
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=family.add_qkv_bias,
        qk_layernorm=family.qk_layernorm,
        multi_latent_attention=family.mla,
        experimental_attention_variant="dsa" if family.dsa else None,
    )
    if family.mla:
        expected.update(_DEEPSEEK_ROUTER)
    elif family.moe:
        expected.update(_HF_ROUTER)
        if family.mixtral:  # Mixtral always renormalises the top k
            expected["moe_router_pre_softmax"] = False
        if family.gdn:  # Qwen3-Next: a gated shared expert, gated attention, 1+w norms, GDN layers
            del expected["moe_shared_expert_intermediate_size"]
            expected.update(
                experimental_attention_variant="gated_delta_net",
                attention_output_gate=True,
                layernorm_zero_centered_gamma=True,
            )
    else:
        expected["num_experts"] = None
    return expected


def config_fields(args: Args, kind: str, where: str) -> Dict[str, Any]:
    """The fields, beyond Llama's, of the ``transformers`` config of ``kind`` for ``args``."""
    family = DECODER_FAMILIES[kind]
    fields = dict(family.config_extras, **window_to_hf(args, kind, where))
    if family.mla:
        fields.update(deepseek.hf_config_fields(args, moe_pattern(args), where, family.dsa))
    elif family.mixtral:
        fields.update(_mixtral_config_fields(args, where))
    elif family.moe:
        pattern = moe_pattern(args)
        fields.update(
            num_experts=args["num_experts"],
            num_experts_per_tok=args["moe_router_topk"],
            moe_intermediate_size=args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"],
            norm_topk_prob=not args.get("moe_router_pre_softmax", False),
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
        )
    if family.gdn:
        fields.update(qwen3_next.hf_config_fields(args, where))
    return fields


def _mixtral_config_fields(args: Args, where: str) -> Dict[str, Any]:
    """``MixtralConfig``'s MoE fields; refuses what it cannot express (dense layers, expert FFN size)."""
    if not all(moe_pattern(args)):
        raise ConversionError(
            f"{where}: flag moe_layer_freq is {args.get('moe_layer_freq')!r}; "
            "--model-type mixtral needs every layer MoE"
        )
    moe_ffn = args.get("moe_ffn_hidden_size")
    if moe_ffn not in (None, args["ffn_hidden_size"]):
        raise ConversionError(
            f"{where}: flag moe_ffn_hidden_size is {moe_ffn}; --model-type mixtral needs it equal to "
            f"ffn_hidden_size ({args['ffn_hidden_size']}, Mixtral's intermediate_size)"
        )
    return dict(num_local_experts=args["num_experts"], num_experts_per_tok=args["moe_router_topk"])
