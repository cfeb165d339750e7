"""Checkpoint storage for fake tensors: our save/load code runs, the bytes are stand-ins.

Fake tensors hold no data, so the storage layer is replaced, and nothing above it:

* ``torch.distributed.checkpoint.save`` and ``serialization.StagedSave`` (the sharded save's plan and
  write): each piece is recorded (key, shape, dtype, device),
  our save planner resolves every piece of the real state dict (its ``.cpu()`` copies are
  recorded), then DCP writes zero-filled real tensors of the same shapes with our planner
  on this rank alone (``no_dist``), every piece this rank holds included, so the rank can
  read its own pieces back.
* ``torch.distributed.checkpoint.load``: DCP reads those files with our load planner into
  real CPU tensors, which are then copied into the model's and optimizer's tensors, as
  DCP's file reader does.
* ``torch.save`` / ``torch.load`` (the legacy ``--ckpt-format torch``): a skeleton of the
  object (structure, tensor shapes, dtypes, devices) is written; loading rebuilds it with
  fake tensors on ``map_location``'s device (CPU for our loader, as on a GPU machine). A
  leaf that ``torch.load(weights_only=True)`` would refuse (an enum, any object) raises.
* Files only rank 0 writes (``common.json``, ``metadata.json`` and its checksums, the
  tracker) are written by this rank too: inside ``save_checkpoint`` / ``load_checkpoint``
  the checkpoint modules' ``torch.distributed.get_rank()`` (world group) answers 0, so the
  RNG file is named and read as rank 0's. In the legacy format every rank also writes its data-parallel rank 0 peer's
  file (same tensor shapes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import sys
from typing import Any, Callable, Dict, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch._subclasses.fake_tensor import unset_fake_temporarily

from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.planner import ShardedSavePlanner
from megatron.training.checkpoint_formats.base import TORCH
from megatron.training.checkpoint_formats.registry import get_format
from tools.dry_run.fake_cuda import Patcher, describe_tensor
from tools.dry_run.report import CheckpointRuleError, Recorder

SKELETON_MAGIC = b"MEGATRON-DRY-RUN-SKELETON\n"
_WEIGHTS_ONLY_LEAVES = (type(None), bool, int, float, str, torch.dtype)
# Modules whose ``dist.get_rank()`` decides who writes checkpoint files.
RANK0_DUTY_MODULES = (
    "megatron.training.checkpointing",
    "megatron.training.checkpoint_formats.common",
    "megatron.training.checkpoint_formats.torch_dist",
    "megatron.training.checkpoint_formats.torch_legacy",
    "megatron.core.dist_checkpointing.serialization",
    "megatron.core.dist_checkpointing.checksums",
)
_TENSOR = "__dry_run_tensor__"


def _skeleton(value: Any, path: str = "$") -> Any:
    """JSON of ``value`` with tensors described; leaves ``torch.load(weights_only=True)`` refuses raise."""
    if isinstance(value, torch.Tensor):
        return {
            _TENSOR: {
                "shape": list(value.shape),
                "dtype": str(value.dtype).replace("torch.", ""),
                "device": str(value.device),
            }
        }
    if isinstance(value, dict):
        return {"__dict__": [[_skeleton(k, path), _skeleton(v, f"{path}[{k!r}]")] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {
            "__list__" if isinstance(value, list) else "__tuple__": [
                _skeleton(v, f"{path}[{i}]") for i, v in enumerate(value)
            ]
        }
    if type(value) not in _WEIGHTS_ONLY_LEAVES:
        raise CheckpointRuleError(
            f"torch.save: {path} is a {type(value).__module__}.{type(value).__qualname__}; "
            "the loader reads .pt files with torch.load(weights_only=True), which refuses it "
            "(store plain numbers, strings and tensors)"
        )
    return str(value) if isinstance(value, torch.dtype) else value


def _rebuild(value: Any, map_location: Optional[str]) -> Any:
    if not isinstance(value, dict):
        return value
    if _TENSOR in value:
        spec = value[_TENSOR]
        device = map_location if map_location is not None else spec["device"]
        return torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=device)
    if "__dict__" in value:
        return {_rebuild(k, map_location): _rebuild(v, map_location) for k, v in value["__dict__"]}
    items = [_rebuild(v, map_location) for v in value.get("__list__", value.get("__tuple__", []))]
    return items if "__list__" in value else tuple(items)


def _fake_torch_save(original: Callable) -> Callable:
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        payload = SKELETON_MAGIC + json.dumps(_skeleton(obj)).encode()
        if isinstance(f, (str, bytes)) or hasattr(f, "__fspath__"):
            with open(f, "wb") as out:
                out.write(payload)
        else:
            f.write(payload)

    return save


def _fake_torch_load(original: Callable) -> Callable:
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, (str, bytes)) or hasattr(f, "__fspath__"):
            with open(f, "rb") as src:
                data = src.read()
        else:
            data = f.read()
        if not data.startswith(SKELETON_MAGIC):
            return original(io.BytesIO(data), map_location, *args, **kwargs)
        location = None if map_location is None else str(torch.device(map_location))
        return _rebuild(json.loads(data[len(SKELETON_MAGIC) :]), location)

    return load


def _real_twin(spec: Any, fill: bool) -> Any:
    """The ShardedTensor with a real CPU tensor of the same shape (zeros to write, empty to read)."""
    with unset_fake_temporarily():
        data = (
            torch.zeros(spec.local_shape, dtype=spec.data.dtype)
            if fill
            else torch.empty(spec.local_shape, dtype=spec.data.dtype)
        )
    return dataclasses.replace(spec, data=data, replica_id=0 if fill else spec.replica_id)


@contextlib.contextmanager
def _host_only() -> Iterator[None]:
    """Real DCP on real CPU tensors: outside the fake mode, and torch.cuda as it really is (absent)."""
    available = torch.cuda.is_available
    torch.cuda.is_available = lambda: False
    try:
        with unset_fake_temporarily():
            yield
    finally:
        torch.cuda.is_available = available


def _dcp_save(recorder: Recorder, original: Callable) -> Callable:
    def save(
        state_dict: Dict[str, Any],
        *,
        storage_writer: Any = None,
        planner: Any = None,
        process_group: Any = None,
        **kwargs: Any,
    ) -> Any:
        for key, spec in state_dict.items():
            recorder.add("ckpt-write", key, {"tensor": describe_tensor(spec.data), "replica_id": spec.replica_id})
        resolver = type(planner)()
        resolver.set_up_planner(state_dict, is_coordinator=True)
        for item in resolver.create_local_plan().items:
            resolver.resolve_data(item)  # the copies DCP's writer would make, on the fake tensors
        twins = {key: _real_twin(spec, fill=True) for key, spec in state_dict.items()}
        with _host_only():
            return original(twins, storage_writer=storage_writer, planner=planner, no_dist=True)

    return save


def _staged_save(recorder: Recorder) -> type:
    """``serialization.StagedSave`` planning (on this rank alone, as ``no_dist``) and writing zero-filled real
    twins of the recorded pieces, each this rank holds (as ``dcp.save`` is replaced above)."""

    class StandInSave(serialization.StagedSave):
        def __init__(self, tensors: Dict[str, Any], checkpoint_dir: str, process_group: Any = None) -> None:
            for key, spec in tensors.items():
                recorder.add("ckpt-write", key, {"tensor": describe_tensor(spec.data), "replica_id": spec.replica_id})
            resolver = ShardedSavePlanner()
            resolver.set_up_planner(tensors, is_coordinator=True)
            for item in resolver.create_local_plan().items:
                resolver.resolve_data(item)  # the copies DCP's writer would make, on the fake tensors
            twins = {key: _real_twin(spec, fill=True) for key, spec in tensors.items()}
            with _host_only():
                super().__init__(twins, checkpoint_dir, process_group, use_dist=False)

        def write(self) -> None:
            with _host_only():
                super().write()

    return StandInSave


def _dcp_load(recorder: Recorder, original: Callable) -> Callable:
    def load(
        state_dict: Dict[str, Any],
        *,
        storage_reader: Any = None,
        planner: Any = None,
        process_group: Any = None,
        **kwargs: Any,
    ) -> None:
        twins = {key: _real_twin(spec, fill=False) for key, spec in state_dict.items()}
        with _host_only():
            original(twins, storage_reader=storage_reader, planner=planner, no_dist=True)
        with torch.no_grad():
            for key, spec in state_dict.items():
                recorder.add("ckpt-read", key, {"tensor": describe_tensor(spec.data)})
                spec.data.copy_(twins[key].data)  # as DCP's reader copies into the target tensor

    return load


class _DpRankZero:
    """Process groups as seen by this rank's data-parallel rank 0 peer (the legacy writer)."""

    def __init__(self, groups: Any) -> None:
        self._groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._groups, name)

    def rank_in(self, name: str) -> int:
        return 0 if name in ("dp", "cp") else self._groups.rank_in(name)


class CheckpointIO:
    """Installs the storage stand-ins and the rank-0 duties (see the module docstring)."""

    def __init__(self, patcher: Patcher, recorder: Recorder) -> None:
        self.patcher, self.recorder = patcher, recorder
        self.acting_as_rank0 = False

    def install(self) -> None:
        from megatron.training import training

        patcher = self.patcher
        patcher.set(dcp, "save", _dcp_save(self.recorder, dcp.save))
        patcher.set(dcp, "load", _dcp_load(self.recorder, dcp.load))
        patcher.set(serialization, "StagedSave", _staged_save(self.recorder))
        patcher.set(torch, "save", _fake_torch_save(torch.save))
        patcher.set(torch, "load", _fake_torch_load(torch.load))
        real_get_rank = dist.get_rank

        def get_rank(group: Any = None) -> int:
            world = group is None or group is dist.group.WORLD
            duty = self.acting_as_rank0 and sys._getframe(1).f_globals.get("__name__") in RANK0_DUTY_MODULES
            return 0 if duty and world else real_get_rank(group)

        patcher.set(dist, "get_rank", get_rank)
        for name, segment in (("save_checkpoint", "save"), ("load_checkpoint", "load")):
            patcher.set(training, name, self._duties(getattr(training, name), segment))
        legacy = get_format(TORCH)
        legacy_save = legacy.save
        patcher.set(
            legacy,
            "save",
            lambda request: legacy_save(dataclasses.replace(request, groups=_DpRankZero(request.groups))),
        )

    def _duties(self, function: Callable, segment: str) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.acting(segment if segment == "load" else f"save {args[0]}"):
                return function(*args, **kwargs)

        return wrapper

    @contextlib.contextmanager
    def acting(self, segment: str) -> Iterator[None]:
        previous, self.recorder.segment, self.acting_as_rank0 = self.recorder.segment, segment, True
        try:
            yield
        finally:
            self.recorder.segment, self.acting_as_rank0 = previous, False
