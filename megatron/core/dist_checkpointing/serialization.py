"""Save and load sharded state dicts with torch.distributed.checkpoint.

A checkpoint directory holds DCP's ``.metadata`` and ``__{rank}_0.distcp`` files
and, written last by rank 0 after every rank has finished, ``metadata.json``
(``{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "checksums": ...}``:
the size and SHA-256 of every other file, see ``checksums.py``). A directory without
``metadata.json`` is incomplete and is never loaded.

Both functions are collective over ``process_group`` (default: the world). Every
check that could fail on some ranks only is agreed on by all ranks before DCP's
own collectives start, so a bad checkpoint raises everywhere instead of hanging.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.utils import _DistWrapper

from megatron.core.dist_checkpointing import checksums, nested
from megatron.core.dist_checkpointing.agreement import agree_on_error
from megatron.core.dist_checkpointing.errors import CheckpointingError
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor
from megatron.core.dist_checkpointing.planner import ShardedLoadPlanner, ShardedSavePlanner
from megatron.core.dist_checkpointing.safe_metadata import SafeFileSystemReader, load_metadata_file
from megatron.core.dist_checkpointing.write_errors import WRITE_FAILURES, describe_write_failure

METADATA_FILE = "metadata.json"
BACKEND_METADATA = {"sharded_backend": nested.SHARDED_BACKEND, "sharded_backend_version": 1}
logger = logging.getLogger(__name__)


def write_json_atomic(path: str, data: object) -> None:
    """Write JSON to ``path`` through a temporary file and a rename (never half-written)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str, what: str) -> dict:
    """Parse a JSON object; missing or unreadable files raise CheckpointingError naming ``path``."""
    if not os.path.isfile(path):
        raise CheckpointingError(f"{what} not found: {path}")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointingError(f"{what} is corrupt: {path}: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointingError(f"{what} is corrupt: {path}: expected a JSON object")
    return data


def _check_values(sharded_sd: Dict[str, ShardedTensor]) -> None:
    for key, value in sharded_sd.items():
        if not isinstance(value, ShardedTensor):
            raise TypeError(f"sharded state dict entry {key!r} is a {type(value).__name__}, not a ShardedTensor")


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: Optional[Any] = None,
    common_strategy: Optional[Any] = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Optional[Callable] = None,
    content_metadata: Optional[dict] = None,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
) -> Optional[StagedSave]:
    """Write a sharded state dict (each rank its own pieces) into ``checkpoint_dir``; ``metadata.json`` last.

    Megatron-core's signature. The dict is flat (key -> ShardedTensor of that key) or nested as in
    Megatron-core (see ``nested.py``). Only the torch_dist strategy exists; the piece checks of
    ``validate_access_integrity`` are DCP's own and always run; with it (the default) a rank whose
    common state differs from rank 0's (after ``preprocess_common_before_consistancy_check``) logs
    a warning naming the keys, as upstream. With ``async_sharded_save`` the
    tensors are snapshotted and a ``StagedSave`` is returned instead: its ``write()`` (local, for a
    background writer) and then ``finalize()`` (collective) complete the checkpoint.

    Raises:
        CheckpointingError: another strategy or ``content_metadata`` asked for.
    """
    nested.require_no_strategy("save", sharded_strategy=sharded_strategy, common_strategy=common_strategy)
    if content_metadata is not None:
        raise CheckpointingError("save: content_metadata not supported yet")
    staged = stage_save(
        sharded_state_dict,
        checkpoint_dir,
        snapshot=async_sharded_save,
        process_group=process_group,
        validate_access_integrity=validate_access_integrity,
        preprocess_common=preprocess_common_before_consistancy_check,
    )
    if async_sharded_save:
        return staged
    staged.write()
    staged.finalize()
    return None


def stage_save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    snapshot: bool,
    process_group: Optional[dist.ProcessGroup] = None,
    buffers: Optional[Dict[Any, torch.Tensor]] = None,
    validate_access_integrity: bool = True,
    preprocess_common: Optional[Callable] = None,
) -> StagedSave:
    """Collective: side files, the directory and DCP's plan of who writes what; nothing of the tensors yet.

    ``snapshot``: the tensors are copied to host memory now (pinned from a GPU), so training may change
    them while ``StagedSave.write`` runs in the background; the bytes written are the same. ``buffers``
    keeps the host copies for the next snapshot (same key, offset, shape and dtype: no new allocation);
    the caller must not snapshot again before this save's ``write`` has finished. ``validate_access_integrity``:
    warn when this rank's common state differs from rank 0's (``preprocess_common`` applied first).
    """
    parts = nested.split(sharded_state_dict)
    _check_values(parts.tensors)
    rank = dist.get_rank(process_group)
    files, error = nested.side_files(parts, checkpoint_dir, rank)
    agree_on_error(error, process_group)
    if validate_access_integrity:  # after the agreement: every rank is here
        nested.warn_if_common_differs(parts.common, preprocess_common, process_group)
    if rank == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
        # Overwriting: the directory must not look complete while it is rewritten.
        for stale in (METADATA_FILE, nested.COMMON_FILE):
            if os.path.exists(os.path.join(checkpoint_dir, stale)):
                os.remove(os.path.join(checkpoint_dir, stale))
    dist.barrier(group=process_group)
    try:
        nested.write_side_files(files, write_json_atomic)
    except WRITE_FAILURES as e:
        error = describe_write_failure(e, checkpoint_dir)
    agree_on_error(error, process_group)
    tensors = {k: _snapshot(v, buffers) for k, v in parts.tensors.items()} if snapshot else parts.tensors
    return StagedSave(tensors, checkpoint_dir, process_group)


def _snapshot(spec: ShardedTensor, buffers: Optional[Dict[Any, torch.Tensor]] = None) -> ShardedTensor:
    """``spec`` over a host copy of its data (pinned when the data is on a GPU: the copy is asynchronous),
    in ``buffers``' copy of the same piece when it has one (freshly allocated memory costs a page fault per
    page on the first write, about as much as the copy itself)."""
    data, slot = spec.data.detach(), (spec.key, spec.global_offset)
    copy = None if buffers is None else buffers.get(slot)
    if copy is None or copy.shape != data.shape or copy.dtype != data.dtype:
        copy = torch.empty(data.shape, dtype=data.dtype, pin_memory=data.is_cuda)  # [local shape] host
        if buffers is not None:
            buffers[slot] = copy
    copy.copy_(data, non_blocking=data.is_cuda)
    return ShardedTensor.from_global(
        spec.key, copy, spec.global_shape, spec.global_offset, spec.replica_id, data_shape=spec.data_shape
    )


class StagedSave:
    """One planned torch_dist save in three steps: ``plan`` (collective, at construction), ``write``
    (this rank's shard files, fsynced and hashed; no collective, so a background thread may run it)
    and ``finalize`` (collective: DCP's ``.metadata``, the checksum table, ``metadata.json`` last).

    A failure in ``write`` is kept and raised on every rank by ``finalize``.
    """

    def __init__(
        self,
        tensors: Dict[str, ShardedTensor],
        checkpoint_dir: str,
        process_group: Optional[dist.ProcessGroup],
        use_dist: bool = True,
    ) -> None:
        self.checkpoint_dir, self.process_group = checkpoint_dir, process_group
        self._planner = ShardedSavePlanner()
        self._writer = FileSystemWriter(checkpoint_dir)  # sync_files: every shard file is fsynced
        self._dist = _DistWrapper(process_group, use_dist, 0)  # use_dist=False: DCP's plan of this rank alone
        self._metadata: Optional[Metadata] = None
        self._results: Optional[list] = None
        self._table: checksums.FileTable = {}
        self._error: Optional[BaseException] = None
        self._plan = self._dist.reduce_scatter("plan", lambda: self._local_plan(tensors), self._global_plan)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the snapshot's copies are complete before anyone reads them

    def _local_plan(self, tensors: Dict[str, ShardedTensor]) -> Any:
        coordinator = self._dist.is_coordinator
        self._planner.set_up_planner(tensors, storage_meta=self._writer.storage_meta(), is_coordinator=coordinator)
        self._writer.set_up_storage_writer(coordinator, rank=self._dist.rank, use_collectives=True)
        return self._writer.prepare_local_plan(self._planner.create_local_plan())

    def _global_plan(self, plans: list) -> list:
        plans, self._metadata = self._planner.create_global_plan(plans)
        return self._writer.prepare_global_plan(plans)

    def write(self) -> None:
        """This rank's shard files, fsynced, then their checksums (local: safe off the main thread)."""
        try:
            future = self._writer.write_data(self._planner.finish_plan(self._plan), self._planner)
            future.wait()
            self._results = future.value()
            names = sorted({r.storage_data.relative_path for r in self._results})
            self._table, error = checksums.hash_files(self.checkpoint_dir, names)
            if error is not None:
                raise OSError(error)
        except BaseException as e:  # noqa: BLE001 - raised on every rank by finalize
            self._error = e

    def _written(self) -> list:
        if self._error is not None:
            raise self._error
        return self._results

    def finalize(self) -> None:
        """Collective: rank 0 writes ``.metadata`` after every rank's files, then ``metadata.json``."""
        if self._results is None and self._error is None:
            raise CheckpointingError(f"StagedSave.finalize before write: {self.checkpoint_dir}")
        self._dist.all_reduce("write", self._written, self._finish)
        table, error = checksums.gather_checksums(
            self.checkpoint_dir, METADATA_FILE, self.process_group, done=self._table
        )
        if self._dist.rank == 0 and error is None:
            try:
                metadata = dict(BACKEND_METADATA, checksums=table)
                write_json_atomic(os.path.join(self.checkpoint_dir, METADATA_FILE), metadata)
            except WRITE_FAILURES as e:
                error = describe_write_failure(e, self.checkpoint_dir)
        agree_on_error(error, self.process_group)  # rank 0's failure raises everywhere

    def _finish(self, results: list) -> Metadata:
        self._writer.finish(metadata=self._metadata, results=results)
        return self._metadata


def check_sharded_checkpoint(checkpoint_dir: str) -> None:
    """Raise CheckpointingError unless ``checkpoint_dir`` is a complete torch_dist checkpoint."""
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointingError(f"checkpoint directory not found: {checkpoint_dir}")
    info = read_json(
        os.path.join(checkpoint_dir, METADATA_FILE),
        "sharded checkpoint metadata (missing: the checkpoint is incomplete or not a torch_dist checkpoint)",
    )
    if info.get("sharded_backend") != nested.SHARDED_BACKEND:
        raise CheckpointingError(
            f"{os.path.join(checkpoint_dir, METADATA_FILE)}: sharded_backend "
            f"{info.get('sharded_backend')!r} is not supported (expected {nested.SHARDED_BACKEND!r})"
        )


def check_is_distributed_checkpoint(checkpoint_dir: str) -> bool:
    """Whether ``checkpoint_dir`` holds a complete sharded checkpoint (its ``metadata.json``), as Megatron-core."""
    return os.path.isfile(os.path.join(checkpoint_dir, METADATA_FILE))


def read_metadata(checkpoint_dir: str) -> Metadata:
    """DCP's metadata of a complete checkpoint; checks every data file is there and long enough."""
    check_sharded_checkpoint(checkpoint_dir)
    metadata = load_metadata_file(os.path.join(checkpoint_dir, ".metadata"))
    ends: Dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = os.path.join(checkpoint_dir, name)
        if not os.path.isfile(path):
            raise CheckpointingError(f"checkpoint data file missing: {path}")
        if os.path.getsize(path) < end:
            raise CheckpointingError(
                f"checkpoint data file truncated: {path} has {os.path.getsize(path)} bytes, the metadata needs {end}"
            )
    return metadata


def saved_tensor(metadata: Metadata, key: str, checkpoint_dir: str) -> TensorStorageMetadata:
    """The metadata of ``key``, which must be saved as a tensor (not missing, not a bytes entry)."""
    saved = metadata.state_dict_metadata
    if key not in saved:
        raise CheckpointingError(f"key {key!r} is not in the checkpoint {checkpoint_dir}")
    if not isinstance(saved[key], TensorStorageMetadata):
        raise CheckpointingError(f"key {key!r} in {checkpoint_dir} is not a tensor")
    return saved[key]


def check_against_metadata(sharded_sd: ShardedStateDict, metadata: Metadata, checkpoint_dir: str) -> None:
    """Every key must be saved as a tensor of the same global shape."""
    for key, spec in sharded_sd.items():
        md = saved_tensor(metadata, key, checkpoint_dir)
        if tuple(md.size) != spec.global_shape:
            raise CheckpointingError(
                f"shape mismatch for key {key!r}: checkpoint {checkpoint_dir} has "
                f"{tuple(md.size)}, the model expects {spec.global_shape}"
            )


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: Optional[Any] = None,
    common_strategy: Optional[Any] = None,
    validate_access_integrity: bool = True,
    strict: str = "assume_ok_unexpected",
    *,
    process_group: Optional[dist.ProcessGroup] = None,
) -> Dict[str, Any]:
    """Fill every ShardedTensor's ``data`` in place from ``checkpoint_dir``.

    Megatron-core's signature and result: the same nesting as ``sharded_state_dict`` with each
    ShardedTensor replaced by its (filled) tensor in the shape its caller gave, ShardedObjects and
    factories by their loaded values, and the checkpoint's common state merged in. Missing or
    differently shaped keys always raise (Megatron-core's ``strict`` default tolerates only
    unexpected keys, which cannot occur here: only the keys asked for are read).

    Raises:
        CheckpointingError: on every rank, if any rank finds the directory missing,
            incomplete, corrupt, or without a key / with another shape for a key.
    """
    nested.require_no_strategy("load", sharded_strategy=sharded_strategy, common_strategy=common_strategy)
    del validate_access_integrity  # the checks below always run
    if getattr(strict, "value", strict) != "assume_ok_unexpected":
        raise CheckpointingError(f"load: strict={strict!r} not supported yet (only 'assume_ok_unexpected')")
    parts = nested.split(sharded_state_dict)
    _check_values(parts.tensors)
    error = None
    try:
        check_against_metadata(parts.tensors, read_metadata(checkpoint_dir), checkpoint_dir)
        error = nested.missing_objects(parts, checkpoint_dir)
    except CheckpointingError as e:
        error = str(e)
    agree_on_error(error, process_group)
    try:
        dcp.load(
            parts.tensors,
            storage_reader=SafeFileSystemReader(checkpoint_dir),
            planner=ShardedLoadPlanner(),
            process_group=process_group,
        )
    except Exception as e:  # noqa: BLE001 - DCP raises on every rank; name the checkpoint
        raise CheckpointingError(f"failed to read checkpoint {checkpoint_dir}: {e}") from e
    nested.copy_duplicates(parts)
    return nested.loaded_state_dict(
        sharded_state_dict, parts, checkpoint_dir, nested.load_common(checkpoint_dir, read_json), read_json
    )


def load_common_state_dict(checkpoint_dir: str) -> Dict[str, Any]:
    """The common (unsharded) state a complete checkpoint holds; {} when it holds none."""
    check_sharded_checkpoint(checkpoint_dir)
    return nested.load_common(checkpoint_dir, read_json)


def load_tensors_metadata(checkpoint_dir: str, sharded_strategy: Optional[Any] = None) -> Dict[str, ShardedTensor]:
    """Every tensor of the checkpoint as a whole ShardedTensor whose ``data`` is on the meta device
    (shape and dtype, no values; Megatron-core's have ``data=None``)."""
    nested.require_no_strategy("load_tensors_metadata", sharded_strategy=sharded_strategy)
    out = {}
    for key, md in read_metadata(checkpoint_dir).state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            shape = tuple(md.size)
            data = torch.empty(shape, dtype=md.properties.dtype, device="meta")
            out[key] = ShardedTensor.from_global(key, data, shape, (0,) * len(shape))
    return out


def load_plain_tensors(checkpoint_dir: str) -> Dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, whole, by checkpoint key (read on this rank alone)."""
    metadata = read_metadata(checkpoint_dir)
    whole = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            shape = tuple(md.size)
            whole[key] = ShardedTensor.from_global(
                key, torch.empty(shape, dtype=md.properties.dtype), shape, (0,) * len(shape)
            )
    dcp.load(whole, storage_reader=SafeFileSystemReader(checkpoint_dir), planner=ShardedLoadPlanner(), no_dist=True)
    return {key: spec.data for key, spec in whole.items()}


def verify_checksums(checkpoint_dir: str, process_group: Optional[dist.ProcessGroup] = None) -> bool:
    """Collective: every rank re-hashes its share of the files ``metadata.json`` lists; all raise on a mismatch.

    Returns False, with a warning, for a checkpoint saved without checksums (before they were
    recorded, or by Megatron-LM). Files in the directory that the table does not list are named
    in a warning and not checked.
    """
    where = os.path.join(checkpoint_dir, METADATA_FILE)
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    error, files = None, None
    try:
        recorded = read_json(where, "sharded checkpoint metadata").get("checksums")
        if recorded is not None:
            files = checksums.check_table(recorded, where)
            checksums.verify_files(checkpoint_dir, files, checksums.verification_share(files, rank, world), where)
    except (CheckpointingError, OSError) as e:
        error = str(e)
    agree_on_error(error, process_group)
    if rank == 0 and files is None:
        logger.warning("%s records no checksums (an older checkpoint): its files are not verified", where)
    elif rank == 0:
        unlisted = sorted(set(checksums.list_files(checkpoint_dir, METADATA_FILE)) - set(files))
        if unlisted:
            logger.warning("%s does not list %s: not verified", where, ", ".join(unlisted))
    return files is not None
