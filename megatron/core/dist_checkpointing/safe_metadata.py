"""Read DCP's ``.metadata`` without running code from it.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain
``pickle.load``: a crafted file runs any command the moment a checkpoint is opened.
``SafeFileSystemReader`` replaces that one method. Its unpickler resolves only the
classes DCP's metadata is made of (the dataclasses of
``torch.distributed.checkpoint.metadata``, ``_StorageInfo``, ``torch.Size``, torch
dtypes and layouts, paths); anything else is refused before it is imported or
called. The result is then checked structurally, so a file that unpickles but is not
DCP metadata (or points a shard outside the checkpoint directory) is refused too.
Every error is a ``CheckpointingError`` naming the file.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import pickle
from typing import Any, Dict, Iterator, Tuple

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from megatron.core.dist_checkpointing.errors import CheckpointingError

METADATA_NAME = ".metadata"
_MAX_METADATA_BYTES = 1 << 30  # a real .metadata is KBs to MBs; refuse to slurp a huge file into memory

_DCP_CLASSES = (
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "_MEM_FORMAT_ENCODING",
)


def _allowed_globals() -> Dict[Tuple[str, str], Any]:
    """(module, name) -> object for everything a DCP metadata pickle may reference."""
    allowed: Dict[Tuple[str, str], Any] = {
        (dcp_metadata.__name__, name): getattr(dcp_metadata, name)
        for name in _DCP_CLASSES
        if hasattr(dcp_metadata, name)
    }
    allowed[(_StorageInfo.__module__, "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = _get_layout
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath, pathlib.Path):
        allowed[("pathlib", cls.__name__)] = cls
    return allowed


def _get_layout(name: str) -> torch.layout:
    """Stand-in for ``torch.serialization._get_layout``: only torch's own layout names."""
    value = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return value


# What BUILD can change on an allowed function besides its __dict__ (``__closure__`` and
# ``__globals__`` are read-only; their contents are reached only through these).
_FUNCTION_ATTRS = ("__defaults__", "__kwdefaults__", "__code__", "__name__", "__qualname__", "__module__", "__doc__")


def _state(obj: Any) -> Dict[str, Any]:
    """Everything a pickle's BUILD could set on an allowed class or function (``setattr`` targets)."""
    state = dict(vars(obj))
    if callable(obj) and not isinstance(obj, type):
        state.update({name: getattr(obj, name) for name in _FUNCTION_ATTRS})
        state["__annotations__"] = dict(obj.__annotations__)
    return state


def _restore(obj: Any, before: Dict[str, Any]) -> None:
    """Undo changes to ``obj`` against its ``_state`` snapshot."""
    for name in set(vars(obj)) - set(before):
        delattr(obj, name)
    for name, value in before.items():
        if name == "__annotations__":
            obj.__annotations__ = value
        elif getattr(obj, name, _MISSING) is not value:
            setattr(obj, name, value)


@contextlib.contextmanager
def _allowed_unchanged() -> Iterator[None]:
    """Refuse a pickle that sets attributes on an allowed class or function itself.

    ``find_class`` limits which globals a pickle can name, not what BUILD does with them: a
    BUILD aimed at a global (dict or slot state) updates its ``__dict__`` or calls ``setattr``
    on it, and would change a class's methods or a function's ``__defaults__`` or ``__code__``
    for the whole process. Every allowed global's state (``_state``) is compared before and
    after; a change is undone and refused.
    """
    allowed = {id(obj): obj for obj in _RestrictedUnpickler._ALLOWED.values()}.values()
    before = {id(obj): _state(obj) for obj in allowed}
    try:
        yield
    finally:
        changed = [obj for obj in allowed if _state(obj) != before[id(obj)]]
        for obj in changed:
            _restore(obj, before[id(obj)])
    if changed:
        names = ", ".join(sorted(f"{'class' if isinstance(o, type) else 'function'} {o.__qualname__}" for o in changed))
        raise pickle.UnpicklingError(f"refusing a pickle that modifies the {names}")


_MISSING = object()


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler whose ``find_class`` knows only DCP metadata types."""

    _ALLOWED = _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        found = self._ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # dtypes pickle as the global torch.<name>
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not a checkpoint-metadata type")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing persistent ids: checkpoint metadata holds no tensors")


def _check_storage_info(info: Any, where: str) -> None:
    if not isinstance(info, _StorageInfo):
        raise ValueError(f"{where}: storage entry is a {type(info).__name__}, not _StorageInfo")
    name = info.relative_path
    if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", ".."):
        raise ValueError(f"{where}: shard file name {name!r} must be a plain file name inside the checkpoint")
    if not all(isinstance(v, int) and v >= 0 for v in (info.offset, info.length)):
        raise ValueError(f"{where}: offset/length of {name!r} must be non-negative integers")
    if getattr(info, "transform_descriptors", None):  # we never write compressed shards: no decompression bombs
        raise ValueError(f"{where}: shard {name!r} asks for stream transforms {info.transform_descriptors!r}")


def validate_metadata(metadata: Any, where: str) -> Metadata:
    """Check that an unpickled object has DCP's metadata structure; returns it."""
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{where}: holds a {type(metadata).__name__}, not DCP Metadata")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise ValueError(f"{where}: state_dict_metadata is not a dict")
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(md, (TensorStorageMetadata, BytesStorageMetadata)):
            raise ValueError(f"{where}: entry {key!r} is not a tensor or bytes description")
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(index, MetadataIndex):
            raise ValueError(f"{where}: storage key {index!r} is not a MetadataIndex")
        _check_storage_info(info, where)
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        raise ValueError(f"{where}: storage_meta is a {type(metadata.storage_meta).__name__}")
    return metadata


def load_metadata_file(path: str) -> Metadata:
    """Unpickle and validate one ``.metadata`` file; failures raise ``CheckpointingError`` naming it."""
    try:
        size = os.path.getsize(path)
        if size > _MAX_METADATA_BYTES:
            raise ValueError(f"{size} bytes is more than any checkpoint metadata")
        with open(path, "rb") as f:
            data = f.read()
        with _allowed_unchanged():
            metadata = _RestrictedUnpickler(io.BytesIO(data)).load()
        return validate_metadata(metadata, path)
    except Exception as e:  # noqa: BLE001 - find_class admits no code; whatever else breaks is corruption
        raise CheckpointingError(f"unsafe or corrupt checkpoint metadata {path}: {e}") from e


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by the restricted unpickler above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"
        metadata = load_metadata_file(os.path.join(str(self.path), name))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
