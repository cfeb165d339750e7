"""Map full (TP=1) post-LN BertModel state dicts to and from Hugging Face BERT names.

``to_hf_bert`` / ``from_hf_bert`` cover ``BertForPreTraining`` (``bert.pooler`` and
``cls.seq_relationship``: our ``pooler`` and ``binary_head``) and, with ``binary_head=False``,
``BertForMaskedLM`` (no pooler, no NSP head). Our fused QKV weight (per query group) is split into
Hugging Face's ``query`` / ``key`` / ``value``. Hugging Face ties ``cls.predictions.decoder.weight``
to the word embedding: a model built with ``share_embeddings_and_output_weights=True`` has no
``output_layer.weight``; with an untied model the decoder weight is its own tensor.
The model's config must match Hugging Face's: ``layernorm_epsilon=layer_norm_eps`` and the exact
(erf) gelu, ``F.gelu``, which is Hugging Face's ``hidden_act="gelu"``.
"""

from __future__ import annotations

from typing import Dict

from megatron.core.models.gpt.hf_state_dict import StateDict, fuse_qkv, split_qkv
from megatron.core.transformer.transformer_config import TransformerConfig

_PARAMS = ("weight", "bias")


def _rename_pairs(config: TransformerConfig, binary_head: bool) -> Dict[str, str]:
    """Our name -> Hugging Face name, for every tensor that is only renamed."""
    pairs = {
        "embedding.word_embeddings.weight": "bert.embeddings.word_embeddings.weight",
        "embedding.position_embeddings.weight": "bert.embeddings.position_embeddings.weight",
        "embedding.tokentype_embeddings.weight": "bert.embeddings.token_type_embeddings.weight",
        "output_layer.bias": "cls.predictions.bias",
    }
    modules = {
        "embedding.embedding_layernorm": "bert.embeddings.LayerNorm",
        "lm_head.dense": "cls.predictions.transform.dense",
        "lm_head.layer_norm": "cls.predictions.transform.LayerNorm",
    }
    if binary_head:
        modules.update({"pooler.dense": "bert.pooler.dense", "binary_head": "cls.seq_relationship"})
    for i in range(config.num_layers):
        ours, hf = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}."
        modules.update(
            {
                ours + "self_attention.linear_proj": hf + "attention.output.dense",
                ours + "post_self_attn_layernorm": hf + "attention.output.LayerNorm",
                ours + "mlp.linear_fc1": hf + "intermediate.dense",
                ours + "mlp.linear_fc2": hf + "output.dense",
                ours + "post_mlp_layernorm": hf + "output.LayerNorm",
            }
        )
    pairs.update({f"{o}.{p}": f"{h}.{p}" for o, h in modules.items() for p in _PARAMS})
    return pairs


def to_hf_bert(sd: StateDict, config: TransformerConfig, binary_head: bool = True) -> StateDict:
    """Our post-LN BertModel state dict -> ``BertForPreTraining`` (``binary_head=False``: ``BertForMaskedLM``)."""
    out = {hf: sd[ours] for ours, hf in _rename_pairs(config, binary_head).items()}
    out["cls.predictions.decoder.weight"] = sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"])
    out["cls.predictions.decoder.bias"] = sd["output_layer.bias"]
    for i in range(config.num_layers):
        fused, hf = f"encoder.layers.{i}.self_attention.linear_qkv.", f"bert.encoder.layer.{i}.attention.self."
        for p in _PARAMS:
            q, k, v = split_qkv(sd[fused + p], config)
            out.update({hf + f"query.{p}": q, hf + f"key.{p}": k, hf + f"value.{p}": v})
    return out


def from_hf_bert(hf: StateDict, config: TransformerConfig, binary_head: bool = True, tied: bool = True) -> StateDict:
    """Inverse of ``to_hf_bert``; ``tied=False`` keeps ``cls.predictions.decoder.weight`` as ``output_layer.weight``.

    Untied, Hugging Face (transformers 5) no longer ties ``cls.predictions.decoder.bias`` to
    ``cls.predictions.bias`` either, and its forward adds the decoder's: that one is taken when present.
    """
    out = {ours: hf[name] for ours, name in _rename_pairs(config, binary_head).items()}
    if not tied:
        out["output_layer.weight"] = hf["cls.predictions.decoder.weight"]
        out["output_layer.bias"] = hf.get("cls.predictions.decoder.bias", out["output_layer.bias"])
    for i in range(config.num_layers):
        fused, h = f"encoder.layers.{i}.self_attention.linear_qkv.", f"bert.encoder.layer.{i}.attention.self."
        for p in _PARAMS:
            out[fused + p] = fuse_qkv(hf[h + f"query.{p}"], hf[h + f"key.{p}"], hf[h + f"value.{p}"], config)
    return out
