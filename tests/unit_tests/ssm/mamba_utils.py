"""Tiny hybrid Mamba models for the tests: config, model, and full (TP-gathered) tensors."""

import copy

import torch
import torch.distributed as dist

from megatron.core.activations import squared_relu
from megatron.core.models.mamba import MambaModel
from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
from megatron.core.ssm.mamba_mixer import gather_rows, shard_rows
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.model_utils import gather_tp

VOCAB, HIDDEN, SEQ, CHUNK = 64, 32, 40, 8  # SEQ spans five scan chunks of CHUNK
PATTERN = "M*M-"


def mamba_config(num_layers, groups=None, **extra):
    """A tiny fp32 config (8 Mamba heads of 8 channels in 2 groups, 4 attention heads in 2 query groups)."""
    sizes = {}
    if groups is not None:
        sizes = dict(tensor_model_parallel_size=groups.size_of("tp"), pipeline_model_parallel_size=groups.size_of("pp"))
    return TransformerConfig(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, kv_channels=8,
        ffn_hidden_size=48, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2, normalization="RMSNorm",
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, transformer_impl="local",
        activation_func=squared_relu, use_cpu_initialization=True, initialization_seed=1234, **sizes, **extra,
    )  # fmt: skip


def spec_with_chunk(chunk=CHUNK):
    """``mamba_stack_spec`` with the mixers' scan chunk set to ``chunk``."""
    spec = copy.deepcopy(mamba_stack_spec)
    mixer = spec.submodules.mamba_layer.submodules.mixer
    spec.submodules.mamba_layer.submodules.mixer = ModuleSpec(
        module=mixer.module, params={"chunk_size": chunk}, submodules=mixer.submodules
    )
    return spec


def build_mamba(groups, pattern=PATTERN, seed=1234, **kwargs):
    """A hybrid model of ``pattern`` initialized from ``seed`` (CPU init: the same weights for any TP size)."""
    torch.manual_seed(seed)
    config = mamba_config(len(pattern), groups, **kwargs.pop("config_extra", {}))
    return MambaModel(
        config, spec_with_chunk(), VOCAB, SEQ, hybrid_override_pattern=pattern, pg_collection=groups, **kwargs
    )


def full_tensors(model, tp_group, grads: bool):
    """Every parameter (or its gradient) by name, TP shards joined (the mixers' per-section layout too)."""
    sections = {}
    for prefix, module in model.named_modules():
        if hasattr(module, "rank_major_sections"):  # MambaMixer, GatedDeltaNet
            sections.update({f"{prefix}.{n}": s for n, s in module.rank_major_sections().items()})
    out = {}
    for name, param in model.named_parameters():
        tensor = param.grad if grads else param.data
        if name in sections and dist.get_world_size(tp_group) > 1:
            shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(shards, tensor.contiguous(), group=tp_group)
            out[_global_name(model, name)] = gather_rows(shards, sections[name])
        else:
            out[_global_name(model, name)] = gather_tp(tensor, param, tp_group)
    return out


def _global_name(model, name):
    """``decoder.layers.{local}.`` -> ``decoder.layers.{global}.`` (a pipeline stage numbers its layers from 0)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(model.decoder.layers[int(parts[2])].checkpoint_layer_index)
    return ".".join(parts)


def shard_state_dict(model, full, tp_group):
    """This TP rank's piece of every tensor of the full state dict ``full`` (``model``'s names, one stage)."""
    rank, size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    sections = {}
    for prefix, module in model.named_modules():
        if hasattr(module, "rank_major_sections"):  # MambaMixer, GatedDeltaNet
            sections.update({f"{prefix}.{n}": s for n, s in module.rank_major_sections().items()})
    out = {}
    for name, param in model.state_dict(keep_vars=True).items():
        tensor = full[name]
        if name in sections:
            out[name] = shard_rows(tensor, sections[name], rank, size)
        elif getattr(param, "tensor_model_parallel", False) and size > 1:  # stride: SwiGLU's [gate; up] per rank
            dim, pieces = param.partition_dim, tensor.chunk(param.partition_stride, dim=param.partition_dim)
            out[name] = torch.cat([piece.chunk(size, dim=dim)[rank] for piece in pieces], dim=dim)
        else:
            out[name] = tensor
    return out
