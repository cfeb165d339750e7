"""Map full (TP=1) Qwen3-Next-style ``GPTModel`` state dicts to and from ``transformers``' ``Qwen3NextForCausalLM``.

Layers are Gated DeltaNet (``self_attention.`` a ``GatedDeltaNet``; HF ``linear_attn.``) or gated full
attention (``attention_output_gate``; HF ``self_attn.``), by ``config.is_linear_attention_layer``. Layouts:

* HF's ``q_proj`` holds per head ``[q, gate]``; our fused QKV holds per query group ``[q heads, gate heads,
  k, v]`` (``attention.SelfAttention.split_qkv_gate``).
* HF's ``in_proj_qkvz`` holds per key head ``[q, k, v, z]`` of that head's value heads and ``in_proj_ba`` per
  key head ``[beta, alpha]``; our ``in_proj`` holds ``[all q, all k, all v, all z, all beta, all alpha]``
  (``gated_delta_net.GDNDims``). The convolution's channels are ``[q, k, v]`` in both.
* HF's gated norm stores its gain; ours stores ``gain - 1`` under ``layernorm_zero_centered_gamma`` (as every
  norm of the model, and HF's other Qwen3-Next norms, do).
* MoE layers: HF's ``shared_expert`` / ``shared_expert_gate`` are our ``shared_experts`` MLP and its ``gate_weight``.
"""

from __future__ import annotations

from typing import Tuple

import torch

from megatron.core.models.gpt.hf_state_dict import (
    _QK_NORMS,
    StateDict,
    _dense_mlp_from_hf,
    _dense_mlp_to_hf,
    _llama_layer_to_hf,
    _llama_outer_from_hf,
    _llama_outer_to_hf,
    _moe_mlp_from_hf,
    _moe_mlp_to_hf,
)
from megatron.core.ssm.gated_delta_net import gdn_dims
from megatron.core.transformer.transformer_config import TransformerConfig


def _query_gate_to_hf(q_and_gate: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """Our ``[groups * (q_per_group + gate_per_group) * d, h]`` -> HF's ``q_proj`` ``[heads * 2d, h]``."""
    heads, d = config.num_attention_heads, config.kv_channels
    per_group = q_and_gate.reshape(config.num_query_groups, 2, heads // config.num_query_groups, d, -1)
    return per_group.permute(0, 2, 1, 3, 4).reshape(heads * 2 * d, -1)  # per head [q, gate]


def _query_gate_from_hf(q_proj: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """Inverse of ``_query_gate_to_hf``."""
    heads, d = config.num_attention_heads, config.kv_channels
    per_head = q_proj.reshape(config.num_query_groups, heads // config.num_query_groups, 2, d, -1)
    return per_head.permute(0, 2, 1, 3, 4).reshape(heads * 2 * d, -1)


def _gated_attention_to_hf(sd: StateDict, config: TransformerConfig, i: int) -> StateDict:
    """A full-attention layer's norms and gated attention in HF names (the query columns carry the gate)."""
    key = f"decoder.layers.{i}.self_attention.linear_qkv.weight"
    fused = sd[key]
    groups, d = config.num_query_groups, config.kv_channels
    per_group = config.num_attention_heads // groups
    grouped = fused.reshape(groups, 2 * per_group + 2, d, -1)  # [q heads, gate heads, k, v] per group
    q_and_gate, kv = grouped[:, : 2 * per_group], grouped[:, 2 * per_group :]
    plain = torch.cat([q_and_gate[:, :per_group], kv], dim=1).reshape(-1, fused.shape[-1])  # ungated layout
    out = _llama_layer_to_hf({**sd, key: plain}, config, i)
    q_proj = _query_gate_to_hf(q_and_gate.reshape(-1, fused.shape[-1]), config)
    out[f"model.layers.{i}.self_attn.q_proj.weight"] = q_proj
    return out


def _gated_attention_from_hf(hf: StateDict, config: TransformerConfig, i: int) -> StateDict:
    """Inverse of ``_gated_attention_to_hf`` (reads each HF tensor by its name: the converter tracks reads)."""
    ours, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    groups, d, hidden = config.num_query_groups, config.kv_channels, config.hidden_size
    per_group = config.num_attention_heads // groups
    q_and_gate = _query_gate_from_hf(hf[h + "self_attn.q_proj.weight"], config).reshape(groups, -1, d, hidden)
    k, v = (hf[h + f"self_attn.{n}_proj.weight"].reshape(groups, 1, d, hidden) for n in "kv")
    assert q_and_gate.shape[1] == 2 * per_group
    out = {
        ours + "input_layernorm.weight": hf[h + "input_layernorm.weight"],
        ours + "pre_mlp_layernorm.weight": hf[h + "post_attention_layernorm.weight"],
        ours + "self_attention.linear_proj.weight": hf[h + "self_attn.o_proj.weight"],
        ours + "self_attention.linear_qkv.weight": torch.cat([q_and_gate, k, v], 1).reshape(-1, hidden),
    }
    for our_norm, hf_norm in _QK_NORMS:
        out[ours + f"self_attention.{our_norm}.weight"] = hf[h + f"self_attn.{hf_norm}.weight"]
    return out


def _gdn_sections(config: TransformerConfig) -> Tuple[int, ...]:
    d = gdn_dims(config)
    rep = d.num_value_heads // d.num_key_heads
    return d.key_head_dim, d.key_head_dim, rep * d.value_head_dim, rep * d.value_head_dim, rep


def _gdn_to_hf(sd: StateDict, config: TransformerConfig, i: int) -> StateDict:
    """A GDN layer: norms, the two input projections in HF's per-key-head order, convolution, gates, norm."""
    ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
    d, (dk, _, vr, _, rep) = gdn_dims(config), _gdn_sections(config)
    q, k, v, z, b, a = torch.split(sd[ours + "self_attention.in_proj.weight"], d.in_proj_sections(), dim=0)
    per_head = lambda t, rows: t.reshape(d.num_key_heads, rows, -1)  # noqa: E731  [key heads, rows, h]
    qkvz = torch.cat([per_head(q, dk), per_head(k, dk), per_head(v, vr), per_head(z, vr)], dim=1)
    ba = torch.cat([per_head(b, rep), per_head(a, rep)], dim=1)
    norm = sd[ours + "self_attention.out_norm.weight"]
    return {
        hf + "input_layernorm.weight": sd[ours + "input_layernorm.weight"],
        hf + "post_attention_layernorm.weight": sd[ours + "pre_mlp_layernorm.weight"],
        hf + "linear_attn.in_proj_qkvz.weight": qkvz.reshape(-1, qkvz.shape[-1]),
        hf + "linear_attn.in_proj_ba.weight": ba.reshape(-1, ba.shape[-1]),
        hf + "linear_attn.conv1d.weight": sd[ours + "self_attention.conv1d.weight"],
        hf + "linear_attn.A_log": sd[ours + "self_attention.A_log"],
        hf + "linear_attn.dt_bias": sd[ours + "self_attention.dt_bias"],
        hf + "linear_attn.norm.weight": norm + 1 if config.layernorm_zero_centered_gamma else norm,
        hf + "linear_attn.out_proj.weight": sd[ours + "self_attention.out_proj.weight"],
    }


def _gdn_from_hf(hf: StateDict, config: TransformerConfig, i: int) -> StateDict:
    """Inverse of ``_gdn_to_hf``."""
    ours, h = f"decoder.layers.{i}.", f"model.layers.{i}.linear_attn."
    d, sections = gdn_dims(config), _gdn_sections(config)
    hidden = config.hidden_size
    qkvz = hf[h + "in_proj_qkvz.weight"].reshape(d.num_key_heads, -1, hidden)
    ba = hf[h + "in_proj_ba.weight"].reshape(d.num_key_heads, -1, hidden)
    q, k, v, z = torch.split(qkvz, sections[:4], dim=1)
    b, a = torch.split(ba, [sections[4]] * 2, dim=1)
    norm = hf[h + "norm.weight"]
    return {
        ours + "input_layernorm.weight": hf[f"model.layers.{i}.input_layernorm.weight"],
        ours + "pre_mlp_layernorm.weight": hf[f"model.layers.{i}.post_attention_layernorm.weight"],
        ours + "self_attention.in_proj.weight": torch.cat([t.reshape(-1, hidden) for t in (q, k, v, z, b, a)]),
        ours + "self_attention.conv1d.weight": hf[h + "conv1d.weight"],
        ours + "self_attention.A_log": hf[h + "A_log"],
        ours + "self_attention.dt_bias": hf[h + "dt_bias"],
        ours + "self_attention.out_norm.weight": norm - 1 if config.layernorm_zero_centered_gamma else norm,
        ours + "self_attention.out_proj.weight": hf[h + "out_proj.weight"],
    }


def _rename(sd: StateDict, old: str, new: str) -> StateDict:
    return {k.replace(old, new): v for k, v in sd.items()}


def _mlp_to_hf(sd: StateDict, config: TransformerConfig, i: int) -> StateDict:
    ours = f"decoder.layers.{i}.mlp."
    if ours + "router.weight" not in sd:
        return _dense_mlp_to_hf(sd, i)
    out = _rename(_moe_mlp_to_hf(sd, i, config.num_moe_experts), ".mlp.shared_experts.", ".mlp.shared_expert.")
    if ours + "shared_experts.gate_weight" in sd:
        out[f"model.layers.{i}.mlp.shared_expert_gate.weight"] = sd[ours + "shared_experts.gate_weight"]
    return out


def _mlp_from_hf(hf: StateDict, config: TransformerConfig, i: int) -> StateDict:
    if not config.is_moe_layer(i + 1):
        return _dense_mlp_from_hf(hf, i)
    h = f"model.layers.{i}.mlp."
    layer = {k: hf[k] for k in hf if k.startswith(h)}  # indexed: the converter tracks reads
    out = _moe_mlp_from_hf(_rename(layer, ".mlp.shared_expert.", ".mlp.shared_experts."), i, config.num_moe_experts)
    if h + "shared_expert_gate.weight" in hf:
        out[f"decoder.layers.{i}.mlp.shared_experts.gate_weight"] = hf[h + "shared_expert_gate.weight"]
    return out


def to_hf_qwen3_next(sd: StateDict, config: TransformerConfig) -> StateDict:
    """Our Qwen3-Next-style state dict (TP=1) -> ``Qwen3NextForCausalLM`` names."""
    out = _llama_outer_to_hf(sd)
    for i in range(config.num_layers):
        gdn = config.is_linear_attention_layer(i + 1)
        out.update(_gdn_to_hf(sd, config, i) if gdn else _gated_attention_to_hf(sd, config, i))
        out.update(_mlp_to_hf(sd, config, i))
    return out


def from_hf_qwen3_next(hf: StateDict, config: TransformerConfig) -> StateDict:
    """``Qwen3NextForCausalLM`` state dict -> our names (TP=1)."""
    out = _llama_outer_from_hf(hf)
    for i in range(config.num_layers):
        gdn = config.is_linear_attention_layer(i + 1)
        out.update(_gdn_from_hf(hf, config, i) if gdn else _gated_attention_from_hf(hf, config, i))
        out.update(_mlp_from_hf(hf, config, i))
    return out
