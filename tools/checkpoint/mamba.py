"""Hybrid Mamba models in the converter: our ``MambaModel`` (``pretrain_mamba.py``) <-> Hugging Face's
``Mamba2ForCausalLM`` (``mamba2``: Mamba layers only) and ``NemotronHForCausalLM`` (``nemotron_h``: Mamba,
attention, non-gated squared-ReLU MLP and MoE layers by its ``hybrid_override_pattern``).

The weights map name for name (``megatron/core/models/mamba/hf_state_dict.py``). Megatron's scan does not
clamp the step size ``dt``; Nemotron-H's ``time_step_min`` clamp and Mamba2's ``time_step_limit`` are written
as (practically) no clamp on export, and an imported config whose limit is not ``(0, inf)`` is converted with a note on
stderr (Megatron never clamped). Nemotron-H's MoE layers (``E``) route as DeepSeek-V3 does (sigmoid scores, expert
bias, group-limited top k, renormalised and scaled) with a non-gated shared expert; its latent MoE projection
(``moe_latent_size``) is refused.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List

from megatron.core.models.gpt.hf_state_dict import StateDict
from megatron.core.models.mamba import MambaModel
from megatron.core.models.mamba.hf_state_dict import (
    NEMOTRON_H_BLOCK_TYPES,
    from_hf_mamba2,
    from_hf_nemotron_h,
    to_hf_mamba2,
    to_hf_nemotron_h,
)
from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols, allocate_layers
from megatron.core.transformer.transformer_config import TransformerConfig
from tools.checkpoint.deepseek import moe_args_from_hf, moe_model_kwargs, router_flags
from tools.checkpoint.errors import Args, ConversionError

ARCHITECTURES = {"Mamba2ForCausalLM": "mamba2", "NemotronHForCausalLM": "nemotron_h"}
MAMBA_KINDS = tuple(ARCHITECTURES.values())
FINAL_NORM_KEY = "decoder.final_norm.weight"  # in a checkpoint: a MambaModel
NO_CLAMP = 1e-9  # Nemotron-H's time_step_min on export: its dt clamp, practically none (0 breaks HF's init)
_HF_SYMBOLS = {
    **{name: symbol for symbol, name in NEMOTRON_H_BLOCK_TYPES.items()},
    "mamba": Symbols.MAMBA,
    "attention": Symbols.ATTENTION,
}


def _pattern(hf: Dict[str, Any], kind: str, where: str) -> str:
    if kind == "mamba2":
        return Symbols.MAMBA * hf["num_hidden_layers"]
    types = hf.get("layers_block_type") or hf.get("layer_types")
    pattern = "".join(_HF_SYMBOLS.get(t, "?") for t in types) if types else hf.get("hybrid_override_pattern", "")
    if not pattern or "?" in pattern:
        raise ConversionError(f"{where}: field 'layers_block_type' is {types!r}; expected mamba/attention/mlp layers")
    return pattern


def _moe_args(hf: Dict[str, Any], pattern: str, where: str) -> Args:
    """The MoE flags (by destination) of a Nemotron-H config with MoE layers (none without)."""
    if Symbols.MOE not in pattern:
        return {}
    if hf.get("moe_latent_size") is not None:
        raise ConversionError(f"{where}: field 'moe_latent_size' is {hf['moe_latent_size']}; supported: null")
    args = moe_args_from_hf(hf, len(pattern), where)  # DeepSeek-V3's router fields
    del args["moe_layer_freq"]  # the pattern places the MoE layers
    return dict(args, moe_shared_expert_intermediate_size=hf["moe_shared_expert_intermediate_size"])


def mamba_args(hf: Dict[str, Any], where: str, kind: str) -> Args:
    """Model flags (by destination) of ``pretrain_mamba.py`` for a Mamba2 or Nemotron-H config."""
    pattern = _pattern(hf, kind, where)
    hidden = hf["hidden_size"]
    if kind == "mamba2":
        heads, head_dim, state, mamba_heads = 1, hidden, hf["state_size"], hf["num_heads"]
        mamba_head_dim, groups, ffn, attn_heads, max_pos = hf["head_dim"], hf["n_groups"], 4 * hidden, 1, 4096
    else:
        attn_heads, head_dim = hf["num_attention_heads"], hf.get("head_dim") or hidden // hf["num_attention_heads"]
        heads, state, mamba_heads = hf["num_key_value_heads"], hf["ssm_state_size"], hf["mamba_num_heads"]
        mamba_head_dim, groups, ffn, max_pos = hf["mamba_head_dim"], hf["n_groups"], hf["intermediate_size"], 4096
        max_pos = hf.get("max_position_embeddings", max_pos)
    limit = hf.get("time_step_limit")
    low = limit[0] if isinstance(limit, (list, tuple)) and limit else 0
    clamped = isinstance(low, (int, float)) and low > 0  # (the upper end is written as a non-finite marker)
    if clamped or (kind == "nemotron_h" and hf.get("time_step_min", 0) > 0):
        print(
            f"note: {where}: Hugging Face clamps dt (time_step_limit/time_step_min); Megatron does not", file=sys.stderr
        )
    return dict(
        num_layers=len(pattern), hybrid_override_pattern=pattern, is_hybrid_model=True, hidden_size=hidden,
        num_attention_heads=attn_heads, group_query_attention=heads != attn_heads, num_query_groups=heads,
        kv_channels=head_dim, ffn_hidden_size=ffn, normalization="RMSNorm",
        layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5), add_bias_linear=False, swiglu=False,
        openai_gelu=False, squared_relu=kind == "nemotron_h", position_embedding_type="none",
        max_position_embeddings=max_pos, rotary_base=10000,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        mamba_state_dim=state, mamba_head_dim=mamba_head_dim, mamba_num_groups=groups, mamba_num_heads=mamba_heads,
        **_moe_args(hf, pattern, where),
    )  # fmt: skip


def layer_pattern(args: Args) -> str:
    """The model's layer symbols: the pattern, else what the ratios allocate (a checkpoint of a ratio run)."""
    return "".join(
        allocate_layers(
            args["num_layers"], args.get("hybrid_attention_ratio") or 0.0, args.get("hybrid_mlp_ratio") or 0.0,
            args.get("hybrid_override_pattern"),
        )
    )  # fmt: skip


def mamba_heads(args: Args) -> int:
    """``--mamba-num-heads``, or Megatron's default 2 * hidden / head dim."""
    return args.get("mamba_num_heads") or 2 * args["hidden_size"] // args["mamba_head_dim"]


def mamba_flags(args: Args) -> List[str]:
    """The ``pretrain_mamba.py`` flags that build the model ``args`` describes."""
    flags: List[Any] = [
        "--num-layers",
        args["num_layers"],
        "--hybrid-override-pattern",
        args["hybrid_override_pattern"],
    ]
    flags += ["--hidden-size", args["hidden_size"], "--num-attention-heads", args["num_attention_heads"]]
    flags += ["--kv-channels", args["kv_channels"], "--ffn-hidden-size", args["ffn_hidden_size"]]
    if args["group_query_attention"]:
        flags += ["--group-query-attention", "--num-query-groups", args["num_query_groups"]]
    flags += ["--mamba-state-dim", args["mamba_state_dim"], "--mamba-head-dim", args["mamba_head_dim"]]
    flags += ["--mamba-num-groups", args["mamba_num_groups"], "--mamba-num-heads", args["mamba_num_heads"]]
    flags += ["--normalization", "RMSNorm", "--norm-epsilon", args["layernorm_epsilon"], "--disable-bias-linear"]
    flags += ["--position-embedding-type", "none", "--max-position-embeddings", args["max_position_embeddings"]]
    flags += ["--squared-relu"] if args["squared_relu"] else []
    flags += ["--untie-embeddings-and-output-weights"] if args["untie_embeddings_and_output_weights"] else []
    flags += ["--make-vocab-size-divisible-by", args["make_vocab_size_divisible_by"]]
    flags += ["--tensor-model-parallel-size", args["tensor_model_parallel_size"]]
    if args.get("num_experts"):
        flags += ["--num-experts", args["num_experts"], "--moe-router-topk", args["moe_router_topk"]]
        flags += ["--moe-ffn-hidden-size", args["moe_ffn_hidden_size"], *router_flags(args)]
    return [str(f) for f in flags]


def _config(args: Args) -> TransformerConfig:
    from megatron.core.activations import squared_relu

    extra = {"activation_func": squared_relu} if args.get("squared_relu") else {}
    return TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"],
        num_attention_heads=args["num_attention_heads"], num_query_groups=args.get("num_query_groups"),
        kv_channels=args.get("kv_channels"), ffn_hidden_size=args["ffn_hidden_size"], normalization="RMSNorm",
        layernorm_epsilon=args["layernorm_epsilon"], add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, mamba_state_dim=args["mamba_state_dim"], mamba_head_dim=args["mamba_head_dim"],
        mamba_num_groups=args["mamba_num_groups"], mamba_num_heads=args.get("mamba_num_heads"),
        use_cpu_initialization=True, perform_initialization=False, transformer_impl="local", **extra,
        **moe_model_kwargs(args),
    )  # fmt: skip


def build_mamba(args: Args, groups: ProcessGroupCollection) -> MambaModel:
    """Our TP=1 ``MambaModel`` for ``args`` (weights are overwritten right after)."""
    return MambaModel(
        _config(args), mamba_stack_spec, args["padded_vocab_size"], args["max_position_embeddings"],
        hybrid_override_pattern=layer_pattern(args), pg_collection=groups,
        share_embeddings_and_output_weights=not args["untie_embeddings_and_output_weights"],
    )  # fmt: skip


def in_memory_names(hf_sd: StateDict, kind: str) -> StateDict:
    """Nemotron-H files keep the original ``backbone.`` prefix; ``transformers`` renames it to ``model.`` when
    loading, and so does this (the mappings use the module's names)."""
    if kind != "nemotron_h":
        return hf_sd
    return {("model." + k[len("backbone.") :] if k.startswith("backbone.") else k): v for k, v in hf_sd.items()}


def mamba_from_hf(hf_sd: StateDict, model: MambaModel) -> StateDict:
    types = model.decoder.layer_type_list
    if set(types) == {Symbols.MAMBA} and "backbone.embeddings.weight" in hf_sd:
        return from_hf_mamba2(hf_sd, len(types))
    return from_hf_nemotron_h(hf_sd, model.config, types)


def mamba_to_hf(sd: StateDict, args: Args, kind: str) -> StateDict:
    if kind == "mamba2":
        return to_hf_mamba2(sd, args["num_layers"])
    return to_hf_nemotron_h(sd, _config(args), list(layer_pattern(args)))


def mamba_hf_config(args: Args, kind: str, vocab_size: int) -> Any:
    """The ``transformers`` config of ``args``' model (no dt clamp: Megatron's scan has none)."""
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=args["hidden_size"], layer_norm_epsilon=args["layernorm_epsilon"],
        tie_word_embeddings=not args["untie_embeddings_and_output_weights"], n_groups=args["mamba_num_groups"],
        use_bias=False, use_conv_bias=True,
    )  # fmt: skip
    pattern, heads = layer_pattern(args), mamba_heads(args)
    if kind == "mamba2":
        if set(pattern) != {Symbols.MAMBA}:
            raise ConversionError(
                f"--model-type mamba2 needs Mamba layers only; the pattern is {args['hybrid_override_pattern']!r}"
            )
        return transformers.Mamba2Config(
            **common, num_hidden_layers=args["num_layers"], state_size=args["mamba_state_dim"],
            head_dim=args["mamba_head_dim"], num_heads=heads,
            expand=heads * args["mamba_head_dim"] // args["hidden_size"],
            time_step_limit=(0.0, float("inf")), architectures=["Mamba2ForCausalLM"],
        )  # fmt: skip
    return transformers.NemotronHConfig(
        **common, hybrid_override_pattern=pattern,
        num_attention_heads=args["num_attention_heads"], num_key_value_heads=args["num_query_groups"],
        head_dim=args["kv_channels"], mamba_num_heads=heads, mamba_head_dim=args["mamba_head_dim"],
        ssm_state_size=args["mamba_state_dim"], intermediate_size=args["ffn_hidden_size"],
        max_position_embeddings=args["max_position_embeddings"], mlp_hidden_act="relu2", time_step_min=NO_CLAMP,
        architectures=["NemotronHForCausalLM"], **_hf_moe_fields(args),
    )  # fmt: skip


def _hf_moe_fields(args: Args) -> Dict[str, Any]:
    """Nemotron-H's MoE fields for ``args`` (none without experts)."""
    if not args.get("num_experts"):
        return {}
    if args.get("moe_router_score_function") != "sigmoid" or not args.get("moe_router_enable_expert_bias"):
        raise ConversionError(
            f"flags moe_router_score_function={args.get('moe_router_score_function')!r}, moe_router_enable_expert_bias="
            f"{args.get('moe_router_enable_expert_bias')}: Nemotron-H's router needs 'sigmoid' with the expert bias"
        )
    return dict(
        n_routed_experts=args["num_experts"], num_experts_per_tok=args["moe_router_topk"],
        moe_intermediate_size=args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"],
        moe_shared_expert_intermediate_size=args.get("moe_shared_expert_intermediate_size") or 0,
        routed_scaling_factor=args.get("moe_router_topk_scaling_factor") or 1.0,
        n_group=args.get("moe_router_num_groups") or 1, topk_group=args.get("moe_router_group_topk") or 1,
        norm_topk_prob=True,
    )  # fmt: skip
