"""T5 in the converter: our v1.1 ``T5Model`` (``pretrain_t5.py --t5-v11``) <-> HF's T5ForConditionalGeneration.

Only T5 v1.1 converts (``feed_forward_proj="gated-gelu"``, RMSNorm, no biases, relative position
buckets, an LM head of its own, no ``d_model ** -0.5`` rescaling of the decoder output): the
original T5 (v1.0: ReLU MLP, LM head tied to the embedding and rescaled) is refused, naming the field.

transformers 5 always ties T5's ``lm_head`` to ``shared`` inside the module and writes
``tie_word_embeddings: true`` with ``scale_decoder_outputs: false`` for a v1.1 model; earlier
versions write ``tie_word_embeddings: false``. Both are read as v1.1; a v1.1 file always holds its
own ``lm_head.weight``, which is what the converter reads (never ``shared.weight`` in its place).
Exporting unties the head before loading the weights and writes ``tie_word_embeddings: false``
into ``config.json`` (what v1.1 checkpoints say), so ``from_pretrained`` keeps the two apart.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List

import torch

from megatron.core.models.gpt.hf_state_dict import StateDict
from megatron.core.models.T5 import T5Model, get_t5_v11_decoder_block_spec, get_t5_v11_encoder_block_spec
from megatron.core.models.T5.hf_state_dict import from_hf_t5, to_hf_t5
from megatron.core.models.T5.t5_spec import t5_v11_config
from megatron.core.parallel_state import ProcessGroupCollection
from tools.checkpoint.errors import Args, ConversionError, require_field

T5_CLASS = "T5ForConditionalGeneration"
CROSS_ATTENTION_KEY = "decoder.layers.0.cross_attention.linear_q.weight"  # in a checkpoint: a T5Model
HF_LM_HEAD = "lm_head.weight"
_V11_ONLY = "only T5 v1.1 (gated-gelu, untied LM head) is supported, not the original T5 (v1.0)"


def _check_v11_config(hf: Dict[str, Any], where: str) -> None:
    """Refuse anything but a v1.1 ``T5Config``, naming the field."""
    proj = hf.get("feed_forward_proj", "relu")
    if proj != "gated-gelu":
        raise ConversionError(f"{where}: field 'feed_forward_proj' is {proj!r}; {_V11_ONLY} ('gated-gelu')")
    if hf.get("is_gated_act", True) is not True:
        raise ConversionError(f"{where}: field 'is_gated_act' is {hf['is_gated_act']!r}; {_V11_ONLY}")
    scaled = hf["scale_decoder_outputs"] if "scale_decoder_outputs" in hf else hf.get("tie_word_embeddings", True)
    if scaled is not False:
        field = "scale_decoder_outputs" if "scale_decoder_outputs" in hf else "tie_word_embeddings"
        raise ConversionError(
            f"{where}: field {field!r} is {scaled!r} (tied, rescaled LM head); {_V11_ONLY}, which has False"
        )
    require_field(hf, "is_encoder_decoder", (None, True), where)
    for field in ("relative_attention_num_buckets", "relative_attention_max_distance"):
        value = hf.get(field, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConversionError(f"{where}: field {field!r} is {value!r}; a positive integer is needed")


def t5_args(hf: Dict[str, Any], where: str) -> Args:
    """Model flags (by destination) of ``pretrain_t5.py --t5-v11`` for a v1.1 ``T5Config``."""
    _check_v11_config(hf, where)
    encoder = hf["num_layers"]
    heads = hf["num_heads"]
    return dict(
        num_layers=encoder,  # Megatron: --encoder-num-layers stands for --num-layers
        encoder_num_layers=encoder,
        decoder_num_layers=hf.get("num_decoder_layers") or encoder,
        hidden_size=hf["d_model"],
        num_attention_heads=heads,
        group_query_attention=False,
        num_query_groups=heads,
        kv_channels=hf["d_kv"],
        ffn_hidden_size=hf["d_ff"],
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-6),
        add_bias_linear=False,
        swiglu=False,
        openai_gelu=False,
        position_embedding_type="relative",
        relative_attention_num_buckets=hf["relative_attention_num_buckets"],
        relative_attention_max_distance=hf["relative_attention_max_distance"],
        untie_embeddings_and_output_weights=True,
        hidden_dropout=hf.get("dropout_rate", 0.1),
        attention_dropout=hf.get("dropout_rate", 0.1),
        t5_v11=True,
    )


def t5_flags(args: Args) -> List[str]:
    """The ``pretrain_t5.py`` flags that build the model ``args`` describes (sequence lengths are the run's)."""
    flags: List[Any] = ["--t5-v11", "--encoder-num-layers", args["encoder_num_layers"]]
    flags += ["--decoder-num-layers", args["decoder_num_layers"], "--hidden-size", args["hidden_size"]]
    flags += ["--num-attention-heads", args["num_attention_heads"], "--kv-channels", args["kv_channels"]]
    flags += ["--ffn-hidden-size", args["ffn_hidden_size"], "--normalization", "RMSNorm"]
    flags += ["--norm-epsilon", args["layernorm_epsilon"], "--disable-bias-linear"]
    flags += ["--untie-embeddings-and-output-weights", "--position-embedding-type", "relative"]
    flags += ["--relative-attention-num-buckets", args["relative_attention_num_buckets"]]
    flags += ["--relative-attention-max-distance", args["relative_attention_max_distance"]]
    flags += ["--hidden-dropout", args["hidden_dropout"], "--attention-dropout", args["attention_dropout"]]
    flags += ["--make-vocab-size-divisible-by", args["make_vocab_size_divisible_by"]]
    flags += ["--tensor-model-parallel-size", args["tensor_model_parallel_size"]]
    return [str(f) for f in flags]


def check_t5_args(args: Args, where: str) -> None:
    """Refuse a checkpoint whose model is not v1.1 (what Hugging Face's T5 mapping covers), naming the flag."""
    expected = dict(
        t5_v11=True,
        normalization="RMSNorm",
        add_bias_linear=False,
        position_embedding_type="relative",
        untie_embeddings_and_output_weights=True,
    )
    for dest, value in expected.items():
        if args.get(dest) != value:
            raise ConversionError(f"{where}: flag {dest} is {args.get(dest)!r}; --model-type t5 needs {value!r}")


def _configs(args: Args) -> tuple:
    """(encoder, decoder) TransformerConfigs of ``pretrain_t5.py --t5-v11`` at TP=1, dropout off."""
    config = t5_v11_config(
        num_layers=args["decoder_num_layers"],
        hidden_size=args["hidden_size"],
        num_attention_heads=args["num_attention_heads"],
        kv_channels=args["kv_channels"],
        ffn_hidden_size=args["ffn_hidden_size"],
        layernorm_epsilon=args["layernorm_epsilon"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    return dataclasses.replace(config, num_layers=args["encoder_num_layers"]), config


def build_t5(args: Args, groups: ProcessGroupCollection) -> T5Model:
    """Our TP=1 v1.1 T5Model for ``args`` (as ``pretrain_t5.py --t5-v11`` builds it; weights overwritten after)."""
    check_t5_args(args, "model flags")
    encoder_config, config = _configs(args)
    return T5Model(
        config=config,
        encoder_config=encoder_config,
        transformer_encoder_layer_spec=get_t5_v11_encoder_block_spec(args["encoder_num_layers"]),
        transformer_decoder_layer_spec=get_t5_v11_decoder_block_spec(args["decoder_num_layers"]),
        vocab_size=args["padded_vocab_size"],
        max_sequence_length=args.get("max_position_embeddings") or 512,  # relative positions: no table
        share_embeddings_and_output_weights=False,
        position_embedding_type="relative",
        relative_attention_num_buckets=args["relative_attention_num_buckets"],
        relative_attention_max_distance=args["relative_attention_max_distance"],
        pg_collection=groups,
    )


def t5_from_hf(hf_sd: StateDict, model: T5Model) -> StateDict:
    """Our state dict (unpadded vocabulary) from a v1.1 file; its own ``lm_head.weight`` is required."""
    if HF_LM_HEAD not in hf_sd:
        raise ConversionError(f"weight {HF_LM_HEAD!r} is missing: a tied LM head is T5 v1.0; {_V11_ONLY}")
    return from_hf_t5(hf_sd, model.encoder_config, model.config)


def t5_to_hf(sd: StateDict, args: Args) -> StateDict:
    """Hugging Face names of our full v1.1 state dict."""
    encoder_config, config = _configs(args)
    return to_hf_t5(sd, encoder_config, config)


def t5_hf_config(args: Args, vocab_size: int) -> Any:
    """The v1.1 ``T5Config`` of the model ``args`` describes."""
    import transformers

    return transformers.T5Config(
        vocab_size=vocab_size,
        d_model=args["hidden_size"],
        d_kv=args["kv_channels"],
        d_ff=args["ffn_hidden_size"],
        num_layers=args["encoder_num_layers"],
        num_decoder_layers=args["decoder_num_layers"],
        num_heads=args["num_attention_heads"],
        relative_attention_num_buckets=args["relative_attention_num_buckets"],
        relative_attention_max_distance=args["relative_attention_max_distance"],
        dropout_rate=args.get("hidden_dropout", 0.1),
        layer_norm_epsilon=args["layernorm_epsilon"],
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        decoder_start_token_id=0,
        architectures=[T5_CLASS],
    )


def untie_lm_head(model: torch.nn.Module) -> None:
    """transformers 5 ties T5's ``lm_head`` to ``shared``; a v1.1 model has its own."""
    if model.lm_head.weight is model.shared.weight:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())


def mark_untied(out_dir: str) -> None:
    """Write ``tie_word_embeddings: false`` into ``out_dir/config.json``, as v1.1 checkpoints say."""
    path = os.path.join(out_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config.update(tie_word_embeddings=False, scale_decoder_outputs=False)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)
