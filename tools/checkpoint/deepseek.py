"""DeepSeek-V3 as data: its multi-latent attention, YaRN and MoE router settings, both ways.

``DeepseekV3ForCausalLM`` is a Llama-family decoder (``llama_family.py``) whose attention is MLA
(its latent norms are our ``--qk-layernorm``) and whose MoE layers, after ``first_k_dense_replace``
dense ones, route with sigmoid scores, an ``e_score_correction_bias`` (our expert bias), groups
ranked by the sum of their two best scores (so ``--moe-router-topk`` = 2 x ``--moe-router-group-topk``),
renormalised top-k weights times ``routed_scaling_factor``, plus shared experts. What Megatron has
no flag for (YaRN's ``original_max_position_embeddings`` and betas) must hold Megatron's defaults.
``DeepseekV32ForCausalLM`` adds DeepSeek Sparse Attention's lightning indexer (``DSA_FIELDS``).
"""

from __future__ import annotations

from typing import Any, Dict, List

from tools.checkpoint.errors import Args, ConversionError, require_field

# YaRN parameters without a Megatron flag: MLATransformerConfig's defaults, which a converted model gets.
YARN_FIXED = (("original_max_position_embeddings", 4096), ("beta_fast", 32), ("beta_slow", 1))
MLA_DIMS = (  # (our flag destination, HF field)
    ("q_lora_rank", "q_lora_rank"),
    ("kv_lora_rank", "kv_lora_rank"),
    ("qk_head_dim", "qk_nope_head_dim"),
    ("qk_pos_emb_head_dim", "qk_rope_head_dim"),
    ("v_head_dim", "v_head_dim"),
)

DSA_FIELDS = (  # (our flag destination, HF field) of DeepSeek-V3.2's indexer
    ("dsa_indexer_n_heads", "index_n_heads"),
    ("dsa_indexer_head_dim", "index_head_dim"),
    ("dsa_indexer_topk", "index_topk"),
)


def _yarn_scales(rope: Dict[str, Any], where: str) -> Dict[str, float]:
    """``--mscale``/``--mscale-all-dim`` computing what transformers computes from ``mscale``/``mscale_all_dim``
    (it uses both only when both are set, else the plain ``0.1 ln(s) + 1`` for cos/sin)."""
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if rope.get("attention_factor") is not None or (all_dim and not mscale):
        raise ConversionError(
            f"{where}: field 'rope_parameters' has attention_factor={rope.get('attention_factor')!r}, "
            f"mscale={mscale!r}, mscale_all_dim={all_dim!r}; supported: no attention_factor, and mscale set "
            "whenever mscale_all_dim is"
        )
    return (
        dict(mscale=float(mscale), mscale_all_dim=float(all_dim)) if all_dim else dict(mscale=1.0, mscale_all_dim=0.0)
    )


def mla_args_from_hf(hf: Dict[str, Any], where: str) -> Args:
    """Attention and RoPE flags (by destination) of a DeepSeek-V3 config."""
    require_field(hf, "rope_interleave", (None, True), where)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    require_field({"rope_type": kind}, "rope_type", ("default", "yarn"), where + " rope_parameters")
    args: Args = {dest: hf.get(field) for dest, field in MLA_DIMS}
    args.update(
        multi_latent_attention=True,
        rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_type="yarn" if kind == "yarn" else "rope",
        kv_channels=hf["hidden_size"] // hf["num_attention_heads"],  # unused by MLA
    )
    if kind == "yarn":
        for field, value in YARN_FIXED:
            require_field({field: rope.get(field, value)}, field, (value,), where + " rope_parameters")
        if rope.get("factor") is None:
            raise ConversionError(f"{where}: field 'rope_parameters.factor' is missing (YaRN's scaling factor)")
        args.update(rotary_scaling_factor=float(rope["factor"]), **_yarn_scales(rope, where))
    return args


def dsa_args_from_hf(hf: Dict[str, Any]) -> Args:
    """DeepSeek Sparse Attention flags (by destination) of a DeepSeek-V3.2 config."""
    return dict({dest: hf[field] for dest, field in DSA_FIELDS}, experimental_attention_variant="dsa")


def _first_dense(hf: Dict[str, Any], num_layers: int, where: str) -> int:
    """The leading dense layers: ``first_k_dense_replace``, or V3.2's ``mlp_layer_types`` (dense first)."""
    dense = hf.get("first_k_dense_replace") or 0
    types = hf.get("mlp_layer_types")
    if types is not None:
        dense = types.count("dense")
        if list(types) != ["dense"] * dense + ["sparse"] * (num_layers - dense):
            raise ConversionError(f"{where}: field 'mlp_layer_types' is {types!r}; supported: dense layers first")
    return dense


def moe_args_from_hf(hf: Dict[str, Any], num_layers: int, where: str) -> Args:
    """MoE flags (by destination) of a DeepSeek-V3 config."""
    require_field(hf, "norm_topk_prob", (True,), where)  # our sigmoid routing renormalises the top k
    topk, groups, group_topk = hf["num_experts_per_tok"], hf.get("n_group") or 1, hf.get("topk_group") or 1
    if groups > 1 and topk != 2 * group_topk:
        raise ConversionError(
            f"{where}: fields num_experts_per_tok={topk}, topk_group={group_topk}: transformers ranks groups by their "
            "2 best scores, Megatron by their num_experts_per_tok/topk_group best; supported: equal (2)"
        )
    if topk < 2:
        raise ConversionError(f"{where}: field 'num_experts_per_tok' is {topk}; supported: >= 2 (renormalised)")
    dense = _first_dense(hf, num_layers, where)
    shared = (hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"]
    return dict(
        num_experts=hf["n_routed_experts"],
        moe_router_topk=topk,
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_router_pre_softmax=False,
        moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=group_topk if groups > 1 else None,
        moe_router_enable_expert_bias=True,
        moe_shared_expert_intermediate_size=shared or None,
        moe_layer_freq=1 if dense == 0 else [0] * dense + [1] * (num_layers - dense),
    )


def moe_model_kwargs(args: Args) -> Dict[str, Any]:
    """The MoE fields of ``TransformerConfig`` that change what the weights compute (none without experts)."""
    if not args.get("num_experts"):
        return {}
    return dict(
        num_moe_experts=args["num_experts"],
        moe_router_topk=args["moe_router_topk"],
        moe_ffn_hidden_size=args.get("moe_ffn_hidden_size"),
        moe_router_pre_softmax=bool(args.get("moe_router_pre_softmax")),
        moe_router_topk_scaling_factor=args.get("moe_router_topk_scaling_factor"),
        moe_layer_freq=args.get("moe_layer_freq", 1),
        moe_router_score_function=args.get("moe_router_score_function") or "softmax",
        moe_router_num_groups=args.get("moe_router_num_groups"),
        moe_router_group_topk=args.get("moe_router_group_topk"),
        moe_router_enable_expert_bias=bool(args.get("moe_router_enable_expert_bias")),
        moe_shared_expert_intermediate_size=args.get("moe_shared_expert_intermediate_size"),
        moe_shared_expert_gate=bool(args.get("moe_shared_expert_gate")),
    )


def mla_flags(args: Args) -> List[Any]:
    """``pretrain_gpt.py`` flags of the multi-latent attention ``args`` describe (none without it)."""
    if not args.get("multi_latent_attention"):
        return []
    flags: List[Any] = ["--multi-latent-attention"]
    for dest, _ in MLA_DIMS:
        if args.get(dest) is not None:
            flags += ["--" + dest.replace("_", "-"), args[dest]]
    flags += ["--rope-type", args.get("rope_type") or "yarn"]
    if args.get("experimental_attention_variant") == "dsa":
        flags += ["--experimental-attention-variant", "dsa"]
        for dest, _ in DSA_FIELDS:
            flags += ["--" + dest.replace("_", "-"), args[dest]]
    if (args.get("rope_type") or "yarn") == "yarn":
        for dest in ("rotary_scaling_factor", "mscale", "mscale_all_dim"):
            flags += ["--" + dest.replace("_", "-"), args[dest]]
    return flags


def router_flags(args: Args) -> List[Any]:
    """Flags of the sigmoid / grouped / biased router and shared experts ``args`` describe."""
    flags: List[Any] = []
    if args.get("moe_router_score_function", "softmax") != "softmax":
        flags += ["--moe-router-score-function", args["moe_router_score_function"]]
    for dest in ("moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk"):
        if args.get(dest) is not None:
            flags += ["--" + dest.replace("_", "-"), args[dest]]
    if args.get("moe_router_enable_expert_bias"):
        flags.append("--moe-router-enable-expert-bias")
    if args.get("moe_shared_expert_intermediate_size"):
        flags += ["--moe-shared-expert-intermediate-size", args["moe_shared_expert_intermediate_size"]]
    return flags


def hf_config_fields(args: Args, pattern: List[int], where: str, dsa: bool = False) -> Dict[str, Any]:
    """The ``DeepseekV3Config`` fields beyond Llama's for ``args`` (``pattern``: 0/1 per layer, 1 = MoE);
    ``dsa``: ``DeepseekV32Config``'s (the indexer's, and no ``rope_interleave``: always interleaved)."""
    dense = pattern.index(1) if 1 in pattern else len(pattern)
    if pattern != [0] * dense + [1] * (len(pattern) - dense):
        raise ConversionError(f"{where}: flag moe_layer_freq is {pattern}; DeepSeek-V3 needs dense layers first")
    moe_ffn = args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"]
    shared = args.get("moe_shared_expert_intermediate_size") or 0
    if shared % moe_ffn or args.get("moe_shared_expert_gate"):
        raise ConversionError(
            f"{where}: flags moe_shared_expert_intermediate_size={shared}, moe_shared_expert_gate="
            f"{args.get('moe_shared_expert_gate')}; DeepSeek-V3 needs ungated shared experts, a multiple of {moe_ffn}"
        )
    rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": float(args["rotary_base"])}
    if (args.get("rope_type") or "yarn") == "yarn":
        rope.update(rope_type="yarn", factor=args["rotary_scaling_factor"], **dict(YARN_FIXED))
        rope.update(mscale=args["mscale"], mscale_all_dim=args["mscale_all_dim"])
    if dsa:
        extra = {field: args[dest] for dest, field in DSA_FIELDS}
    else:
        extra = dict(rope_interleave=True)
    return dict(
        {field: args.get(dest) for dest, field in MLA_DIMS},
        **extra,
        n_routed_experts=args["num_experts"],
        num_experts_per_tok=args["moe_router_topk"],
        moe_intermediate_size=moe_ffn,
        n_shared_experts=shared // moe_ffn,
        routed_scaling_factor=args.get("moe_router_topk_scaling_factor") or 1.0,
        n_group=args.get("moe_router_num_groups") or 1,
        topk_group=args.get("moe_router_group_topk") or 1,
        first_k_dense_replace=dense,
        norm_topk_prob=True,
        rope_parameters=rope,
    )


def mla_model_kwargs(args: Args) -> Dict[str, Any]:
    """The ``TransformerConfig`` fields of multi-latent attention (none without it)."""
    if not args.get("multi_latent_attention"):
        return {}
    kwargs = {dest: args[dest] for dest, _ in MLA_DIMS if args.get(dest) is not None}
    kwargs.update(multi_latent_attention=True, rope_type=args.get("rope_type"))
    if args.get("experimental_attention_variant") == "dsa":
        kwargs.update({dest: args[dest] for dest, _ in DSA_FIELDS}, experimental_attention_variant="dsa")
    for dest in ("rotary_scaling_factor", "mscale", "mscale_all_dim"):
        if args.get(dest) is not None:
            kwargs[dest] = args[dest]
    return kwargs
