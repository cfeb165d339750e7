"""Parameter names of DeepSeek-V4 between this project and ``transformers``' ``DeepseekV4ForCausalLM``.

A table first (our name suffix -> Hugging Face's), then the translation of whole state dicts. Our
names follow the modules: ``CompressedAttention`` (``experimental_attention_variant/
compressed_attention.py``), ``HyperConnectionModule`` / ``HyperHead`` and the MoE layer.
"""

from __future__ import annotations

from typing import Dict

from megatron.core.models.gpt.hf_state_dict import (
    StateDict,
    _llama_outer_from_hf,
    _llama_outer_to_hf,
    _moe_mlp_from_hf,
    _moe_mlp_to_hf,
)
from megatron.core.transformer.transformer_config import TransformerConfig

# CompressedAttention (ours) -> DeepseekV4Attention (transformers), within one layer's attention.
ATTENTION_NAMES: Dict[str, str] = {
    "linear_q_down_proj.weight": "q_a_proj.weight",
    "q_layernorm.weight": "q_a_norm.weight",
    "linear_q_up_proj.weight": "q_b_proj.weight",
    "linear_kv_proj.weight": "kv_proj.weight",
    "kv_layernorm.weight": "kv_norm.weight",
    "attention_sinks": "sinks",
    "linear_o_group_proj.weight": "o_a_proj.weight",
    "linear_proj.weight": "o_b_proj.weight",
    "compressor.linear_kv.weight": "compressor.kv_proj.weight",
    "compressor.linear_gate.weight": "compressor.gate_proj.weight",
    "compressor.position_bias": "compressor.position_bias",
    "compressor.kv_layernorm.weight": "compressor.kv_norm.weight",
    "indexer.compressor.linear_kv.weight": "compressor.indexer.kv_proj.weight",
    "indexer.compressor.linear_gate.weight": "compressor.indexer.gate_proj.weight",
    "indexer.compressor.position_bias": "compressor.indexer.position_bias",
    "indexer.compressor.kv_layernorm.weight": "compressor.indexer.kv_norm.weight",
    "indexer.linear_wq_b.weight": "compressor.indexer.q_b_proj.weight",
    "indexer.linear_weights_proj.weight": "compressor.indexer.scorer.weights_proj.weight",
}


def attention_to_hf(state: Dict[str, object]) -> Dict[str, object]:
    """One ``CompressedAttention``'s state dict in ``DeepseekV4Attention``'s names."""
    return {ATTENTION_NAMES[name]: value for name, value in state.items()}


def _layer_names(i: int) -> Dict[str, str]:
    """Layer ``i``'s non-MoE names, ours -> transformers' (attention, norms, hyper-connections)."""
    ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
    names = {ours + "self_attention." + k: hf + "self_attn." + v for k, v in ATTENTION_NAMES.items()}
    names[ours + "input_layernorm.weight"] = hf + "input_layernorm.weight"
    names[ours + "pre_mlp_layernorm.weight"] = hf + "post_attention_layernorm.weight"
    for module, hf_module in (("attention_hyper_connection", "attn_hc"), ("mlp_hyper_connection", "ffn_hc")):
        for name, hf_name in HYPER_CONNECTION_NAMES.items():
            names[f"{ours}{module}.{name}"] = f"{hf}{hf_module}.{hf_name}"
    names[ours + "mlp.router.tid2eid"] = hf + "mlp.gate.tid2eid"
    return names


HYPER_CONNECTION_NAMES = {"mapping_proj": "fn", "mapping_bias": "base", "mapping_scale": "scale"}
HYPER_HEAD_NAMES = {
    "decoder.hyper_head.mapping_proj": "model.hc_head.hc_fn",
    "decoder.hyper_head.mapping_bias": "model.hc_head.hc_base",
    "decoder.hyper_head.mapping_scale": "model.hc_head.hc_scale",
}


def to_hf_deepseek_v4(sd: StateDict, config: TransformerConfig) -> StateDict:
    """Our full (TP=1) DeepSeek-V4 state dict -> ``DeepseekV4ForCausalLM``'s names; every entry is used."""
    out = _llama_outer_to_hf(sd)
    names = dict(HYPER_HEAD_NAMES)
    for i in range(config.num_layers):
        names.update(_layer_names(i))
        out.update(_moe_mlp_to_hf(sd, i, config.num_moe_experts))
    out.update({hf: sd[ours] for ours, hf in names.items() if ours in sd})
    return out


def from_hf_deepseek_v4(hf: StateDict, config: TransformerConfig) -> StateDict:
    """``DeepseekV4ForCausalLM``'s state dict -> our names (TP=1); the inverse of ``to_hf_deepseek_v4``."""
    out = _llama_outer_from_hf(hf)
    names = dict(HYPER_HEAD_NAMES)
    for i in range(config.num_layers):
        names.update(_layer_names(i))
        out.update(_moe_mlp_from_hf(hf, i, config.num_moe_experts))
    out.update({ours: hf[name] for ours, name in names.items() if name in hf})
    return out
