"""Hugging Face ``config.json`` <-> Megatron flags (as argparse destinations) for GPT-2, the Llama family
(Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3: ``tools/checkpoint/llama_family.py``), DeepSeek-V4
(``tools/checkpoint/deepseek_v4.py``), BERT and T5.

The Megatron side is a plain dict keyed by flag destination (``num_layers``,
``untie_embeddings_and_output_weights``, ...): the same keys ``pretrain_gpt.py`` stores
under ``args`` in a checkpoint's ``common.json`` (``pretrain_bert.py`` the same, plus
``bert_binary_head`` / ``bert_post_layernorm``, ``pretrain_t5.py`` its encoder/decoder flags),
so one reader serves both our converted checkpoints and trained ones.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Dict, List, Optional, Tuple

from megatron.core.activations import activation, activation_name
from megatron.core.tokenizers.gpt2_bpe import EOD_TOKEN
from megatron.training.validation import vocab_size_with_padding
from tools.checkpoint import deepseek, deepseek_v4, llama_family, mamba, qwen3_next
from tools.checkpoint.checks import check_hf_config, check_model_args, head_size
from tools.checkpoint.errors import Args, ConversionError, require_field
from tools.checkpoint.llama_family import DECODER_FAMILIES
from tools.checkpoint.t5 import t5_args

ARCHITECTURES = {
    "GPT2LMHeadModel": "gpt2",
    **llama_family.ARCHITECTURES,
    deepseek_v4.HF_CLASS: deepseek_v4.KIND,
    "BertForPreTraining": "bert",
    "BertForMaskedLM": "bert",
    "T5ForConditionalGeneration": "t5",
    **mamba.ARCHITECTURES,
}
BERT_CLASSES = {True: "BertForPreTraining", False: "BertForMaskedLM"}  # by binary head (pooler + NSP)
_GPT2_ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}  # -> --openai-gelu


def architecture_of(hf_config: Dict[str, Any], where: str) -> str:
    """``gpt2``, a Llama-family kind (``llama``, ``qwen2``...), ``bert`` or ``t5`` from ``architectures``."""
    names = hf_config.get("architectures") or []
    known = [ARCHITECTURES[n] for n in names if n in ARCHITECTURES]
    if not known:
        raise ConversionError(f"{where}: field 'architectures' is {names!r}; supported: {sorted(ARCHITECTURES)}")
    return known[0]


def _gpt2_like(num_layers: int, hidden: int, heads: int, ffn: int, max_positions: int, where: str) -> Args:
    """The layout GPT-2 and BERT share: LayerNorm, gelu MLP with biases, learned absolute positions, tied output."""
    return dict(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        group_query_attention=False,
        num_query_groups=heads,
        ffn_hidden_size=ffn,
        kv_channels=head_size(hidden, heads, where),
        normalization="LayerNorm",
        swiglu=False,
        openai_gelu=False,
        position_embedding_type="learned_absolute",
        rotary_base=10000,
        untie_embeddings_and_output_weights=False,
        add_bias_linear=True,
        max_position_embeddings=max_positions,
    )


def _gpt2_args(hf: Dict[str, Any], where: str) -> Args:
    require_field(hf, "activation_function", tuple(_GPT2_ACTIVATIONS), where)
    for field in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        require_field(hf, field, (None, False), where)
    require_field(hf, "tie_word_embeddings", (None, True), where)
    hidden = hf["n_embd"]
    args = _gpt2_like(hf["n_layer"], hidden, hf["n_head"], hf.get("n_inner") or 4 * hidden, hf["n_positions"], where)
    args.update(
        openai_gelu=_GPT2_ACTIVATIONS[hf["activation_function"]],
        layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
    )
    return args


def _rope_theta(hf: Dict[str, Any], where: str) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise ConversionError(
            f"{where}: field 'rope_parameters.rope_type' (or 'rope_scaling') is {kind!r}; "
            "only unscaled RoPE ('default') is supported"
        )
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _llama_args(hf: Dict[str, Any], where: str, kind: str = "llama") -> Args:
    """Flags of a Llama-family config; ``kind`` adds its QKV bias, query/key norms or MoE MLPs."""
    require_field(hf, "hidden_act", ("silu",), where)
    for field in ("attention_bias", "mlp_bias"):
        require_field(hf, field, (None, False), where)
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    family = DECODER_FAMILIES[kind]
    args = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        group_query_attention=groups != heads,
        num_query_groups=groups,
        ffn_hidden_size=hf["intermediate_size"],
        kv_channels=hf.get("head_dim") or head_size(hf["hidden_size"], heads, where),
        normalization="RMSNorm",
        swiglu=True,
        openai_gelu=False,
        position_embedding_type="rope",
        rotary_base=None if family.mla else _rope_theta(hf, where),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        add_bias_linear=False,
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        max_position_embeddings=hf["max_position_embeddings"],
        add_qkv_bias=family.add_qkv_bias,
        qk_layernorm=family.qk_layernorm,
        window_size=llama_family.window_from_hf(hf, kind, where),
    )
    if family.mla:
        args.update(deepseek.mla_args_from_hf(hf, where))
        args.update(deepseek.moe_args_from_hf(hf, args["num_layers"], where))
    elif family.moe:
        args.update(llama_family.moe_args_from_hf(hf, args["num_layers"], family.mixtral))
    if family.dsa:
        args.update(deepseek.dsa_args_from_hf(hf))
    if family.gdn:
        args.update(qwen3_next.args_from_hf(hf, where))
    return args


def _bert_args(hf: Dict[str, Any], where: str) -> Args:
    """Post-LN BERT (``pretrain_bert.py --bert-post-layernorm``); the binary head only for BertForPreTraining."""
    require_field(hf, "hidden_act", ("gelu",), where)  # the exact (erf) gelu: our F.gelu
    require_field(hf, "position_embedding_type", (None, "absolute"), where)
    for field in ("is_decoder", "add_cross_attention"):
        require_field(hf, field, (None, False), where)
    binary = BERT_CLASSES[True] in (hf.get("architectures") or [])
    if binary:
        require_field(hf, "type_vocab_size", (2,), where)  # pretrain_bert.py's binary head comes with 2 token types
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    args = _gpt2_like(
        hf["num_hidden_layers"], hidden, heads, hf["intermediate_size"], hf["max_position_embeddings"], where
    )
    args.update(
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
        layernorm_epsilon=hf.get("layer_norm_eps", 1e-12),
        seq_length=hf["max_position_embeddings"],
        hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        bert_binary_head=binary,
        bert_post_layernorm=True,
    )
    return args


_ARGS_OF = {"gpt2": _gpt2_args, "bert": _bert_args, "t5": t5_args, deepseek_v4.KIND: deepseek_v4.args_from_hf}
_ARGS_OF.update({kind: functools.partial(_llama_args, kind=kind) for kind in DECODER_FAMILIES})
_ARGS_OF.update({kind: functools.partial(mamba.mamba_args, kind=kind) for kind in mamba.MAMBA_KINDS})


def megatron_args_from_hf(hf: Dict[str, Any], where: str, tp: int, divisible_by: int) -> Tuple[str, Args]:
    """(kind, model flags by destination) of a HF config (kind as ``architecture_of``); vocab padded for ``tp``.

    The config's fields and the resulting flags go through ``checks`` (types, ranges, memory) first.
    """
    kind = architecture_of(hf, where)
    check_hf_config(hf, where)
    try:
        args = _ARGS_OF[kind](hf, where)
        vocab = hf["vocab_size"]
    except KeyError as e:
        raise ConversionError(f"{where}: field {e.args[0]!r} is missing") from None
    args.update(
        vocab_size=vocab,
        make_vocab_size_divisible_by=divisible_by,
        tensor_model_parallel_size=tp,
        padded_vocab_size=vocab_size_with_padding(vocab, divisible_by, tp),
    )
    check_model_args(args, where)
    return kind, args


def megatron_flags(args: Args) -> List[str]:
    """The ``pretrain_gpt.py`` (BERT: ``pretrain_bert.py``) flags that build the model ``args`` describes."""
    flags = [
        "--num-layers",
        args["num_layers"],
        "--hidden-size",
        args["hidden_size"],
        "--num-attention-heads",
        args["num_attention_heads"],
        "--ffn-hidden-size",
        args["ffn_hidden_size"],
        "--kv-channels",
        args["kv_channels"],
        "--max-position-embeddings",
        args["max_position_embeddings"],
        "--normalization",
        args["normalization"],
        "--norm-epsilon",
        args["layernorm_epsilon"],
        "--position-embedding-type",
        args["position_embedding_type"],
        "--make-vocab-size-divisible-by",
        args["make_vocab_size_divisible_by"],
        "--tensor-model-parallel-size",
        args["tensor_model_parallel_size"],
    ]
    if args["group_query_attention"]:
        flags += ["--group-query-attention", "--num-query-groups", args["num_query_groups"]]
    if args["position_embedding_type"] == "rope":
        flags += [
            "--rotary-base",
            int(args["rotary_base"]) if float(args["rotary_base"]).is_integer() else args["rotary_base"],
        ]
    for dest, flag in (
        ("swiglu", "--swiglu"),
        ("openai_gelu", "--openai-gelu"),
        ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ):
        if args.get(dest):
            flags.append(flag)
    if not args["add_bias_linear"]:
        flags.append("--disable-bias-linear")
    flags += llama_family.family_flags(args) + deepseek_v4.flags(args)
    if args.get("bert_post_layernorm"):
        flags += _bert_flags(args)
    return [str(f) for f in flags]


def _bert_flags(args: Args) -> List[Any]:
    """``pretrain_bert.py``'s own: post-LN layers, the binary head (or not), sequence length, dropout."""
    flags = ["--bert-post-layernorm", "--seq-length", args["seq_length"]]
    flags += ["--hidden-dropout", args["hidden_dropout"], "--attention-dropout", args["attention_dropout"]]
    return flags + ([] if args["bert_binary_head"] else ["--bert-no-binary-head"])


def _check_supported(args: Args, kind: str, where: str) -> None:
    """Refuse model features the HF class of ``kind`` cannot express, naming the flag."""
    shared = dict(
        add_qkv_bias=False,
        qk_layernorm=False,
        rotary_interleaved=False,
        squared_relu=False,
        layernorm_zero_centered_gamma=False,
        rotary_percent=1.0,
        multi_latent_attention=False,
        mtp_num_layers=None,  # transformers' models hold no multi-token prediction modules
        **deepseek_v4.NOT_V4_ARGS,
    )
    if kind in DECODER_FAMILIES:
        shared.update(llama_family.expected_args(kind))
        if DECODER_FAMILIES[kind].gdn:  # Qwen3-Next rotates partial_rotary_factor of each head
            del shared["rotary_percent"]
        if DECODER_FAMILIES[kind].moe and not args.get("num_experts"):
            raise ConversionError(f"{where}: flag num_experts is not set; --model-type {kind} needs MoE layers")
    elif kind == deepseek_v4.KIND:
        shared.update(deepseek_v4.EXPECTED_ARGS)
        for dest in ("rotary_percent", *deepseek_v4.NOT_V4_ARGS):
            del shared[dest]
    else:
        shared.update(num_experts=None, window_size=None)
    expected = {
        "gpt2": dict(
            normalization="LayerNorm",
            position_embedding_type="learned_absolute",
            swiglu=False,
            add_bias_linear=True,
            untie_embeddings_and_output_weights=False,
        ),
        "bert": dict(
            normalization="LayerNorm",
            position_embedding_type="learned_absolute",
            swiglu=False,
            openai_gelu=False,
            add_bias_linear=True,
            bert_post_layernorm=True,  # Hugging Face's BERT is post-LN; Megatron's default pre-LN BERT is not
            group_query_attention=False,
        ),
    }.get(kind, {})
    expected = {**shared, **expected}
    for dest, value in expected.items():
        if dest in args and args[dest] is not None and args[dest] != value:
            raise ConversionError(f"{where}: flag {dest} is {args[dest]!r}; --model-type {kind} needs {value!r}")


def query_groups(args: Args) -> int:
    """Megatron ignores ``--num-query-groups`` without ``--group-query-attention``."""
    return args["num_query_groups"] if args.get("group_query_attention") else args["num_attention_heads"]


GPT2_END_OF_TEXT_ID = 50256  # GPT-2's own vocabulary


def gpt2_end_of_text_id(args: Args, vocab_size: int) -> Optional[int]:
    """GPT-2's bos/eos (``<|endoftext|>``) id inside an exported vocabulary of ``vocab_size`` tokens.

    The id the run's ``--vocab-file`` gives the token when that file is readable; else GPT-2's 50256 when
    the vocabulary holds it; else None (``transformers``' default 50256 would point outside a smaller one).
    """
    path = args.get("vocab_file")
    if path and os.path.isfile(path):
        try:
            with open(path) as f:
                found = json.load(f).get(EOD_TOKEN)
        except (OSError, ValueError, AttributeError):
            found = None
        if isinstance(found, int) and 0 <= found < vocab_size:
            return found
    return GPT2_END_OF_TEXT_ID if vocab_size > GPT2_END_OF_TEXT_ID else None


def hf_config_from_args(args: Args, kind: str, vocab_size: int, where: str) -> Any:
    """A ``transformers`` config of class ``kind`` for the model ``args`` describes."""
    import transformers

    _check_supported(args, kind, where)
    if kind == "bert":
        return _bert_config(args, vocab_size)
    if kind == deepseek_v4.KIND:
        return deepseek_v4.hf_config(args, vocab_size, where)
    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab_size,
            n_positions=args["max_position_embeddings"],
            n_embd=args["hidden_size"],
            n_layer=args["num_layers"],
            n_head=args["num_attention_heads"],
            n_inner=args["ffn_hidden_size"],
            activation_function="gelu_new" if args.get("openai_gelu") else "gelu",
            layer_norm_epsilon=args["layernorm_epsilon"],
            tie_word_embeddings=True,
            architectures=["GPT2LMHeadModel"],
            bos_token_id=gpt2_end_of_text_id(args, vocab_size),
            eos_token_id=gpt2_end_of_text_id(args, vocab_size),
        )
    family = DECODER_FAMILIES[kind]
    config_class = getattr(transformers, family.config_class)
    return config_class(
        vocab_size=vocab_size,
        hidden_size=args["hidden_size"],
        intermediate_size=args["ffn_hidden_size"],
        num_hidden_layers=args["num_layers"],
        num_attention_heads=args["num_attention_heads"],
        num_key_value_heads=query_groups(args),
        head_dim=args.get("kv_channels") or (args["hidden_size"] // args["num_attention_heads"]),
        max_position_embeddings=args["max_position_embeddings"],
        rms_norm_eps=args["layernorm_epsilon"],
        rope_theta=float(args["rotary_base"]),
        hidden_act="silu",
        tie_word_embeddings=not args["untie_embeddings_and_output_weights"],
        architectures=[family.hf_class],
        **llama_family.config_fields(args, kind, where),
    )


def _bert_config(args: Args, vocab_size: int) -> Any:
    """``BertConfig`` of BertForPreTraining (binary head) or BertForMaskedLM; always 2 token types."""
    import transformers

    heads = args["num_attention_heads"]
    if args.get("kv_channels") not in (None, args["hidden_size"] // heads):
        raise ConversionError(f"flag kv_channels is {args['kv_channels']}; --model-type bert needs hidden/heads")
    return transformers.BertConfig(
        vocab_size=vocab_size,
        hidden_size=args["hidden_size"],
        num_hidden_layers=args["num_layers"],
        num_attention_heads=heads,
        intermediate_size=args["ffn_hidden_size"],
        hidden_act="gelu",
        hidden_dropout_prob=args.get("hidden_dropout", 0.1),
        attention_probs_dropout_prob=args.get("attention_dropout", 0.1),
        max_position_embeddings=args["max_position_embeddings"],
        type_vocab_size=2,
        layer_norm_eps=args["layernorm_epsilon"],
        tie_word_embeddings=not args["untie_embeddings_and_output_weights"],
        architectures=[BERT_CLASSES[bool(args.get("bert_binary_head", True))]],
    )


def gpt_model_kwargs(args: Args) -> Dict[str, Any]:
    """Keyword arguments of ``GPTModel`` (TP=1) for the model ``args`` describes."""
    chosen = activation(activation_name(*(bool(args.get(k)) for k in ("swiglu", "squared_relu", "openai_gelu"))))
    return dict(
        num_layers=args["num_layers"],
        hidden_size=args["hidden_size"],
        num_attention_heads=args["num_attention_heads"],
        num_query_groups=query_groups(args),
        ffn_hidden_size=args["ffn_hidden_size"],
        kv_channels=args.get("kv_channels"),
        normalization=args["normalization"],
        gated_linear_unit=bool(args.get("swiglu")),
        activation_func=chosen,
        add_bias_linear=args["add_bias_linear"],
        add_qkv_bias=bool(args.get("add_qkv_bias")),
        qk_layernorm=bool(args.get("qk_layernorm")),
        window_size=None if args.get("window_size") is None else tuple(args["window_size"]),
        **deepseek.moe_model_kwargs(args),
        **deepseek.mla_model_kwargs(args),
        **qwen3_next.model_kwargs(args),
        **deepseek_v4.model_kwargs(args),
        layernorm_epsilon=args["layernorm_epsilon"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        perform_initialization=False,
        position_embedding_type=args["position_embedding_type"],
        rotary_base=args["rotary_base"],
        share_embeddings_and_output_weights=not args["untie_embeddings_and_output_weights"],
        vocab_size=args["padded_vocab_size"],
        max_sequence_length=args["max_position_embeddings"],
    )
