"""Sharded state dicts of model chunks and of their optimizer state.

Keys are layout-free: a transformer layer is named by its global 0-based index
(``decoder.layers.{layer_number - 1}``), not by its position on this pipeline
stage, and the last stage's copy of a tied word embedding (or, with multi-token prediction,
of the embedding) is read from the first stage's key (``embedding.word_embeddings.weight``,
``embedding.position_embeddings.weight``) and never written. An expert is named by its
global index (``mlp.experts.local_experts.{global}``), sharded over expert-TP and
replicated over expert-DP, so a checkpoint loads under any expert-parallel size.
FSDP2's parameters (DTensors holding some rows of their TP-local tensor) are written and read as that
whole TP-local tensor, gathered over their shard group (``bf16`` runs: in the model's bf16, the fp32
master values going to the optimizer's ``main_param``), so the checkpoint is the same as any layout's;
after a load each rank copies its rows back (``load_sharded_parameters``).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor

from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor, sharded_tensor_for
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.quantization.fp8_params import is_fp8_param
from megatron.core.tensor_parallel.layers import is_expert_param
from megatron.core.utils import dtensor_rows, named_model_params, unwrap_model

TIED_EMBEDDING_KEY = "embedding.word_embeddings.weight"
OPTIMIZER_STATE_PREFIX = "optimizer.state."
EXTRA_STATE = "_extra_state"  # torch.nn.Module's state_dict key for get_extra_state()


def model_process_groups(
    model: torch.nn.Module, pg_collection: Optional[ProcessGroupCollection]
) -> ProcessGroupCollection:
    """The explicit collection, else the one the model was built with (``model.pg_collection``).

    Raises:
        ValueError: neither is there.
    """
    groups = pg_collection if pg_collection is not None else getattr(model, "pg_collection", None)
    if groups is None:
        raise ValueError(
            f"{type(model).__name__} has no pg_collection attribute: pass pg_collection= to describe its shards"
        )
    return groups


def _layer_prefixes(model: torch.nn.Module) -> Dict[str, str]:
    """Local module prefix of each transformer layer -> the prefix with its global index."""
    table = {}
    for name, module in model.named_modules():
        # TransformerLayer marks itself (this module is imported by the transformer, not the reverse).
        index = getattr(module, "checkpoint_layer_index", None)
        parent, _, last = name.rpartition(".")
        if index is not None and last.isdigit():  # a block's layer list (not MTP's ``transformer_layer``)
            table[name + "."] = f"{parent}.{index}." if parent else f"{index}."
    return table


def _expert_prefixes(model: torch.nn.Module) -> Dict[str, str]:
    """Local prefix of each expert (``...local_experts.{i}.``) -> the prefix with its global index."""
    table = {}
    for name, module in model.named_modules():
        start = getattr(module, "local_expert_start", None)  # a MoELayer
        if start is not None:
            base = f"{name}.experts.local_experts." if name else "experts.local_experts."
            for i in range(module.num_local_experts):
                table[f"{base}{i}."] = f"{base}{start + i}."
    return table


def _global_name(name: str, prefixes: Mapping[str, str]) -> str:
    for local, global_ in prefixes.items():
        if name.startswith(local):
            return global_ + name[len(local) :]
    return name


def _entries(
    model_chunk: torch.nn.Module, prefix: str, groups: ProcessGroupCollection, dp_replicas: bool = True
) -> List[Tuple[str, torch.Tensor, ShardedTensor]]:
    """(state_dict name, original tensor, its ShardedTensor) for every parameter and persistent buffer.

    ``dp_replicas=False``: every data-parallel rank is described as DP rank 0 (each writes its own part).
    """
    model = unwrap_model(model_chunk)
    prefixes, experts = _layer_prefixes(model), _expert_prefixes(model)
    tp_rank, tp_size = groups.rank_in("tp"), groups.size_of("tp")
    dp_rank = groups.rank_in("dp_cp") if dp_replicas else 0
    expt_dp_rank = groups.rank_in("expt_dp") if dp_replicas else 0
    entries = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor) or is_empty_extra_state(name, tensor):
            continue
        key = _key(prefix, name, tensor, prefixes, experts)
        data = _gathered(tensor) if isinstance(tensor, DTensor) else tensor
        if is_expert_param(tensor):
            spec = sharded_tensor_for(key, data, groups.rank_in("expt_tp"), groups.size_of("expt_tp"), expt_dp_rank)
        else:
            spec = sharded_tensor_for(key, data, tp_rank, tp_size, dp_rank)
            if getattr(tensor, "shared_embedding", False):
                spec.replica_id = 1 + spec.replica_id  # read from the first stage's key, never written here
        entries.append((name, tensor, spec))
    return entries


def _key(prefix: str, name: str, tensor: torch.Tensor, prefixes: Mapping[str, str], experts: Mapping[str, str]) -> str:
    """The layout-free checkpoint key of the state_dict entry ``name``."""
    if is_expert_param(tensor):
        return prefix + _global_name(_global_name(name, experts), prefixes)
    if getattr(tensor, "shared_embedding", False):
        return prefix + (name if name.startswith("embedding.") else TIED_EMBEDDING_KEY)  # MTP's copy, or the output
    return prefix + _global_name(name, prefixes)


_TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce", "shared_embedding")


def _gathered(param: DTensor) -> torch.Tensor:
    """An FSDP2 parameter's whole TP-local tensor (collective over its shard group), in the dtype a
    checkpoint holds (``checkpoint_dtype``), with the attributes that place it in the global tensor."""
    whole = param.full_tensor().detach().to(getattr(param, "checkpoint_dtype", param.dtype))
    for attribute in _TP_ATTRIBUTES:
        if hasattr(param, attribute):
            setattr(whole, attribute, getattr(param, attribute))
    return whole


def load_sharded_parameters(
    model_chunk: torch.nn.Module, loaded: ShardedStateDict, pg_collection: Optional[ProcessGroupCollection] = None
) -> int:
    """Copy this rank's rows of each FSDP2 parameter from the whole tensors ``loaded`` read (keyed as
    ``sharded_state_dict``); returns how many. Plain parameters were loaded in place already."""
    model = unwrap_model(model_chunk)
    prefixes, experts = _layer_prefixes(model), _expert_prefixes(model)
    count = 0
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            key = _key("", name, tensor, prefixes, experts) if isinstance(tensor, DTensor) else None
            if key is None or key not in loaded:
                continue
            start, rows = dtensor_rows(tensor)
            whole = loaded[key].data.reshape(tensor.shape)  # [rows of the TP-local tensor, ...]
            tensor._local_tensor.copy_(whole[start : start + rows])
            count += 1
    return count


def is_empty_extra_state(name: str, value: object) -> bool:
    """A module's ``_extra_state`` that holds nothing (an empty tensor): left out of checkpoints, so
    that a model whose modules have extra state (Transformer Engine's linears) and one whose modules
    have none write the same keys."""
    return name.rpartition(".")[2] == EXTRA_STATE and isinstance(value, torch.Tensor) and value.numel() == 0


def model_state_to_save(module: torch.nn.Module) -> Dict[str, object]:
    """``module.state_dict()`` without empty extra states (``is_empty_extra_state``)."""
    return {k: v for k, v in module.state_dict().items() if not is_empty_extra_state(k, v)}


def load_extra_states(
    model_chunk: torch.nn.Module, loaded: ShardedStateDict, pg_collection: Optional[ProcessGroupCollection] = None
) -> int:
    """Hand each module its ``_extra_state`` read into ``loaded`` (``sharded_state_dict``'s keys); returns how many.

    Parameters and buffers are loaded in place through their views; an extra state is a value the
    module produced (``get_extra_state``), so it goes back through ``set_extra_state``.
    """
    model = unwrap_model(model_chunk)
    groups = model_process_groups(model, pg_collection)
    count = 0
    for name, _, spec in _entries(model_chunk, "", groups):
        module_name, _, last = name.rpartition(".")
        if last == EXTRA_STATE and spec.key in loaded:
            model.get_submodule(module_name).set_extra_state(loaded[spec.key].data)
            count += 1
    return count


def sharded_state_dict(
    model_chunk: torch.nn.Module, prefix: str = "", pg_collection: Optional[ProcessGroupCollection] = None
) -> ShardedStateDict:
    """Every parameter and persistent buffer of ``model_chunk`` as a ShardedTensor, by global key.

    The ShardedTensors view the parameters' storage: loading into this dict loads the model.
    """
    groups = model_process_groups(unwrap_model(model_chunk), pg_collection)
    out: ShardedStateDict = {}
    for _, _, spec in _entries(model_chunk, prefix, groups):
        if spec.key in out:
            raise ValueError(f"two tensors of one model chunk map to checkpoint key {spec.key!r}")
        out[spec.key] = spec
    return out


def module_sharded_state_dict(
    module: torch.nn.Module, prefix: str = "", pg_collection: Optional[ProcessGroupCollection] = None
) -> ShardedStateDict:
    """Megatron-core's form of ``sharded_state_dict``: keyed by ``prefix`` + the module's own
    ``state_dict`` names, so the dict ``load`` returns goes straight into ``load_state_dict``; each
    ShardedTensor's ``key`` is the layout-free checkpoint key (the same as ``sharded_state_dict``'s)."""
    groups = model_process_groups(unwrap_model(module), pg_collection)
    return {prefix + name: spec for name, _, spec in _entries(module, prefix, groups)}


def model_sharded_state_dict(
    model_chunks: Sequence[torch.nn.Module], prefix: str = "", pg_collection: Optional[ProcessGroupCollection] = None
) -> ShardedStateDict:
    """The union over the chunks of one rank (virtual pipeline stages); keys must not repeat."""
    out: ShardedStateDict = {}
    for chunk in model_chunks:
        for key, spec in sharded_state_dict(chunk, prefix, pg_collection).items():
            if key in out:
                raise ValueError(f"checkpoint key {key!r} appears in two model chunks of this rank")
            out[key] = spec
    return out


def sharded_tensors_by_param_name(
    model_chunks: Sequence[torch.nn.Module],
    pg_collection: Optional[ProcessGroupCollection] = None,
    dp_replicas: bool = True,
) -> Dict[str, ShardedTensor]:
    """Parameter name (see ``megatron.core.utils.named_model_params``) -> the parameter's ShardedTensor.

    ``dp_replicas=False`` describes every rank as data-parallel rank 0: the replica ids of state that the
    data-parallel ranks shard among themselves (the distributed optimizer's) instead of replicating.
    """
    by_id: Dict[int, ShardedTensor] = {}
    for chunk in model_chunks:
        groups = model_process_groups(unwrap_model(chunk), pg_collection)
        by_id.update({id(tensor): spec for _, tensor, spec in _entries(chunk, "", groups, dp_replicas)})
    # An FP8 weight's entry is the high-precision tensor its state_dict handed out (fp8_params).
    return {
        name: by_id[id(param.fp8_meta.checkpoint_values if is_fp8_param(param) else param)]
        for name, param in named_model_params(model_chunks)
    }


def optimizer_state_key(param_key: str, state_name: str) -> str:
    """Checkpoint key of one per-parameter optimizer tensor."""
    return f"{OPTIMIZER_STATE_PREFIX}{param_key}.{state_name}"


def split_optimizer_state(
    state: Mapping[str, object], param_names: Iterable[str]
) -> Tuple[Dict[str, Dict[str, torch.Tensor]], Dict[str, object]]:
    """Split ``state_dict_by_param_name`` output into (per-parameter tensors, everything else)."""
    names = set(param_names)
    per_param = {k: dict(v) for k, v in state.items() if k in names}
    scalars = {k: v for k, v in state.items() if k not in names}
    return per_param, scalars


def optimizer_sharded_state_dict(
    per_param: Mapping[str, Mapping[str, torch.Tensor]], param_specs: Mapping[str, ShardedTensor]
) -> ShardedStateDict:
    """Shard each per-parameter optimizer tensor exactly like its parameter."""
    out: ShardedStateDict = {}
    for name, states in per_param.items():
        spec = param_specs[name]
        for state_name, tensor in states.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"optimizer state {name}.{state_name} is a {type(tensor).__name__}, not a tensor")
            key = optimizer_state_key(spec.key, state_name)
            out[key] = spec.with_data(key, tensor)
    return out
