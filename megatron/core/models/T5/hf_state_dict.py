"""Map full (TP=1) T5 v1.1 T5Model state dicts to and from Hugging Face ``T5ForConditionalGeneration`` names.

The model is the one ``t5_spec`` describes for v1.1: built from ``t5_v11_config`` with
``get_t5_v11_encoder_block_spec`` / ``get_t5_v11_decoder_block_spec``,
``position_embedding_type="relative"`` and ``share_embeddings_and_output_weights=False``
(Hugging Face: ``feed_forward_proj="gated-gelu"``, ``tie_word_embeddings=False``). Tensors:

* our fused self-attention ``linear_qkv`` (per query group) <-> ``SelfAttention.q`` / ``k`` / ``v``;
* our cross-attention ``linear_kv`` (per head: key rows then value rows) <-> ``EncDecAttention.k`` / ``v``;
* our gated ``mlp.linear_fc1`` (gate rows, then up rows) <-> ``DenseReluDense.wi_0`` / ``wi_1``;
* ``encoder_relative_pos_emb`` / ``decoder_relative_pos_emb`` <-> block 0's ``relative_attention_bias``;
* the word embedding <-> ``shared.weight`` (also written as ``encoder.embed_tokens.weight`` and
  ``decoder.embed_tokens.weight``, which Hugging Face ties to it).

A tied Hugging Face T5 (v1.0, ``tie_word_embeddings=True``) rescales the decoder output by
``d_model ** -0.5`` before the LM head, which Megatron's T5 does not: it is not covered.
"""

from __future__ import annotations

from typing import Dict

import torch

from megatron.core.models.gpt.hf_state_dict import StateDict, fuse_qkv, split_qkv
from megatron.core.transformer.transformer_config import TransformerConfig

_EMBEDDING_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def _check_v11(config: TransformerConfig) -> None:
    if config.normalization != "RMSNorm" or config.add_bias_linear or not config.gated_linear_unit:
        raise ValueError(
            "the Hugging Face T5 v1.1 mapping needs normalization='RMSNorm', add_bias_linear=False and "
            f"gated_linear_unit=True (got {config.normalization!r}, {config.add_bias_linear}, "
            f"{config.gated_linear_unit}); see t5_v11_config"
        )


def _rename_pairs(encoder_config: TransformerConfig, config: TransformerConfig) -> Dict[str, str]:
    """Our name -> Hugging Face name, for every tensor that is only renamed."""
    pairs = {
        "embedding.word_embeddings.weight": "shared.weight",
        "lm_head.output_layer.weight": "lm_head.weight",
        "encoder.final_layernorm.weight": "encoder.final_layer_norm.weight",
        "decoder.final_layernorm.weight": "decoder.final_layer_norm.weight",
    }
    for stack in ("encoder", "decoder"):
        table = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        pairs[f"{stack}_relative_pos_emb.relative_attention_bias.weight"] = table
    for stack, cfg, ff in (("encoder", encoder_config, 1), ("decoder", config, 2)):
        for i in range(cfg.num_layers):
            ours, hf = f"{stack}.layers.{i}.", f"{stack}.block.{i}.layer."
            pairs.update(
                {
                    ours + "input_layernorm.weight": hf + "0.layer_norm.weight",
                    ours + "self_attention.linear_proj.weight": hf + "0.SelfAttention.o.weight",
                    ours + "pre_mlp_layernorm.weight": hf + f"{ff}.layer_norm.weight",
                    ours + "mlp.linear_fc2.weight": hf + f"{ff}.DenseReluDense.wo.weight",
                }
            )
            if stack == "decoder":
                pairs[ours + "pre_cross_attn_layernorm.weight"] = hf + "1.layer_norm.weight"
                pairs[ours + "cross_attention.linear_q.weight"] = hf + "1.EncDecAttention.q.weight"
                pairs[ours + "cross_attention.linear_proj.weight"] = hf + "1.EncDecAttention.o.weight"
    return pairs


def _layers(encoder_config: TransformerConfig, config: TransformerConfig):
    """(our layer prefix, Hugging Face block prefix, feed-forward sub-layer index, config) per layer."""
    for stack, cfg, ff in (("encoder", encoder_config, 1), ("decoder", config, 2)):
        for i in range(cfg.num_layers):
            yield f"{stack}.layers.{i}.", f"{stack}.block.{i}.layer.", ff, cfg


def to_hf_t5(sd: StateDict, encoder_config: TransformerConfig, config: TransformerConfig) -> StateDict:
    """Our full v1.1 T5Model state dict -> ``T5ForConditionalGeneration``'s (``tie_word_embeddings=False``)."""
    _check_v11(config)
    _check_v11(encoder_config)
    out = {hf: sd[ours] for ours, hf in _rename_pairs(encoder_config, config).items()}
    out.update({name: out["shared.weight"] for name in _EMBEDDING_COPIES})
    for ours, hf, ff, cfg in _layers(encoder_config, config):
        q, k, v = split_qkv(sd[ours + "self_attention.linear_qkv.weight"], cfg)
        out.update({hf + "0.SelfAttention.q.weight": q, hf + "0.SelfAttention.k.weight": k})
        out[hf + "0.SelfAttention.v.weight"] = v
        gate, up = torch.chunk(sd[ours + "mlp.linear_fc1.weight"], 2, dim=0)  # [ffn, h] each
        out.update({hf + f"{ff}.DenseReluDense.wi_0.weight": gate, hf + f"{ff}.DenseReluDense.wi_1.weight": up})
        if ours.startswith("decoder"):
            heads, d = cfg.num_attention_heads, cfg.kv_channels
            kv = sd[ours + "cross_attention.linear_kv.weight"].view(heads, 2, d, -1)  # [heads, k|v, d, h]
            out[hf + "1.EncDecAttention.k.weight"] = kv[:, 0].reshape(heads * d, -1)
            out[hf + "1.EncDecAttention.v.weight"] = kv[:, 1].reshape(heads * d, -1)
    return out


def from_hf_t5(hf: StateDict, encoder_config: TransformerConfig, config: TransformerConfig) -> StateDict:
    """Inverse of ``to_hf_t5``: a ``T5ForConditionalGeneration`` (v1.1) state dict -> our full T5Model's."""
    _check_v11(config)
    _check_v11(encoder_config)
    out = {ours: hf[name] for ours, name in _rename_pairs(encoder_config, config).items()}
    for ours, h, ff, cfg in _layers(encoder_config, config):
        attn = h + "0.SelfAttention."
        out[ours + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[attn + "q.weight"], hf[attn + "k.weight"], hf[attn + "v.weight"], cfg
        )
        wi = h + f"{ff}.DenseReluDense.wi_"
        out[ours + "mlp.linear_fc1.weight"] = torch.cat([hf[wi + "0.weight"], hf[wi + "1.weight"]], dim=0)
        if ours.startswith("decoder"):
            heads, d = cfg.num_attention_heads, cfg.kv_channels
            k, v = (hf[h + f"1.EncDecAttention.{n}.weight"].view(heads, 1, d, -1) for n in ("k", "v"))
            out[ours + "cross_attention.linear_kv.weight"] = torch.cat([k, v], dim=1).reshape(2 * heads * d, -1)
    return out
