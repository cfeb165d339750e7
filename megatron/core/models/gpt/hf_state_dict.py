"""Map full (TP=1) GPTModel state dicts to and from Hugging Face GPT-2 and Llama-family names.

Llama-family: Llama, Mistral, Qwen2 (QKV bias), Qwen3 (query/key RMSNorm), and with MoE layers
Mixtral and Qwen3-MoE; DeepSeek-V3 is the same family with multi-latent attention (``_MLA_NAMES``),
shared experts and the router's expert bias. Which optional tensors a layer has is read from the
state dict itself.

Our fused QKV weight is laid out per query group ``[q heads of the group, k, v]``; GPT-2
stacks ``[all q, all k, all v]`` in a Conv1D (``[in, out]``) weight, Llama keeps three
separate ``[out, in]`` projections. SwiGLU's first projection is ``[gate; up]``.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from megatron.core.transformer.transformer_config import TransformerConfig

StateDict = Dict[str, torch.Tensor]


def split_qkv(qkv: torch.Tensor, config: TransformerConfig) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused ``[(heads + 2*groups) * d, ...]`` -> q ``[heads*d, ...]``, k and v ``[groups*d, ...]``."""
    groups, d = config.num_query_groups, config.kv_channels
    per_group = config.num_attention_heads // groups
    grouped = qkv.reshape(groups, per_group + 2, d, *qkv.shape[1:])
    q = grouped[:, :per_group].reshape(groups * per_group * d, *qkv.shape[1:])
    return (
        q,
        grouped[:, per_group].reshape(groups * d, *qkv.shape[1:]),
        grouped[:, per_group + 1].reshape(groups * d, *qkv.shape[1:]),
    )


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """Inverse of ``split_qkv``."""
    groups, d = config.num_query_groups, config.kv_channels
    per_group = config.num_attention_heads // groups
    rest = q.shape[1:]
    parts = (q.reshape(groups, per_group, d, *rest), k.reshape(groups, 1, d, *rest), v.reshape(groups, 1, d, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _layer_map_gpt2(i: int) -> Dict[str, str]:
    ours, hf = f"decoder.layers.{i}.", f"transformer.h.{i}."
    return {
        ours + "input_layernorm.weight": hf + "ln_1.weight",
        ours + "input_layernorm.bias": hf + "ln_1.bias",
        ours + "pre_mlp_layernorm.weight": hf + "ln_2.weight",
        ours + "pre_mlp_layernorm.bias": hf + "ln_2.bias",
        ours + "self_attention.linear_proj.bias": hf + "attn.c_proj.bias",
        ours + "mlp.linear_fc1.bias": hf + "mlp.c_fc.bias",
        ours + "mlp.linear_fc2.bias": hf + "mlp.c_proj.bias",
    }


def to_hf_gpt2(sd: StateDict, config: TransformerConfig) -> StateDict:
    """Our GPT-2-style state dict -> ``transformers.GPT2LMHeadModel`` names (Conv1D weights are ``[in, out]``)."""
    out = {
        "transformer.wte.weight": sd["embedding.word_embeddings.weight"],
        "transformer.wpe.weight": sd["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": sd["decoder.final_layernorm.weight"],
        "transformer.ln_f.bias": sd["decoder.final_layernorm.bias"],
    }
    out["lm_head.weight"] = sd.get("output_layer.weight", out["transformer.wte.weight"])
    for i in range(config.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"transformer.h.{i}."
        out.update({h: sd[o] for o, h in _layer_map_gpt2(i).items()})
        for kind in ("weight", "bias"):
            q, k, v = split_qkv(sd[ours + f"self_attention.linear_qkv.{kind}"], config)
            fused = torch.cat([q, k, v], dim=0)
            out[hf + f"attn.c_attn.{kind}"] = fused.t().contiguous() if kind == "weight" else fused
        out[hf + "attn.c_proj.weight"] = sd[ours + "self_attention.linear_proj.weight"].t().contiguous()
        out[hf + "mlp.c_fc.weight"] = sd[ours + "mlp.linear_fc1.weight"].t().contiguous()
        out[hf + "mlp.c_proj.weight"] = sd[ours + "mlp.linear_fc2.weight"].t().contiguous()
    return out


# Optional attention tensors, present exactly when the model has them: QKV bias (Qwen2,
# --add-qkv-bias) and per-head query/key RMSNorm (Qwen3, --qk-layernorm).
_QK_NORMS = (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm"))


# Multi-latent attention (DeepSeek-V2/V3), ours under ``self_attention.`` and HF's under ``self_attn.``;
# each weight present exactly when the model has it (q_proj without q_lora_rank, the rest with it).
_MLA_NAMES = (
    ("linear_q_proj", "q_proj"),
    ("linear_q_down_proj", "q_a_proj"),
    ("q_layernorm", "q_a_layernorm"),
    ("linear_q_up_proj", "q_b_proj"),
    ("linear_kv_down_proj", "kv_a_proj_with_mqa"),
    ("kv_layernorm", "kv_a_layernorm"),
    ("linear_kv_up_proj", "kv_b_proj"),
    # DeepSeek-V3.2's lightning indexer (experimental_attention_variant/dsa.py)
    ("core_attention.indexer.linear_wq_b", "indexer.wq_b"),
    ("core_attention.indexer.linear_wk", "indexer.wk"),
    ("core_attention.indexer.k_norm", "indexer.k_norm"),
    ("core_attention.indexer.linear_weights_proj", "indexer.weights_proj"),
)


def _mla_names(i: int) -> Dict[str, str]:
    ours, hf = f"decoder.layers.{i}.self_attention.", f"model.layers.{i}.self_attn."
    return {f"{ours}{o}.{kind}": f"{hf}{h}.{kind}" for o, h in _MLA_NAMES for kind in ("weight", "bias")}


def _llama_layer_to_hf(sd: StateDict, config: TransformerConfig, i: int) -> StateDict:
    """Norms and attention of layer ``i`` (everything but the MLP) in Llama/Mixtral/Qwen/DeepSeek names."""
    ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
    out = {
        hf + "input_layernorm.weight": sd[ours + "input_layernorm.weight"],
        hf + "post_attention_layernorm.weight": sd[ours + "pre_mlp_layernorm.weight"],
        hf + "self_attn.o_proj.weight": sd[ours + "self_attention.linear_proj.weight"],
    }
    if config.multi_latent_attention:
        out.update({h: sd[o] for o, h in _mla_names(i).items() if o in sd})
        return out
    kinds = ("weight", "bias") if ours + "self_attention.linear_qkv.bias" in sd else ("weight",)
    for kind in kinds:
        q, k, v = split_qkv(sd[ours + f"self_attention.linear_qkv.{kind}"], config)
        out.update({hf + f"self_attn.{n}_proj.{kind}": t for n, t in zip("qkv", (q, k, v))})
    for our_norm, hf_norm in _QK_NORMS:
        if ours + f"self_attention.{our_norm}.weight" in sd:
            out[hf + f"self_attn.{hf_norm}.weight"] = sd[ours + f"self_attention.{our_norm}.weight"]
    return out


def _llama_layer_from_hf(hf: StateDict, config: TransformerConfig, i: int) -> StateDict:
    """Inverse of ``_llama_layer_to_hf``."""
    ours, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    out = {
        ours + "input_layernorm.weight": hf[h + "input_layernorm.weight"],
        ours + "pre_mlp_layernorm.weight": hf[h + "post_attention_layernorm.weight"],
        ours + "self_attention.linear_proj.weight": hf[h + "self_attn.o_proj.weight"],
    }
    if config.multi_latent_attention:
        out.update({o: hf[name] for o, name in _mla_names(i).items() if name in hf})
        return out
    kinds = ("weight", "bias") if h + "self_attn.q_proj.bias" in hf else ("weight",)
    for kind in kinds:
        q, k, v = (hf[h + f"self_attn.{n}_proj.{kind}"] for n in "qkv")
        out[ours + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, config)
    for our_norm, hf_norm in _QK_NORMS:
        if h + f"self_attn.{hf_norm}.weight" in hf:
            out[ours + f"self_attention.{our_norm}.weight"] = hf[h + f"self_attn.{hf_norm}.weight"]
    return out


def _llama_outer_to_hf(sd: StateDict) -> StateDict:
    out = {
        "model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
        "model.norm.weight": sd["decoder.final_layernorm.weight"],
    }
    out["lm_head.weight"] = sd.get("output_layer.weight", out["model.embed_tokens.weight"])
    return out


def _llama_outer_from_hf(hf: StateDict) -> StateDict:
    return {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": hf.get("lm_head.weight", hf["model.embed_tokens.weight"]),
    }


def _swiglu_to_hf(mlp: StateDict) -> StateDict:
    """One SwiGLU MLP ``{linear_fc1.weight, linear_fc2.weight}`` -> ``{gate,up,down}_proj.weight``."""
    gate, up = mlp["linear_fc1.weight"].chunk(2)  # [gate; up], each [ffn, h]
    return {"gate_proj.weight": gate, "up_proj.weight": up, "down_proj.weight": mlp["linear_fc2.weight"]}


def _swiglu_from_hf(mlp: StateDict) -> StateDict:
    """Inverse of ``_swiglu_to_hf``."""
    fc1 = torch.cat([mlp["gate_proj.weight"], mlp["up_proj.weight"]])  # [2*ffn, h]
    return {"linear_fc1.weight": fc1, "linear_fc2.weight": mlp["down_proj.weight"]}


def _under(sd: StateDict, prefix: str) -> StateDict:
    """The entries of ``sd`` under ``prefix``, with it stripped."""
    return {k[len(prefix) :]: sd[k] for k in sd if k.startswith(prefix)}  # indexed: a reader may track reads


def _dense_mlp_to_hf(sd: StateDict, i: int) -> StateDict:
    mlp = _under(sd, f"decoder.layers.{i}.mlp.")
    return {f"model.layers.{i}.mlp.{k}": v for k, v in _swiglu_to_hf(mlp).items()}


def _moe_mlp_to_hf(sd: StateDict, i: int, num_experts: int) -> StateDict:
    """Router ``mlp.gate.weight`` ``[E, h]``; experts stacked: ``gate_up_proj`` ``[E, 2*ffn, h]``
    (our ``[gate; up]`` fc1) and ``down_proj`` ``[E, h, ffn]`` (transformers v5 names)."""
    ours, hf = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
    out = {hf + "gate.weight": sd[ours + "router.weight"]}
    if ours + "router.expert_bias" in sd:  # DeepSeek-V3's aux-loss-free balancing bias
        out[hf + "gate.e_score_correction_bias"] = sd[ours + "router.expert_bias"]
    if ours + "shared_experts.linear_fc1.weight" in sd:  # DeepSeek-V3: a plain SwiGLU MLP
        shared = _under(sd, ours + "shared_experts.")
        out.update({hf + "shared_experts." + k: v for k, v in _swiglu_to_hf(shared).items()})
    for ours_name, hf_name in (("linear_fc1", "gate_up_proj"), ("linear_fc2", "down_proj")):
        out[hf + "experts." + hf_name] = torch.stack(
            [sd[f"{ours}experts.local_experts.{j}.{ours_name}.weight"] for j in range(num_experts)]
        )
    return out


def to_hf_llama(sd: StateDict, config: TransformerConfig) -> StateDict:
    """Our Llama-style state dict -> Hugging Face decoder names (``LlamaForCausalLM``, Qwen2/Qwen3,
    and per MoE layer Mixtral/Qwen3-MoE's ``mlp.gate`` and stacked experts)."""
    out = _llama_outer_to_hf(sd)
    for i in range(config.num_layers):
        out.update(_llama_layer_to_hf(sd, config, i))
        if f"decoder.layers.{i}.mlp.router.weight" in sd:
            out.update(_moe_mlp_to_hf(sd, i, config.num_moe_experts))
        else:
            out.update(_dense_mlp_to_hf(sd, i))
    return out


def _dense_mlp_from_hf(hf: StateDict, i: int) -> StateDict:
    mlp = _under(hf, f"model.layers.{i}.mlp.")
    return {f"decoder.layers.{i}.mlp.{k}": v for k, v in _swiglu_from_hf(mlp).items()}


def _moe_mlp_from_hf(hf: StateDict, i: int, num_experts: int) -> StateDict:
    ours = f"decoder.layers.{i}.mlp."
    gate = f"model.layers.{i}.mlp.gate.weight"
    out = {ours + "router.weight": hf[gate] if gate in hf else hf[f"model.layers.{i}.block_sparse_moe.gate.weight"]}
    h = f"model.layers.{i}.mlp."
    if h + "gate.e_score_correction_bias" in hf:
        out[ours + "router.expert_bias"] = hf[h + "gate.e_score_correction_bias"]
    if h + "shared_experts.gate_proj.weight" in hf:
        shared = _swiglu_from_hf(_under(hf, h + "shared_experts."))
        out.update({ours + "shared_experts." + k: v for k, v in shared.items()})
    fc1, fc2 = _mixtral_experts_from_hf(hf, i, num_experts)
    for j in range(num_experts):
        out[f"{ours}experts.local_experts.{j}.linear_fc1.weight"] = fc1[j].contiguous()
        out[f"{ours}experts.local_experts.{j}.linear_fc2.weight"] = fc2[j].contiguous()
    return out


def _is_moe_in_hf(hf: StateDict, i: int) -> bool:
    return any(f"model.layers.{i}.{m}.gate.weight" in hf for m in ("mlp", "block_sparse_moe"))


def from_hf_llama(hf: StateDict, config: TransformerConfig) -> StateDict:
    """Hugging Face decoder state dict (Llama, Mistral, Qwen2/Qwen3, Mixtral, Qwen3-MoE) -> our names (TP=1)."""
    out = _llama_outer_from_hf(hf)
    for i in range(config.num_layers):
        out.update(_llama_layer_from_hf(hf, config, i))
        moe = _is_moe_in_hf(hf, i)
        if moe != config.is_moe_layer(i + 1):
            raise ValueError(f"layer {i}: MoE in the Hugging Face weights is {moe}, in the config {not moe}")
        out.update(_moe_mlp_from_hf(hf, i, config.num_moe_experts) if moe else _dense_mlp_from_hf(hf, i))
    return out


def _check_mixtral(config: TransformerConfig) -> None:
    if not config.num_moe_experts or not all(config.is_moe_layer(n) for n in range(1, config.num_layers + 1)):
        raise ValueError(
            f"Mixtral needs every layer to be MoE: num_moe_experts={config.num_moe_experts}, "
            f"moe_layer_freq={config.moe_layer_freq!r}"
        )


def to_hf_mixtral(sd: StateDict, config: TransformerConfig) -> StateDict:
    """Our all-MoE Llama-style state dict -> ``transformers.MixtralForCausalLM`` (v5) names."""
    _check_mixtral(config)
    return to_hf_llama(sd, config)


# Per-expert names of saved checkpoints (what save_pretrained writes and the Hub holds): the
# prefix under the layer and the gate, up and down projections (Qwen3-MoE, then Mixtral).
_PER_EXPERT_NAMES = (
    ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
    ("block_sparse_moe.experts", "w1", "w3", "w2"),
)


def _mixtral_experts_from_hf(hf: StateDict, layer: int, num_experts: int) -> Tuple[list, list]:
    """(fc1 ``[2*ffn, h]``, fc2 ``[h, ffn]``) per expert, from transformers v5's stacked in-memory tensors
    or a saved checkpoint's per-expert ``{prefix}.{j}.{gate, up, down}`` weights."""
    stacked = f"model.layers.{layer}.mlp.experts."
    if stacked + "gate_up_proj" in hf:
        return list(hf[stacked + "gate_up_proj"].unbind(0)), list(hf[stacked + "down_proj"].unbind(0))
    saved = (n for n in _PER_EXPERT_NAMES if f"model.layers.{layer}.{n[0]}.0.{n[1]}.weight" in hf)
    prefix, gate, up, down = next(saved, _PER_EXPERT_NAMES[-1])  # none found: the KeyError names Mixtral's
    p = f"model.layers.{layer}.{prefix}."
    fc1 = [torch.cat([hf[f"{p}{j}.{gate}.weight"], hf[f"{p}{j}.{up}.weight"]]) for j in range(num_experts)]
    return fc1, [hf[f"{p}{j}.{down}.weight"] for j in range(num_experts)]


def from_hf_mixtral(hf: StateDict, config: TransformerConfig) -> StateDict:
    """``transformers.MixtralForCausalLM`` state dict -> our names (TP=1)."""
    _check_mixtral(config)
    return from_hf_llama(hf, config)


def from_hf_gpt2(hf: StateDict, config: TransformerConfig) -> StateDict:
    """``transformers.GPT2LMHeadModel`` state dict -> our names (TP=1, tied embeddings: no output layer)."""
    out = {
        "embedding.word_embeddings.weight": hf["transformer.wte.weight"],
        "embedding.position_embeddings.weight": hf["transformer.wpe.weight"],
        "decoder.final_layernorm.weight": hf["transformer.ln_f.weight"],
        "decoder.final_layernorm.bias": hf["transformer.ln_f.bias"],
    }
    hidden = config.hidden_size
    for i in range(config.num_layers):
        ours, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
        out.update({o: hf[name] for o, name in _layer_map_gpt2(i).items()})
        for kind in ("weight", "bias"):
            fused = hf[h + f"attn.c_attn.{kind}"]
            fused = fused.t() if kind == "weight" else fused  # Conv1D [in, 3h] -> [3h, in]
            q, k, v = fused[:hidden], fused[hidden : 2 * hidden], fused[2 * hidden :]
            out[ours + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, config).contiguous()
        out[ours + "self_attention.linear_proj.weight"] = hf[h + "attn.c_proj.weight"].t().contiguous()
        out[ours + "mlp.linear_fc1.weight"] = hf[h + "mlp.c_fc.weight"].t().contiguous()
        out[ours + "mlp.linear_fc2.weight"] = hf[h + "mlp.c_proj.weight"].t().contiguous()
    return out


VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")  # bias: BERT
VOCAB_KEYS += ("lm_head.output_layer.weight",)  # T5Model's untied output layer
HASH_TABLE_SUFFIX = ".router.tid2eid"  # DeepSeek-V4's hash routers: one row of k experts per token id


def resize_vocab(sd: StateDict, rows: int) -> StateDict:
    """Pad (with zero rows) or strip the vocabulary dimension of our embedding and output layer, and of
    DeepSeek-V4's hash-routing tables (``[V, k]``; a padded id's row: experts ``0..k-1``).

    Our model pads the vocabulary to a multiple of ``make_vocab_size_divisible_by x TP``;
    Hugging Face models hold exactly ``config.vocab_size`` rows. Zero rows give padded
    ids a logit of 0, and they are never produced by the tokenizer.
    """
    out = dict(sd)
    for key in [k for k in sd if k in VOCAB_KEYS or k.endswith(HASH_TABLE_SUFFIX)]:
        weight = sd[key]
        if rows <= weight.shape[0]:
            out[key] = weight[:rows].contiguous()
        elif key.endswith(HASH_TABLE_SUFFIX):
            experts = torch.arange(weight.shape[1], dtype=weight.dtype, device=weight.device)  # [k]
            out[key] = torch.cat([weight, experts.expand(rows - weight.shape[0], -1)])
        else:
            pad = weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])
            out[key] = torch.cat([weight, pad])
    return out
