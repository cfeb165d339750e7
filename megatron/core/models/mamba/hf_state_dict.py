"""Map full (TP=1) MambaModel state dicts to and from Hugging Face ``Mamba2ForCausalLM`` and
``NemotronHForCausalLM`` names.

Both HF families keep Megatron-core's mixer layout (``in_proj`` rows ``[z, x, B, C, dt]``, a depthwise
``conv1d`` over ``[x, B, C]``, per-head ``dt_bias``/``A_log``/``D``, a grouped gated norm), so a Mamba
layer maps name for name. Nemotron-H's attention layers keep three projections (ours: one fused QKV
laid out per query group) and its MLP layers a non-gated ``up_proj``/``down_proj`` pair. Its MoE layers
(``mixer.gate`` router with the expert-bias buffer, experts stacked as ``[E, ffn, h]`` / ``[E, h, ffn]``, a
non-gated shared expert) map to our ``MoELayer`` (router, one ``MLP`` per expert, shared experts).
"""

from __future__ import annotations

from typing import Dict, List

import torch

from megatron.core.models.gpt.hf_state_dict import fuse_qkv, split_qkv
from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols
from megatron.core.transformer.transformer_config import TransformerConfig

StateDict = Dict[str, torch.Tensor]
MIXER_TENSORS = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight")
MIXER_TENSORS += ("out_proj.weight",)
# Nemotron-H's names of our layer symbols (its config's ``layers_block_type``).
NEMOTRON_H_BLOCK_TYPES = {
    Symbols.MAMBA: "linear_attention",
    Symbols.ATTENTION: "full_attention",
    Symbols.MLP: "mlp",
    Symbols.MOE: "moe",
}


def _layer_norm_name(symbol: str) -> str:
    """Our name of the pre-norm of a layer of type ``symbol`` (Nemotron-H calls every one ``norm``)."""
    return {Symbols.MAMBA: "norm", Symbols.ATTENTION: "input_layernorm"}.get(symbol, "pre_mlp_layernorm")


def _mamba_layer(src: StateDict, ours: str, hf: str, to_hf: bool) -> StateDict:
    names = {f"{ours}mixer.{t}": f"{hf}mixer.{t}" for t in MIXER_TENSORS}
    names[f"{ours}norm.weight"] = f"{hf}norm.weight"
    return {h: src[o] for o, h in names.items() if o in src} if to_hf else {o: src[h] for o, h in names.items()}


def to_hf_mamba2(sd: StateDict, num_layers: int) -> StateDict:
    """Our all-Mamba state dict -> ``transformers.Mamba2ForCausalLM`` names."""
    out = {
        "backbone.embeddings.weight": sd["embedding.word_embeddings.weight"],
        "backbone.norm_f.weight": sd["decoder.final_norm.weight"],
        "lm_head.weight": sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"]),
    }
    for i in range(num_layers):
        out.update(_mamba_layer(sd, f"decoder.layers.{i}.", f"backbone.layers.{i}.", to_hf=True))
    return out


def from_hf_mamba2(hf: StateDict, num_layers: int) -> StateDict:
    """``transformers.Mamba2ForCausalLM`` weights -> our all-Mamba state dict."""
    out = {
        "embedding.word_embeddings.weight": hf["backbone.embeddings.weight"],
        "decoder.final_norm.weight": hf["backbone.norm_f.weight"],
        "output_layer.weight": hf.get("lm_head.weight", hf["backbone.embeddings.weight"]),
    }
    for i in range(num_layers):
        out.update(_mamba_layer(hf, f"decoder.layers.{i}.", f"backbone.layers.{i}.", to_hf=False))
    return out


def _hybrid_layer_names(symbol: str, ours: str, hf: str) -> Dict[str, str]:
    """Our name -> Nemotron-H's, for the tensors of one non-Mamba layer that map one to one."""
    names = {f"{ours}{_layer_norm_name(symbol)}.weight": f"{hf}norm.weight"}
    if symbol == Symbols.ATTENTION:
        names[f"{ours}self_attention.linear_proj.weight"] = f"{hf}mixer.o_proj.weight"
    elif symbol == Symbols.MLP:
        names[f"{ours}mlp.linear_fc1.weight"] = f"{hf}mixer.up_proj.weight"
        names[f"{ours}mlp.linear_fc2.weight"] = f"{hf}mixer.down_proj.weight"
    elif symbol == Symbols.MOE:
        names[f"{ours}mlp.router.weight"] = f"{hf}mixer.gate.weight"
        names[f"{ours}mlp.router.expert_bias"] = f"{hf}mixer.gate.e_score_correction_bias"
        names[f"{ours}mlp.shared_experts.linear_fc1.weight"] = f"{hf}mixer.shared_experts.up_proj.weight"
        names[f"{ours}mlp.shared_experts.linear_fc2.weight"] = f"{hf}mixer.shared_experts.down_proj.weight"
    return names


_EXPERT_LINEARS = (("linear_fc1", "up_proj"), ("linear_fc2", "down_proj"))  # ours, Nemotron-H's


def _experts_to_hf(sd: StateDict, ours: str, hf: str, num_experts: int) -> StateDict:
    """Our experts' ``MLP`` weights -> Nemotron-H's stacked ``mixer.experts.{up,down}_proj`` ``[E, out, in]``."""
    local = f"{ours}mlp.experts.local_experts."
    return {
        f"{hf}mixer.experts.{theirs}": torch.stack([sd[f"{local}{j}.{name}.weight"] for j in range(num_experts)])
        for name, theirs in _EXPERT_LINEARS
    }


def _experts_from_hf(hf: StateDict, ours: str, prefix: str, num_experts: int) -> StateDict:
    """Nemotron-H's experts, stacked (in memory) or one tensor per expert (``mixer.experts.{j}.up_proj.weight``, as
    checkpoints store them) -> our experts' ``MLP`` weights."""
    out = {}
    for name, theirs in _EXPERT_LINEARS:
        stacked = hf.get(f"{prefix}mixer.experts.{theirs}")
        for j in range(num_experts):
            weight = stacked[j] if stacked is not None else hf[f"{prefix}mixer.experts.{j}.{theirs}.weight"]
            out[f"{ours}mlp.experts.local_experts.{j}.{name}.weight"] = weight.contiguous()
    return out


def to_hf_nemotron_h(sd: StateDict, config: TransformerConfig, layer_types: List[str]) -> StateDict:
    """Our hybrid state dict (layer types ``layer_types``) -> ``transformers.NemotronHForCausalLM`` names."""
    out = {
        "model.embeddings.weight": sd["embedding.word_embeddings.weight"],
        "model.norm_f.weight": sd["decoder.final_norm.weight"],
        "lm_head.weight": sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"]),
    }
    for i, symbol in enumerate(layer_types):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        if symbol == Symbols.MAMBA:
            out.update(_mamba_layer(sd, ours, hf, to_hf=True))
            continue
        out.update({h: sd[o] for o, h in _hybrid_layer_names(symbol, ours, hf).items()})
        if symbol == Symbols.ATTENTION:
            q, k, v = split_qkv(sd[f"{ours}self_attention.linear_qkv.weight"], config)
            out.update({f"{hf}mixer.q_proj.weight": q, f"{hf}mixer.k_proj.weight": k, f"{hf}mixer.v_proj.weight": v})
        elif symbol == Symbols.MOE:
            out.update(_experts_to_hf(sd, ours, hf, config.num_moe_experts))
    return out


def from_hf_nemotron_h(hf: StateDict, config: TransformerConfig, layer_types: List[str]) -> StateDict:
    """``transformers.NemotronHForCausalLM`` weights -> our hybrid state dict."""
    out = {
        "embedding.word_embeddings.weight": hf["model.embeddings.weight"],
        "decoder.final_norm.weight": hf["model.norm_f.weight"],
        "output_layer.weight": hf.get("lm_head.weight", hf["model.embeddings.weight"]),
    }
    for i, symbol in enumerate(layer_types):
        ours, prefix = f"decoder.layers.{i}.", f"model.layers.{i}."
        if symbol == Symbols.MAMBA:
            out.update(_mamba_layer(hf, ours, prefix, to_hf=False))
            continue
        out.update({o: hf[h] for o, h in _hybrid_layer_names(symbol, ours, prefix).items()})
        if symbol == Symbols.ATTENTION:
            q, k, v = (hf[f"{prefix}mixer.{n}_proj.weight"] for n in "qkv")
            out[f"{ours}self_attention.linear_qkv.weight"] = fuse_qkv(q, k, v, config)
        elif symbol == Symbols.MOE:
            out.update(_experts_from_hf(hf, ours, prefix, config.num_moe_experts))
    return out
