"""Megatron-core's nested sharded state dicts, as a thin layer over the flat ShardedTensor save/load.

A Megatron-core caller hands ``save`` / ``load`` a nested dict (lists allowed) keyed by its own
names (a module's ``state_dict`` names), whose leaves are:

- ``ShardedTensor``: stored under its own ``key`` by torch.distributed.checkpoint, as before;
- ``ShardedObject``: each written piece stored as JSON, ``{key}/shard_{offsets}_{shape}.json``;
- ``ShardedTensorFactory``: stored as what it builds, rebuilt on load by its ``merge_fn``;
- ``LocalNonpersistentObject``: never stored; ``load`` hands back the wrapped value;
- anything else is "common" state: rank 0 stores it in ``common_state.json`` (plain data, never pickled).

``load`` returns the same nesting with each ShardedTensor replaced by its loaded tensor (in the
shape the caller gave, so ``module.load_state_dict`` takes it) and the checkpoint's common state
merged in. A flat dict of ShardedTensors (our model and optimizer dicts) writes exactly the files it
always did: no ``common_state.json`` and no object files when there is nothing of the kind.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import plain_data
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace, diff
from megatron.core.dist_checkpointing.errors import CheckpointingError
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)

SHARDED_BACKEND = "torch_dist"  # the one strategy: torch.distributed.checkpoint (Megatron-core's name)
logger = logging.getLogger(__name__)
COMMON_FILE = "common_state.json"  # not common.json: the training checkpoint writes that one itself
_SHARDED = (ShardedTensor, ShardedObject)


def _map(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``value`` with ``fn`` applied to every leaf (dicts and lists are walked, not leaves)."""
    return dict_list_map_outplace(fn, value)


def _leaves(value: Any) -> List[Any]:
    found: List[Any] = []
    _map(value, found.append)
    return found


def _common(value: Any) -> Any:
    """The common (unsharded, persistent) part of a nested dict; ``_DROP`` for the rest."""
    if isinstance(value, dict):
        kept = {k: _common(v) for k, v in value.items()}
        if value and all(v is _DROP for v in kept.values()):
            return _DROP  # a dict of sharded entries only is not common state
        return {k: v for k, v in kept.items() if v is not _DROP}
    if isinstance(value, list) and any(_common(v) is _DROP for v in _leaves(value)):
        return _DROP  # a list holding sharded entries is not common state
    if isinstance(value, (*_SHARDED, ShardedTensorFactory, LocalNonpersistentObject)):
        return _DROP
    return value


_DROP = object()


@dataclass
class Parts:
    """What a nested sharded state dict holds, by kind."""

    tensors: Dict[str, ShardedTensor] = field(default_factory=dict)
    duplicates: List[Tuple[ShardedTensor, ShardedTensor]] = field(default_factory=list)
    objects: List[ShardedObject] = field(default_factory=list)
    common: Dict[str, Any] = field(default_factory=dict)
    built: Dict[int, Any] = field(default_factory=dict)
    """id of each ShardedTensorFactory -> the sharded state dict it built (and load filled)."""


def split(sharded_state_dict: ShardedStateDict) -> Parts:
    """Factories built; ShardedTensors by key (a repeated key is read once and copied; further pieces of a
    key at other offsets, as the distributed optimizer's slices, by ``key@offset``), objects, common."""
    parts = Parts()
    common = _common(sharded_state_dict)
    parts.common = common if isinstance(common, dict) else {}

    def build(value: Any) -> Any:
        if isinstance(value, ShardedTensorFactory):
            parts.built[id(value)] = value.build()
            return parts.built[id(value)]
        return value

    built = _map(sharded_state_dict, build)
    for leaf in _leaves(built):
        if isinstance(leaf, ShardedObject):
            parts.objects.append(leaf)
        elif isinstance(leaf, ShardedTensor):
            first = parts.tensors.setdefault(leaf.key, leaf)
            if first is not leaf and first.global_offset != leaf.global_offset:  # another piece of the key
                first = parts.tensors.setdefault(f"{leaf.key}@{leaf.global_offset}", leaf)
            if first is not leaf:
                if (first.global_shape, first.global_offset, first.local_shape) != (
                    leaf.global_shape,
                    leaf.global_offset,
                    leaf.local_shape,
                ):
                    raise ValueError(f"two ShardedTensors with key {leaf.key!r} and different geometry on one rank")
                if leaf.replica_id == 0 and first.replica_id != 0:
                    parts.tensors[leaf.key], leaf = leaf, first  # the written copy goes to DCP
                parts.duplicates.append((parts.tensors[leaf.key], leaf))
    return parts


def _object_path(checkpoint_dir: str, obj: ShardedObject) -> str:
    relative = obj.unique_key + ".json"
    parts = relative.split("/")
    if any(p in ("", ".", "..") for p in parts) or os.path.isabs(relative):
        raise ValueError(f"ShardedObject key {obj.key!r}: not a safe relative path")
    return os.path.join(checkpoint_dir, *parts)


def side_files(parts: Parts, checkpoint_dir: str, rank: int) -> Tuple[List[Tuple[str, Any]], Optional[str]]:
    """(path, JSON data) this rank writes (rank 0 the common state, each rank its objects with
    replica 0), or an error message: a value that is not plain data, an unsafe key."""
    files: List[Tuple[str, Any]] = []
    try:
        if rank == 0 and parts.common:
            files.append((os.path.join(checkpoint_dir, COMMON_FILE), plain_data.encode(parts.common, "common")))
        for obj in parts.objects:
            if obj.replica_id == 0:
                files.append((_object_path(checkpoint_dir, obj), plain_data.encode(obj.data, obj.key)))
    except (TypeError, ValueError) as e:
        return [], f"cannot save {checkpoint_dir}: {e}"
    return files, None


def write_side_files(files: List[Tuple[str, Any]], write_json: Callable[[str, Any], None]) -> None:
    """Write what ``side_files`` listed."""
    for path, data in files:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json(path, data)


def load_common(checkpoint_dir: str, read_json: Callable[[str, str], dict]) -> Dict[str, Any]:
    """The common state a checkpoint holds; {} when it holds none (e.g. one our command line wrote)."""
    path = os.path.join(checkpoint_dir, COMMON_FILE)
    return plain_data.decode(read_json(path, "common state")) if os.path.isfile(path) else {}


def _merge(into: Dict[str, Any], other: Dict[str, Any]) -> Dict[str, Any]:
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


def loaded_state_dict(
    sharded_state_dict: ShardedStateDict, parts: Parts, checkpoint_dir: str, common: Dict[str, Any], read_json: Callable
) -> Dict[str, Any]:
    """The caller's nesting with loaded values (after the tensors of ``parts`` were filled in place)."""

    def leaf(value: Any) -> Any:
        if isinstance(value, ShardedTensorFactory):
            return value.merge_fn(_map(parts.built[id(value)], leaf))
        if isinstance(value, ShardedTensor):
            return value.data.view(value.data_shape) if value.data_shape is not None else value.data
        if isinstance(value, ShardedObject):
            path = _object_path(checkpoint_dir, value)
            return plain_data.decode(read_json(path, f"sharded object {value.unique_key}"))
        if isinstance(value, LocalNonpersistentObject):
            return value.unwrap()
        return _DROP

    loaded = _map(sharded_state_dict, leaf)
    pruned = _prune(loaded)
    return _merge(pruned, common) if isinstance(pruned, dict) else pruned


def _prune(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _prune(v) for k, v in value.items() if v is not _DROP}
    if isinstance(value, list):
        return [_prune(v) for v in value]
    return value


def copy_duplicates(parts: Parts) -> None:
    """Fill each repeated ShardedTensor from the one that was read."""
    with torch.no_grad():
        for read, other in parts.duplicates:
            if other.data.data_ptr() != read.data.data_ptr():
                other.data.copy_(read.data)


def missing_objects(parts: Parts, checkpoint_dir: str) -> Optional[str]:
    """The first ShardedObject this rank asks for that the checkpoint lacks, as an error message."""
    for obj in parts.objects:
        if not os.path.isfile(_object_path(checkpoint_dir, obj)):
            return f"sharded object {obj.unique_key!r} is not in the checkpoint {checkpoint_dir}"
    return None


def require_no_strategy(where: str, **strategies: Any) -> None:
    """Only torch.distributed.checkpoint is implemented: refuse another strategy by name."""
    for name, value in strategies.items():
        if value is None or (isinstance(value, tuple) and value and value[0] == SHARDED_BACKEND):
            continue
        raise CheckpointingError(f"{where}: {name}={value!r} not supported yet (only {SHARDED_BACKEND})")


def warn_if_common_differs(
    common: Dict[str, Any], preprocess: Optional[Callable[[Dict[str, Any]], Any]], group: Optional[dist.ProcessGroup]
) -> None:
    """Megatron-core's save check: each rank compares its common state with rank 0's (which alone is written).

    Rank 0 broadcasts its common state (after ``preprocess``, megatron-core's
    ``preprocess_common_before_consistancy_check``); every other rank whose own differs logs one
    warning naming the keys only on rank 0, only on itself, and those whose values differ.
    """
    mine = preprocess(common) if preprocess is not None else common
    rank = dist.get_rank(group)
    shared = [mine if rank == 0 else None]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if rank == 0:
        return
    only_rank0, only_here, mismatch = diff(shared[0], mine)
    if only_rank0 or only_here or mismatch:
        logger.warning(
            f"Rank {rank} common state dict differs from rank 0 common state dict. Keys only on rank 0: "
            f"{only_rank0}, Keys only on {rank}: {only_here}, Mismatched keys: {[m[0] for m in mismatch]}"
        )
