"""DeepSeek-V4 (``DeepseekV4ForCausalLM``) as data: its ``config.json`` <-> our flags, both ways.

Every field of ``transformers``' ``DeepseekV4Config`` that changes what the model computes either maps to a
flag (``RENAMED``, and the derived ones below) or must hold the one value our model computes (``FIXED``),
else the conversion is refused naming the field and its value:

* attention: ``layer_types`` -> ``--compressed-attention-layer-types``, ``compress_rates`` -> ``--csa-compress-rate``
  / ``--hca-compress-rate``, ``sliding_window`` W -> ``--window-size W-1,0``, ``o_groups`` / ``o_lora_rank``,
  ``index_*`` -> ``--dsa-indexer-*``, ``partial_rotary_factor`` -> ``--rotary-percent`` (interleaved pairs,
  ``--rotary-interleaved``), ``rope_theta`` / ``compress_rope_theta`` -> ``--rotary-base`` /
  ``--compressed-attention-rotary-base``; ``rope_parameters`` must be unscaled (YaRN on the compressed
  branches is not implemented: refused);
* hyper-connections: ``hc_mult`` (>= 2), ``hc_sinkhorn_iters``, ``hc_eps``;
* MoE in every layer: ``mlp_layer_types`` (``hash_moe`` layers first) -> ``--moe-num-hash-layers``, the
  learned layers' ``scoring_func`` (``sqrtsoftplus`` or ``sigmoid``; transformers' ``softmax`` ranks
  softmax + bias, which Megatron's softmax routing does not: refused) with the expert bias, renormalised
  top k times ``routed_scaling_factor``; one shared expert of ``moe_intermediate_size``; ``swiglu_limit``
  -> ``--activation-func-clamp-value``.

Fields with no effect on ``DeepseekV4ForCausalLM``'s weights or logits are not read: ``num_nextn_predict_layers``
(transformers instantiates no MTP modules and its checkpoints hold none; exported as 0), the router's aux-loss
and jitter settings, ``initializer_range``, dropout, token ids and caching. The hash tables ``tid2eid``
follow the vocabulary padding (``hf_state_dict.resize_vocab``). The names are
``megatron/core/models/gpt/hf_deepseek_v4.py``'s.
"""

from __future__ import annotations

from typing import Any, Dict, List

from megatron.core.models.gpt.hf_state_dict import StateDict
from tools.checkpoint.errors import Args, ConversionError, require_field

KIND = "deepseek_v4"
HF_CLASS = "DeepseekV4ForCausalLM"
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
HASH, LEARNED = "hash_moe", "moe"
SCORE_FUNCTIONS = ("sqrtsoftplus", "sigmoid")  # transformers' choices our router computes alike

RENAMED = (  # (our flag destination, HF field): the same value both ways
    ("num_layers", "num_hidden_layers"),
    ("hidden_size", "hidden_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("kv_channels", "head_dim"),
    ("q_lora_rank", "q_lora_rank"),
    ("max_position_embeddings", "max_position_embeddings"),
    ("layernorm_epsilon", "rms_norm_eps"),
    ("rotary_percent", "partial_rotary_factor"),
    ("compressed_attention_rotary_base", "compress_rope_theta"),
    ("attention_output_groups", "o_groups"),
    ("attention_output_lora_rank", "o_lora_rank"),
    ("dsa_indexer_n_heads", "index_n_heads"),
    ("dsa_indexer_head_dim", "index_head_dim"),
    ("dsa_indexer_topk", "index_topk"),
    ("hyper_connection_streams", "hc_mult"),
    ("hyper_connection_sinkhorn_iterations", "hc_sinkhorn_iters"),
    ("hyper_connection_eps", "hc_eps"),
    ("num_experts", "n_routed_experts"),
    ("moe_router_topk", "num_experts_per_tok"),
    ("moe_ffn_hidden_size", "moe_intermediate_size"),
    ("moe_router_topk_scaling_factor", "routed_scaling_factor"),
    ("moe_router_score_function", "scoring_func"),
    ("activation_func_clamp_value", "swiglu_limit"),
)
FIXED = (  # (HF field, the values our model computes): one shared key/value head, one shared expert, ...
    ("hidden_act", ("silu",)),
    ("attention_bias", (None, False)),
    ("mlp_bias", (None, False)),
    ("num_key_value_heads", (None, 1)),
    ("n_shared_experts", (None, 1)),
    ("norm_topk_prob", (None, True)),
)
EXPECTED_ARGS: Args = dict(  # flag values (by destination) DeepseekV4ForCausalLM needs on export
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    add_bias_linear=False,
    add_qkv_bias=False,
    qk_layernorm=False,
    rotary_interleaved=True,
    multi_latent_attention=False,
    experimental_attention_variant=None,
    group_query_attention=False,
    moe_router_pre_softmax=False,
    moe_router_enable_expert_bias=True,
    moe_router_num_groups=None,
    moe_shared_expert_gate=False,
    moe_layer_freq=1,
)
# What a non-V4 export must not carry (the other families have no such parts).
NOT_V4_ARGS: Args = dict(
    compressed_attention_layer_types=None,
    hyper_connection_streams=1,
    moe_num_hash_layers=0,
    activation_func_clamp_value=None,
)


def _refuse(where: str, field: str, value: Any, rule: str) -> ConversionError:
    return ConversionError(f"{where}: field {field!r} is {value!r}; {rule}")


def _rope(hf: Dict[str, Any], where: str) -> None:
    """``rope_parameters`` (``main`` / ``compress``, as transformers nests them): unscaled, with the config's
    bases and ``partial_rotary_factor`` (the attention rotates ``head_dim * partial_rotary_factor`` channels)."""
    rope = hf.get("rope_parameters") or {}
    for label, theta in (("main", hf["rope_theta"]), ("compress", hf["compress_rope_theta"])):
        params = rope.get(label) or {}
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise _refuse(where, f"rope_parameters.{label}.rope_type", kind, "supported: 'default' (no YaRN yet)")
        for key, value in (("rope_theta", theta), ("partial_rotary_factor", hf["partial_rotary_factor"])):
            if params.get(key, value) != value:
                raise _refuse(where, f"rope_parameters.{label}.{key}", params[key], f"must equal {value}")


def _hash_layers(hf: Dict[str, Any], layers: int, where: str) -> int:
    """How many leading ``hash_moe`` layers ``mlp_layer_types`` has (the rest ``moe``)."""
    types = list(hf.get("mlp_layer_types") or [])
    count = types.count(HASH)
    if types != [HASH] * count + [LEARNED] * (layers - count):
        raise _refuse(where, "mlp_layer_types", types, f"supported: {HASH!r} layers first, then {LEARNED!r}")
    return count


def _as_transformers_reads(hf: Dict[str, Any], where: str) -> Dict[str, Any]:
    """``config.json`` as ``DeepseekV4Config`` reads it: defaults filled, legacy fields (``compress_ratios``,
    ``num_hash_layers``, ``qk_rope_head_dim``) folded in, ``rope_parameters`` nested."""
    import transformers

    try:
        return transformers.DeepseekV4Config(**hf).to_dict()
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{where}: DeepseekV4Config refuses it: {e}") from None


def args_from_hf(hf: Dict[str, Any], where: str) -> Args:
    """Model flags (by destination) of a ``DeepseekV4Config``; refuses what our model does not compute."""
    hf = _as_transformers_reads(hf, where)
    for field, allowed in FIXED:
        require_field(hf, field, allowed, where)
    if hf["scoring_func"] not in SCORE_FUNCTIONS:
        rule = f"supported: {' or '.join(SCORE_FUNCTIONS)} (softmax scores ranked with the expert bias are not ours)"
        raise _refuse(where, "scoring_func", hf["scoring_func"], rule)
    if hf["hc_mult"] < 2:
        raise _refuse(where, "hc_mult", hf["hc_mult"], "supported: >= 2 (hyper-connection streams)")
    _rope(hf, where)
    args: Args = {dest: hf[field] for dest, field in RENAMED}
    rates = hf.get("compress_rates") or {}
    heads, window = hf["num_attention_heads"], hf["sliding_window"]
    args.update(
        EXPECTED_ARGS,
        num_query_groups=heads,
        ffn_hidden_size=hf["moe_intermediate_size"],  # every layer is MoE; the shared expert's width
        moe_shared_expert_intermediate_size=hf["moe_intermediate_size"],
        rotary_base=float(hf["rope_theta"]),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        openai_gelu=False,
        compressed_attention_layer_types=list(hf["layer_types"]),
        csa_compress_rate=rates.get(CSA, 4),
        hca_compress_rate=rates.get(HCA, 128),
        window_size=(window - 1, 0),
        moe_num_hash_layers=_hash_layers(hf, hf["num_hidden_layers"], where),
    )
    return args


def read_weights(hf_dir: str) -> StateDict:
    """The tensors of a V4 directory under ``transformers``' in-memory names. Its files keep DeepSeek's
    original names (``attn.wq_a``, per-expert ``w1``/``w3``...), which ``from_pretrained`` renames and fuses;
    reading through it keeps one name table (``hf_deepseek_v4.py``'s). A missing, unexpected or mismatched
    tensor, and a hash table naming no expert, are refused by name."""
    import transformers

    try:
        model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(hf_dir, output_loading_info=True, dtype="auto")
    except (OSError, ValueError, RuntimeError) as e:
        raise ConversionError(f"{hf_dir}: transformers cannot load it: {str(e).splitlines()[0]}") from None
    bad = {kind: info[kind][:5] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(kind)}
    if bad:
        raise ConversionError(f"{hf_dir}: the weights do not fit config.json: {bad}")
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    experts = model.config.n_routed_experts
    for name, table in sd.items():
        if name.endswith(".tid2eid") and len(table) and not (0 <= int(table.min()) and int(table.max()) < experts):
            raise ConversionError(f"{hf_dir}: {name} holds expert ids outside [0, {experts})")
    return sd


# Flags of V4's own parts, the same name as the TransformerConfig field (printed and built as given).
OWN_FIELDS = (
    "q_lora_rank",
    "csa_compress_rate",
    "hca_compress_rate",
    "compressed_attention_rotary_base",
    "attention_output_groups",
    "attention_output_lora_rank",
    "dsa_indexer_n_heads",
    "dsa_indexer_head_dim",
    "dsa_indexer_topk",
    "hyper_connection_streams",
    "hyper_connection_sinkhorn_iterations",
    "hyper_connection_eps",
    "moe_num_hash_layers",
    "activation_func_clamp_value",
)


def flags(args: Args) -> List[Any]:
    """``pretrain_gpt.py`` flags of DeepSeek-V4's parts ``args`` describe (none for another model); the MoE,
    router, shared-expert and window flags come with the Llama family's (``llama_family.family_flags``)."""
    if not args.get("compressed_attention_layer_types"):
        return []
    out: List[Any] = ["--rotary-interleaved", "--rotary-percent", args["rotary_percent"]]
    out += ["--compressed-attention-layer-types", *args["compressed_attention_layer_types"]]
    for dest in OWN_FIELDS:
        out += ["--" + dest.replace("_", "-"), args[dest]]
    return out


def model_kwargs(args: Args) -> Dict[str, Any]:
    """``TransformerConfig`` fields of DeepSeek-V4's parts (none for another model; ``rotary_percent`` is
    ``qwen3_next.model_kwargs``', the MoE fields ``deepseek.moe_model_kwargs``')."""
    if not args.get("compressed_attention_layer_types"):
        return {}
    kwargs = {dest: args[dest] for dest in OWN_FIELDS}
    kwargs.update(
        rotary_interleaved=True,
        compressed_attention_layer_types=list(args["compressed_attention_layer_types"]),
        moe_hash_router_vocab_size=args["padded_vocab_size"] if args["moe_num_hash_layers"] else None,
    )
    return kwargs


def hf_config(args: Args, vocab_size: int, where: str) -> Any:
    """``DeepseekV4Config`` for the model ``args`` describe (checked by ``hf_config._check_supported`` first)."""
    import transformers

    if not args.get("compressed_attention_layer_types"):
        raise ConversionError(f"{where}: flag compressed_attention_layer_types is not set; {KIND} needs it")
    needs = {
        "moe_router_score_function": (args.get("moe_router_score_function") in SCORE_FUNCTIONS, SCORE_FUNCTIONS),
        "moe_shared_expert_intermediate_size": (
            args.get("moe_shared_expert_intermediate_size") == args.get("moe_ffn_hidden_size"),
            "moe_ffn_hidden_size (one shared expert)",
        ),
        "hyper_connection_streams": ((args.get("hyper_connection_streams") or 1) >= 2, ">= 2"),
        "activation_func_clamp_value": (args.get("activation_func_clamp_value") is not None, "a value (swiglu_limit)"),
    }
    for dest, (ok, need) in needs.items():
        if not ok:
            raise ConversionError(f"{where}: flag {dest} is {args.get(dest)!r}; --model-type {KIND} needs {need}")
    window = args.get("window_size")
    if window is None or tuple(window)[1] != 0:
        raise ConversionError(f"{where}: flag window_size is {window!r}; --model-type {KIND} needs (W-1, 0)")
    # Unset sizes (the indexer's without CSA layers) keep the class defaults: nothing reads them.
    fields = {field: args[dest] for dest, field in RENAMED if args.get(dest) is not None}
    hashes = args.get("moe_num_hash_layers") or 0
    fields.update(
        vocab_size=vocab_size,
        rope_theta=float(args["rotary_base"]),
        routed_scaling_factor=float(args.get("moe_router_topk_scaling_factor") or 1.0),
        layer_types=list(args["compressed_attention_layer_types"]),
        compress_rates={CSA: args["csa_compress_rate"], HCA: args["hca_compress_rate"]},
        sliding_window=int(window[0]) + 1,
        mlp_layer_types=[HASH] * hashes + [LEARNED] * (args["num_layers"] - hashes),
        tie_word_embeddings=not args["untie_embeddings_and_output_weights"],
        num_nextn_predict_layers=0,  # our export holds no MTP modules (refused before: mtp_num_layers)
        architectures=[HF_CLASS],
        **{field: allowed[-1] for field, allowed in FIXED},
    )
    return transformers.DeepseekV4Config(**fields)
