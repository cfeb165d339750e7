"""Map full (TP=1) GPTModel state dicts to and from Hugging Face GPT-2, Llama and Mixtral names.

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


def _llama_layer_to_hf(sd: StateDict, config: TransformerConfig, i: int) -> StateDict:
    """Norms and attention of layer ``i`` (everything but the MLP) in Llama/Mixtral names."""
    ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
    q, k, v = split_qkv(sd[ours + "self_attention.linear_qkv.weight"], config)
    return {
        hf + "input_layernorm.weight": sd[ours + "input_layernorm.weight"],
        hf + "post_attention_layernorm.weight": sd[ours + "pre_mlp_layernorm.weight"],
        hf + "self_attn.q_proj.weight": q,
        hf + "self_attn.k_proj.weight": k,
        hf + "self_attn.v_proj.weight": v,
        hf + "self_attn.o_proj.weight": sd[ours + "self_attention.linear_proj.weight"],
    }


def _llama_layer_from_hf(hf: StateDict, config: TransformerConfig, i: int) -> StateDict:
    """Inverse of ``_llama_layer_to_hf``."""
    ours, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    return {
        ours + "input_layernorm.weight": hf[h + "input_layernorm.weight"],
        ours + "pre_mlp_layernorm.weight": hf[h + "post_attention_layernorm.weight"],
        ours + "self_attention.linear_qkv.weight": fuse_qkv(
            hf[h + "self_attn.q_proj.weight"],
            hf[h + "self_attn.k_proj.weight"],
            hf[h + "self_attn.v_proj.weight"],
            config,
        ),
        ours + "self_attention.linear_proj.weight": hf[h + "self_attn.o_proj.weight"],
    }


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


def to_hf_llama(sd: StateDict, config: TransformerConfig) -> StateDict:
    """Our Llama-style state dict -> ``transformers.LlamaForCausalLM`` names."""
    out = _llama_outer_to_hf(sd)
    ffn = config.ffn_hidden_size
    for i in range(config.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        fc1 = sd[ours + "mlp.linear_fc1.weight"]
        out.update(_llama_layer_to_hf(sd, config, i))
        out.update(
            {
                hf + "mlp.gate_proj.weight": fc1[:ffn],
                hf + "mlp.up_proj.weight": fc1[ffn:],
                hf + "mlp.down_proj.weight": sd[ours + "mlp.linear_fc2.weight"],
            }
        )
    return out


def from_hf_llama(hf: StateDict, config: TransformerConfig) -> StateDict:
    """``transformers.LlamaForCausalLM`` state dict -> our names (TP=1)."""
    out = _llama_outer_from_hf(hf)
    for i in range(config.num_layers):
        ours, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out.update(_llama_layer_from_hf(hf, config, i))
        out.update(
            {
                ours + "mlp.linear_fc1.weight": torch.cat(
                    [hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]]
                ),
                ours + "mlp.linear_fc2.weight": hf[h + "mlp.down_proj.weight"],
            }
        )
    return out


def _check_mixtral(config: TransformerConfig) -> None:
    if not config.num_moe_experts or not all(config.is_moe_layer(n) for n in range(1, config.num_layers + 1)):
        raise ValueError(
            f"Mixtral needs every layer to be MoE: num_moe_experts={config.num_moe_experts}, "
            f"moe_layer_freq={config.moe_layer_freq!r}"
        )


def to_hf_mixtral(sd: StateDict, config: TransformerConfig) -> StateDict:
    """Our MoE Llama-style state dict -> ``transformers.MixtralForCausalLM`` (v5) names.

    Per layer: ``mlp.gate.weight`` ``[E, h]`` (our router), ``mlp.experts.gate_up_proj``
    ``[E, 2*ffn, h]`` (our stacked ``[gate; up]`` fc1) and ``mlp.experts.down_proj`` ``[E, h, ffn]``.
    """
    _check_mixtral(config)
    out = _llama_outer_to_hf(sd)
    for i in range(config.num_layers):
        ours, hf = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
        experts = range(config.num_moe_experts)
        out.update(_llama_layer_to_hf(sd, config, i))
        out[hf + "gate.weight"] = sd[ours + "router.weight"]
        for ours_name, hf_name in (("linear_fc1", "gate_up_proj"), ("linear_fc2", "down_proj")):
            out[hf + "experts." + hf_name] = torch.stack(
                [sd[f"{ours}experts.local_experts.{j}.{ours_name}.weight"] for j in experts]
            )
    return out


def _mixtral_experts_from_hf(hf: StateDict, layer: int, num_experts: int) -> Tuple[list, list]:
    """(fc1 ``[2*ffn, h]``, fc2 ``[h, ffn]``) per expert, from transformers v5's stacked tensors
    or the older per-expert ``block_sparse_moe.experts.{j}.w1/w3/w2`` (gate/up/down)."""
    new = f"model.layers.{layer}.mlp.experts."
    if new + "gate_up_proj" in hf:
        return list(hf[new + "gate_up_proj"].unbind(0)), list(hf[new + "down_proj"].unbind(0))
    old = f"model.layers.{layer}.block_sparse_moe.experts."
    fc1 = [torch.cat([hf[f"{old}{j}.w1.weight"], hf[f"{old}{j}.w3.weight"]]) for j in range(num_experts)]
    return fc1, [hf[f"{old}{j}.w2.weight"] for j in range(num_experts)]


def from_hf_mixtral(hf: StateDict, config: TransformerConfig) -> StateDict:
    """``transformers.MixtralForCausalLM`` state dict -> our names (TP=1)."""
    _check_mixtral(config)
    out = _llama_outer_from_hf(hf)
    for i in range(config.num_layers):
        ours = f"decoder.layers.{i}.mlp."
        gate = f"model.layers.{i}.mlp.gate.weight"
        out.update(_llama_layer_from_hf(hf, config, i))
        out[ours + "router.weight"] = hf[gate] if gate in hf else hf[f"model.layers.{i}.block_sparse_moe.gate.weight"]
        fc1, fc2 = _mixtral_experts_from_hf(hf, i, config.num_moe_experts)
        for j in range(config.num_moe_experts):
            out[f"{ours}experts.local_experts.{j}.linear_fc1.weight"] = fc1[j].contiguous()
            out[f"{ours}experts.local_experts.{j}.linear_fc2.weight"] = fc2[j].contiguous()
    return out


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


def resize_vocab(sd: StateDict, rows: int) -> StateDict:
    """Pad (with zero rows) or strip the vocabulary dimension of our embedding and output layer.

    Our model pads the vocabulary to a multiple of ``make_vocab_size_divisible_by x TP``;
    Hugging Face models hold exactly ``config.vocab_size`` rows. Zero rows give padded
    ids a logit of 0, and they are never produced by the tokenizer.
    """
    out = dict(sd)
    for key in VOCAB_KEYS:
        if key not in sd:
            continue
        weight = sd[key]
        if rows <= weight.shape[0]:
            out[key] = weight[:rows].contiguous()
        else:
            pad = weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])
            out[key] = torch.cat([weight, pad])
    return out
