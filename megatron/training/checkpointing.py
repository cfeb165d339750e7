"""Checkpoint save and resume for the training application, in Megatron's directory layout.

```
SAVE/latest_checkpointed_iteration.txt     "1000" or "release"; replaced atomically, after the checkpoint is complete
SAVE/iter_0001000/                         --ckpt-format torch_dist (default)
    .metadata, __{rank}_0.distcp           model and optimizer tensors (torch.distributed.checkpoint)
    common.json                            iteration, train state, scheduler, args, optimizer scalars (plain JSON)
    rng/rank_{rank:05d}.json               each rank's RNG states
    metadata.json                          written last: the directory is complete; size and SHA-256 of each file
SAVE/iter_0001000/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt     --ckpt-format torch (legacy)
SAVE/iter_0001000/checksums.json           torch format: size and SHA-256 of each .pt file (written after them)
```

Nothing is pickled except tensors in legacy ``.pt`` files, which are read with
``torch.load(weights_only=True)``. A torch_dist checkpoint loads under any TP/PP/DP
layout; RNG states are restored only under the layout that saved them.

Trust: a load checks the files' checksums (``--no-verify-checkpoint`` skips it), the saved
architecture flags against the run's (``checkpoint_args.py``) and that every saved tensor is
used (``--dist-ckpt-strictness``); a failed write names the directory and the cause (full
disk, file-size limit) and leaves the tracker on the last complete checkpoint; start-up
refuses an unwritable ``--save`` and a run that would overwrite complete checkpoints.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import CheckpointingError, checksums, plain_data
from megatron.core.dist_checkpointing.agreement import agree_on_error
from megatron.core.dist_checkpointing.async_save import AsyncCallsQueue, AsyncRequest
from megatron.core.dist_checkpointing.serialization import read_json, stage_save, write_json_atomic
from megatron.core.dist_checkpointing.validation import apply_strictness, parse_strictness
from megatron.core.dist_checkpointing.write_errors import WRITE_FAILURES, describe_write_failure
from megatron.core.fp8_utils import drop_fp8_checkpoint_values, load_fp8_checkpoint_values
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker, get_cuda_rng_tracker
from megatron.core.utils import named_model_params, unwrap_model
from megatron.training import run_report
from megatron.training.checkpoint_args import apply_checkpoint_args, check_checkpoint_args
from megatron.training.checkpoint_config import SUPPORTED_FORMATS, CheckpointConfig  # noqa: F401 - re-exported
from megatron.training.checkpoint_dirs import (  # noqa: F401
    TRACKER_FILE,
    checkpoint_dir,
    complete_checkpoints,
    detect_format,
    iteration_to_load,
    load_target,
    missing_checkpoint,
    no_checkpoint_message,
    read_tracker,
    refuse_untracked,
    save_dir_problem,
    update_tracker,
)
from megatron.training.flags.registry import config_from_args
from megatron.training.rng_state import collect_rng_state, restore_rng_state  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

CHECKPOINT_VERSION = 3.0
COMMON_FILE = "common.json"
RNG_DIR = "rng"
LEGACY_FILE = "model_optim_rng.pt"
LEGACY_CHECKSUMS = "checksums.json"  # torch format: size and SHA-256 of each .pt file, written last


def check_save_dir(cfg: CheckpointConfig) -> None:
    """Collective, at start-up: ``--save`` is writable, and this run would overwrite none of its checkpoints.

    Rank 0 creates the directory and a probe file; every rank raises if it failed.
    """
    error = save_dir_problem(cfg) if dist.get_rank() == 0 else None
    agree_on_error(error, None)


# ---------------------------------------------------------------- plain data
def args_to_plain_data(args: Any) -> Dict[str, Any]:
    """An argparse namespace (or dict) as JSON-able data: dtypes and callables by name, others by str."""
    items = vars(args) if not isinstance(args, dict) else args

    def plain(value: Any) -> Any:
        if isinstance(value, enum.Enum) and isinstance(value, (int, float, str)):
            return value.value  # e.g. --exit-signal's signal.Signals: pickled, torch.load(weights_only) refuses it
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, torch.dtype):
            return str(value)
        return getattr(value, "__name__", None) or str(value)

    return {str(k): plain(v) for k, v in items.items()}


def _require_plain(name: str, value: Any) -> None:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be plain data (JSON: dict, list, str, numbers, bool, None): {e}") from e


def _layout(groups: ProcessGroupCollection) -> Dict[str, int]:
    layout = {
        "world_size": dist.get_world_size(),
        "tp": groups.size_of("tp"),
        "pp": groups.size_of("pp"),
        "dp": groups.size_of("dp"),
        "cp": groups.size_of("cp"),
    }
    if groups.size_of("ep") > 1:  # absent at EP=1, as in checkpoints written before expert parallelism
        layout["ep"] = groups.size_of("ep")
    return layout


def _refuse_legacy_with_ep(groups: ProcessGroupCollection) -> None:
    if groups.size_of("ep") > 1:
        raise CheckpointingError(
            f"--ckpt-format torch with expert_model_parallel_size={groups.size_of('ep')}: "
            "not supported yet (use --ckpt-format torch_dist)"
        )


# ---------------------------------------------------------------- save
def save_checkpoint(
    iteration: int,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
    ckpt_config: CheckpointConfig,
    train_state: Dict[str, Any],
    args_dict: Dict[str, Any],
    pg_collection: Optional[ProcessGroupCollection] = None,
    rng_tracker: Optional[CudaRNGStatesTracker] = None,
    async_queue: Optional[AsyncCallsQueue] = None,
) -> str:
    """Write ``SAVE/iter_{iteration:07d}`` on every rank, then point the tracker at it; returns the dir.

    Collective over the world. ``train_state`` (consumed samples, FLOPs so far, ...) and
    ``args_dict`` must be plain data (see ``args_to_plain_data``). ``rng_tracker`` is the run's
    model-parallel RNG tracker (the training loop passes its own; None: ``get_cuda_rng_tracker()``).
    With ``async_queue`` (``--async-save``, torch_dist only) the tensors are snapshotted and written
    by its background writer; ``metadata.json`` and the tracker follow when the queue finalizes the
    request, after every rank's files are durable (``async_save.py``).
    """
    if ckpt_config.save is None:
        raise ValueError("save_checkpoint needs CheckpointConfig.save (--save)")
    if async_queue is not None and ckpt_config.ckpt_format != "torch_dist":
        raise CheckpointingError(f"an asynchronous save needs --ckpt-format torch_dist, not {ckpt_config.ckpt_format}")
    _require_plain("train_state", train_state)
    _require_plain("args_dict", args_dict)
    for chunk in model_chunks:  # --overlap-param-gather leaves gathers running after the step
        if hasattr(chunk, "finish_param_sync"):
            chunk.finish_param_sync()
    groups = dc.model_process_groups(unwrap_model(model_chunks[0]), pg_collection)
    iter_dir = checkpoint_dir(ckpt_config.save, iteration)
    common = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "train_state": train_state,
        "opt_param_scheduler": opt_param_scheduler.state_dict() if opt_param_scheduler is not None else None,
        "args": args_dict,
        "layout": _layout(groups),
        "ckpt_format": ckpt_config.ckpt_format,
    }
    _require_plain("opt_param_scheduler.state_dict()", common["opt_param_scheduler"])
    save_optim = optimizer is not None and not ckpt_config.no_save_optim
    rng_state = None if ckpt_config.no_save_rng else collect_rng_state(rng_tracker or get_cuda_rng_tracker())
    started = time.time()
    run_report.report(run_report.saving_line(iteration, ckpt_config.save, ckpt_config.ckpt_format))

    if async_queue is not None and async_queue.get_num_unfinalized_calls():
        logger.warning("checkpoint %d: the previous save is still being written; waiting for it", iteration)
        async_queue.maybe_finalize_async_calls(blocking=True)  # its snapshot buffers are reused now
    staging = None if async_queue is None else async_queue.staging_buffers
    optim = optimizer if save_optim else None

    def write() -> Optional[dc.StagedSave]:
        _agreed_write(lambda: _start_directory(iter_dir), iter_dir)
        if ckpt_config.ckpt_format != "torch_dist":
            return _save_legacy(iter_dir, model_chunks, optim, groups, common, rng_state)
        staged = _save_sharded(iter_dir, model_chunks, optim, groups, common, rng_state, staging)
        if async_queue is None:
            staged.write()
            staged.finalize()
        return staged

    def publish() -> None:  # after every rank's files: the tracker names the new checkpoint
        _agreed_write(lambda: update_tracker(ckpt_config.save, iteration), ckpt_config.save)
        seconds = time.time() - started
        run_report.report(run_report.saved_line(iteration, ckpt_config.save, _position(groups), seconds))

    staged = _naming_failures(write, iter_dir, ckpt_config.save)
    if async_queue is None:
        dist.barrier()
        publish()
        return iter_dir
    blocked = time.time() - started
    run_report.report(run_report.save_scheduled_line(iteration, blocked))

    def write_in_background() -> None:  # no collective: a failure is agreed on by the finalization
        try:
            _write_common_and_rng(iter_dir, common, rng_state)
        except WRITE_FAILURES as e:
            raise CheckpointingError(describe_write_failure(e, iter_dir)) from e
        staged.write()

    finalize = [lambda: _naming_failures(staged.finalize, iter_dir, ckpt_config.save), publish]
    async_queue.schedule_async_request(AsyncRequest(write_in_background, finalize))
    return iter_dir


def _naming_failures(step: Callable[[], Any], iter_dir: str, root: str) -> Any:
    """``step()``; a failed write raises on every rank, naming its cause and the checkpoint the tracker keeps."""
    try:
        return step()
    except CheckpointingError as e:
        raise CheckpointingError(f"{e}; {_tracker_note(root)}") from e
    except WRITE_FAILURES as e:
        raise CheckpointingError(f"{_describe_everywhere(e, iter_dir)}; {_tracker_note(root)}") from e


def _position(groups: ProcessGroupCollection) -> Tuple[int, int, int, int]:
    """(tp rank, TP, pp rank, PP) of this rank, for the ``[ t x/TP, p y/PP ]`` of Megatron's checkpoint lines."""
    return groups.rank_in("tp"), groups.size_of("tp"), groups.rank_in("pp"), groups.size_of("pp")


def _agreed_write(write: Callable[[], None], directory: str, writer: Optional[bool] = None) -> None:
    """Run ``write`` on the writer ranks (default: rank 0); if it fails on any rank, all raise with the cause.

    Every local write of a save ends in one of these before the next collective, so a full
    disk on one rank stops all of them instead of leaving the others in a barrier.
    """
    error = None
    if (dist.get_rank() == 0) if writer is None else writer:
        try:
            write()
        except WRITE_FAILURES as e:
            error = describe_write_failure(e, directory)
    agree_on_error(error, None)


def _describe_everywhere(err: BaseException, directory: str) -> str:
    """DCP raises its write failure on every rank, but only the failing rank's errno, free space and
    file-size limit say why: every rank reports that rank's description."""
    mine = describe_write_failure(err, directory)
    if not isinstance(err, CheckpointException) or not err.failures or not dist.is_initialized():
        return mine
    first = min(err.failures)
    messages: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, mine)
    return f"{messages[first]} (rank {first})"


def _start_directory(iter_dir: str) -> None:
    os.makedirs(iter_dir, exist_ok=True)
    stale = os.path.join(iter_dir, dc.METADATA_FILE)
    if os.path.exists(stale):  # rewriting: the directory must not look complete meanwhile
        os.remove(stale)


def _tracker_note(root: str) -> str:
    """What a failed save left behind, for its error message."""
    try:
        found = read_tracker(root)
    except CheckpointingError as e:
        return str(e)
    tracker = os.path.join(root, TRACKER_FILE)
    if found is None:
        return f"no checkpoint was complete before ({tracker} does not exist)"
    return f"{tracker} still names {'release' if found[1] else found[0]}, the last complete checkpoint"


def _save_sharded(
    iter_dir: str,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    groups: ProcessGroupCollection,
    common: Dict[str, Any],
    rng_state: Optional[Dict[str, Any]],
    staging: Optional[Dict[Any, torch.Tensor]] = None,
) -> dc.StagedSave:
    """Planned (collective): ``write()`` then ``finalize()`` make the checkpoint complete.

    ``staging`` (an asynchronous save): the tensors are snapshotted into these reused host buffers, and
    ``common.json`` and the RNG files are left to the background writer.
    """
    sharded = dc.model_sharded_state_dict(model_chunks, pg_collection=groups)
    common["optimizer"] = None
    if optimizer is not None:
        pieces, scalars = _optimizer_pieces(model_chunks, optimizer, groups)
        sharded.update(pieces)
        common["optimizer"] = plain_data.encode(scalars, "optimizer")
    if staging is None:
        _agreed_write(lambda: _write_common_and_rng(iter_dir, common, rng_state), iter_dir, writer=True)
    staged = stage_save(sharded, iter_dir, snapshot=staging is not None, buffers=staging)
    drop_fp8_checkpoint_values(model_chunks)
    return staged


def _optimizer_pieces(
    model_chunks: Sequence[torch.nn.Module], optimizer: Any, groups: ProcessGroupCollection
) -> Tuple[dc.ShardedStateDict, Dict[str, Any]]:
    """The optimizer state as checkpoint pieces, and its scalars. The distributed optimizer's DP ranks each
    give their own slices (no gather: every rank writes 1/DP); the others give whole per-parameter tensors."""
    if hasattr(optimizer, "sharded_state_to_save"):
        return optimizer.sharded_state_to_save(
            model_chunks, dc.sharded_tensors_by_param_name(model_chunks, groups, dp_replicas=False)
        )
    specs = dc.sharded_tensors_by_param_name(model_chunks, groups)
    per_param, scalars = dc.split_optimizer_state(optimizer.state_dict_by_param_name(model_chunks), specs)
    return dc.optimizer_sharded_state_dict(per_param, specs), scalars


def _write_common_and_rng(iter_dir: str, common: Dict[str, Any], rng_state: Optional[Dict[str, Any]]) -> None:
    """Rank 0 writes ``common.json``; every rank its RNG file (unless ``--no-save-rng``)."""
    if dist.get_rank() == 0:
        write_json_atomic(os.path.join(iter_dir, COMMON_FILE), common)
    if rng_state is not None:
        os.makedirs(os.path.join(iter_dir, RNG_DIR), exist_ok=True)
        write_json_atomic(_rng_path(iter_dir, dist.get_rank()), rng_state)


def _rng_path(iter_dir: str, rank: int) -> str:
    return os.path.join(iter_dir, RNG_DIR, f"rank_{rank:05d}.json")


def legacy_file(iter_dir: str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """``mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt`` (the pp suffix only when PP > 1)."""
    folder = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")
    return os.path.join(iter_dir, folder, LEGACY_FILE)


def _save_legacy(
    iter_dir: str,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    groups: ProcessGroupCollection,
    common: Dict[str, Any],
    rng_state: Optional[Dict[str, Any]],
) -> None:
    _refuse_legacy_with_ep(groups)
    rng: List[Any] = [None] * groups.size_of("dp")
    if rng_state is not None:
        dist.all_gather_object(rng, rng_state, group=groups.dp)
    # On every rank: the distributed optimizer gathers its DP slices collectively.
    optim_state = optimizer.state_dict_by_param_name(model_chunks) if optimizer is not None else None
    writer = groups.rank_in("dp") == 0 and groups.rank_in("cp") == 0
    path = legacy_file(iter_dir, groups.rank_in("tp"), groups.rank_in("pp"), groups.size_of("pp"))
    state: Dict[str, Any] = {}
    if writer:
        state = dict(
            common,
            num_floating_point_operations_so_far=common["train_state"].get("num_floating_point_operations_so_far", 0),
        )
        if rng_state is not None:
            state["rng_state"] = rng
        for i, chunk in enumerate(model_chunks):
            state["model" if len(model_chunks) == 1 else f"model{i}"] = dc.model_state_to_save(unwrap_model(chunk))
        if optim_state is not None:
            state["optimizer"] = optim_state
    _agreed_write(lambda: _write_torch_file(path, state), iter_dir, writer=writer)
    drop_fp8_checkpoint_values(model_chunks)
    _record_legacy_checksums(iter_dir, path if writer else None)


def _record_legacy_checksums(iter_dir: str, written: Optional[str]) -> None:
    """Collective: each writer hashes its file (still in the page cache); rank 0 writes ``checksums.json``."""
    entry: Dict[str, Any] = {}

    def digest() -> None:
        entry[os.path.relpath(written, iter_dir).replace(os.sep, "/")] = {
            "bytes": os.path.getsize(written),
            checksums.ALGORITHM: checksums.file_digest(written),
        }

    _agreed_write(digest, iter_dir, writer=written is not None)
    entries: List[Optional[Dict[str, Any]]] = [None] * dist.get_world_size()
    dist.all_gather_object(entries, entry)
    files = {name: value for part in entries for name, value in part.items()}
    table = {"algorithm": checksums.ALGORITHM, "files": files}
    _agreed_write(lambda: write_json_atomic(os.path.join(iter_dir, LEGACY_CHECKSUMS), table), iter_dir)


def _verify_legacy_file(iter_dir: str, path: str) -> None:
    """This rank's legacy file against ``checksums.json`` (older checkpoints have none: a warning).

    A mismatch raises on the rank that reads the file; ``load_checkpoint`` makes every rank raise.
    """
    where = os.path.join(iter_dir, LEGACY_CHECKSUMS)
    if not os.path.isfile(where):
        logger.warning("%s not found (saved before checksums, or by Megatron-LM): %s is not verified", where, path)
        return
    files = checksums.check_table(read_json(where, "legacy checkpoint checksums"), where)
    name = os.path.relpath(path, iter_dir).replace(os.sep, "/")
    if name not in files:
        raise CheckpointingError(f"{where} does not list {path}: the file was added after the save")
    checksums.verify_files(iter_dir, files, [name], where)


def _write_torch_file(path: str, state: Dict[str, Any]) -> None:
    """``torch.save`` to a temporary file, then rename. Through a Python file object, so that a failed
    write keeps its ``OSError`` (errno) in the exception chain instead of only "unexpected pos"."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------- load
def _agreed_target(cfg: CheckpointConfig) -> Optional[Tuple[int, bool, str]]:
    """Global rank 0 reads the tracker and detects the format; every rank gets its answer.

    A rank that read the tracker itself could see another iteration (an older copy on a shared
    file system after a requeue), or none, and leave while the others wait in a collective.
    """
    if not dist.is_initialized():
        target, error = load_target(cfg)
    else:
        answer = [load_target(cfg) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(answer, src=0)
        target, error = answer[0]
    if error is not None:
        raise CheckpointingError(error)
    return target


def load_checkpoint(
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
    ckpt_config: CheckpointConfig,
    pg_collection: Optional[ProcessGroupCollection] = None,
    run_args: Optional[Dict[str, Any]] = None,
    rng_tracker: Optional[CudaRNGStatesTracker] = None,
) -> Tuple[int, Dict[str, Any]]:
    """Restore from ``ckpt_config.load``; returns (iteration, train_state).

    Model always; optimizer and scheduler unless ``no_load_optim``/``finetune``/release, when the
    optimizer's main weights are instead copied from the loaded model (``reload_model_params``);
    RNG unless ``no_load_rng``/``finetune``/release. With ``finetune`` or a release
    checkpoint the iteration is 0 and the train state empty. Without a checkpoint,
    returns (0, {}) (or raises with ``exit_on_missing_checkpoint``; a directory holding
    complete checkpoints but no tracker raises). ``run_args`` (this run's flags as plain
    data) must agree with the checkpoint's on every architecture flag, finetuning included.
    The saved model-parallel RNG streams go into ``rng_tracker`` (None: ``get_cuda_rng_tracker()``).
    """
    if ckpt_config.load is None:
        return 0, {}
    target = _agreed_target(ckpt_config)
    if target is None:
        if run_report.is_reporting_rank():  # every rank got rank 0's answer: said once
            logger.warning("%s; starting from random initialization", no_checkpoint_message(ckpt_config.load))
        return 0, {}
    iteration, release, fmt = target
    iter_dir = checkpoint_dir(ckpt_config.load, iteration, release)
    groups = dc.model_process_groups(unwrap_model(model_chunks[0]), pg_collection)
    fresh = ckpt_config.finetune or release
    load_optim = optimizer is not None and not ckpt_config.no_load_optim and not fresh
    load_rng = not ckpt_config.no_load_rng and not fresh
    started = time.time()
    run_report.report(run_report.loading_line(ckpt_config.load, iteration, fmt))
    args = (iter_dir, model_chunks, optimizer if load_optim else None, groups, load_rng, ckpt_config, run_args)
    if fmt == "torch_dist":
        common, rng = _load_sharded(*args)
    else:  # per-rank files and no collective inside: one rank's failure must stop every rank
        common, rng = _agreed_read(lambda: _load_legacy(*args))
    if optimizer is not None and not load_optim:  # main weights from the loaded model (Megatron does this too)
        optimizer.reload_model_params()
    if load_optim and opt_param_scheduler is not None and common.get("opt_param_scheduler") is not None:
        opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    if rng is not None:
        restore_rng_state(rng, rng_tracker or get_cuda_rng_tracker())
    what = "model" + (", optimizer and scheduler" if load_optim else "") + (", RNG states" if rng is not None else "")
    if fresh:
        what += "; starting at iteration 0 (" + ("--finetune" if ckpt_config.finetune else "release checkpoint") + ")"
    elapsed = time.time() - started
    run_report.report(run_report.loaded_line(ckpt_config.load, iteration, _position(groups), elapsed, what))
    if fresh:
        return 0, {}
    return int(common["iteration"]), dict(common.get("train_state") or {})


def load_args_from_checkpoint(args: Any) -> Optional[str]:
    """``--use-checkpoint-args``: the model flags of the checkpoint ``--load`` names replace the command line's.

    Runs before validation and before torch.distributed starts (each process reads the same
    plain files). Returns the checkpoint directory, or None when ``--load`` holds no checkpoint
    (a warning; the command line's flags stay, as in Megatron).
    """
    if not args.load:
        raise CheckpointingError("--use-checkpoint-args needs --load: the checkpoint to take the model flags from")
    found = iteration_to_load(config_from_args(CheckpointConfig, args))
    if found is None:
        return None
    iter_dir = checkpoint_dir(args.load, *found)
    saved = saved_args(iter_dir)
    if not isinstance(saved, dict):
        raise CheckpointingError(
            f"checkpoint {iter_dir} holds no arguments (args is {type(saved).__name__}): "
            "--use-checkpoint-args has nothing to take; give the model flags instead"
        )
    apply_checkpoint_args(args, saved, iter_dir)
    return iter_dir


def saved_args(iter_dir: str) -> Any:
    """The ``args`` a checkpoint was saved with: ``common.json``'s, or the first legacy file's."""
    if detect_format(iter_dir) == "torch_dist":
        return read_json(os.path.join(iter_dir, COMMON_FILE), "checkpoint common state").get("args")
    for folder in ("mp_rank_00", "mp_rank_00_000"):
        path = os.path.join(iter_dir, folder, LEGACY_FILE)
        if os.path.isfile(path):
            try:  # memory-mapped: the tensors are not read
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("args")
            except Exception as e:  # noqa: BLE001 - truncated, corrupt or holding non-plain objects
                raise CheckpointingError(f"cannot read legacy checkpoint {path}: {e}") from e
    raise CheckpointingError(
        f"{iter_dir}: neither mp_rank_00/{LEGACY_FILE} nor mp_rank_00_000/{LEGACY_FILE} "
        "holds the arguments --use-checkpoint-args needs"
    )


def _optimizer_template(
    model_chunks: Sequence[torch.nn.Module], optimizer: Any, groups: ProcessGroupCollection, metadata: Any
) -> Tuple[dc.ShardedStateDict, Dict[str, Dict[str, torch.Tensor]]]:
    """Empty per-parameter tensors for every optimizer state the checkpoint holds, and their sharding.

    The distributed optimizer reads only the slices its DP rank owns (``sharded_state_template``);
    the others read each parameter's whole (TP-local) state.
    """
    saved: Dict[str, Dict[str, torch.dtype]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(dc.OPTIMIZER_STATE_PREFIX):
            param_key, _, state_name = key[len(dc.OPTIMIZER_STATE_PREFIX) :].rpartition(".")
            saved.setdefault(param_key, {})[state_name] = md.properties.dtype
    specs = dc.sharded_tensors_by_param_name(model_chunks, groups)
    if hasattr(optimizer, "sharded_state_template"):
        return optimizer.sharded_state_template(model_chunks, specs, saved)
    params = dict(named_model_params(model_chunks))
    per_param = {
        name: {
            state: torch.empty(params[name].shape, dtype=dtype, device=params[name].device)
            for state, dtype in saved[spec.key].items()
        }
        for name, spec in specs.items()
        if spec.key in saved
    }  # no entry: no state saved yet
    return dc.optimizer_sharded_state_dict(per_param, specs), per_param


def _load_sharded(
    iter_dir: str,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    groups: ProcessGroupCollection,
    load_rng: bool,
    cfg: CheckpointConfig,
    run_args: Optional[Dict[str, Any]],
) -> Tuple[Dict[str, Any], Optional[Dict]]:
    if cfg.verify_checkpoint:
        dc.verify_checksums(iter_dir)  # collective: every rank raises on a mismatch
    # Each rank reads the files; whatever one of them finds wrong stops all before the collective load.
    common, metadata = _agreed_read(lambda: _sharded_header(iter_dir, optimizer is not None, run_args))
    per_param, template = None, {}
    if optimizer is not None:
        template, per_param = _optimizer_template(model_chunks, optimizer, groups, metadata)
    # Last: an FP8 weight's entry is the tensor its latest state_dict handed out, filled by the load.
    sharded = dc.model_sharded_state_dict(model_chunks, pg_collection=groups)
    sharded.update(template)
    # Optimizer state left unread on purpose (--no-load-optim, --finetune, release) is not a mismatch.
    sharded, _ = apply_strictness(
        sharded,
        metadata.state_dict_metadata,
        parse_strictness(cfg.dist_ckpt_strictness),
        iter_dir,
        () if optimizer is not None else (dc.OPTIMIZER_STATE_PREFIX,),
    )
    dc.load(sharded, iter_dir)
    # FP8 weights take the loaded high-precision values before anything calls state_dict() again
    # (its hook would put fresh copies of the current weights in their place).
    load_fp8_checkpoint_values(model_chunks)
    for chunk in model_chunks:  # parameters were read in place; extra states (TE's FP8 state) go back here
        dc.load_extra_states(chunk, sharded, groups)
    drop_fp8_checkpoint_values(model_chunks)  # the copies that loop's state_dict() made
    if optimizer is not None:
        state: Dict[str, Any] = dict(plain_data.decode(common.get("optimizer") or {}))
        state.update(per_param)
        optimizer.load_state_dict_by_param_name(model_chunks, state)
    rng = None
    if load_rng and _same_layout(common, groups, iter_dir):
        rng = _agreed_read(
            lambda: read_json(
                _rng_path(iter_dir, dist.get_rank()), "RNG state (saved with --no-save-rng? load with --no-load-rng)"
            )
        )
    return common, rng


def _sharded_header(
    iter_dir: str, with_optimizer: bool, run_args: Optional[Dict[str, Any]]
) -> Tuple[Dict[str, Any], Any]:
    """A torch_dist checkpoint's common state and metadata, checked against this run."""
    common = read_json(os.path.join(iter_dir, COMMON_FILE), "checkpoint common state")
    if run_args is not None:
        check_checkpoint_args(common.get("args"), run_args, iter_dir)
    if with_optimizer and common.get("optimizer") is None:
        raise CheckpointingError(
            f"checkpoint {iter_dir} has no optimizer state (saved with --no-save-optim?); "
            "load with --no-load-optim or --finetune"
        )
    return common, dc.read_metadata(iter_dir)


def _agreed_read(read: Callable[[], Any]) -> Any:
    """Run a per-rank read on every rank; if it fails on any rank, every rank raises with the cause."""
    error, result = None, None
    try:
        result = read()
    except CheckpointingError as e:
        error = str(e)
    agree_on_error(error, None)
    return result


def _same_layout(common: Dict[str, Any], groups: ProcessGroupCollection, where: str) -> bool:
    if common.get("layout") == _layout(groups):
        return True
    logger.warning(
        "%s was saved with layout %s, this run is %s: RNG states are not restored",
        where,
        common.get("layout"),
        _layout(groups),
    )
    return False


def _load_legacy(
    iter_dir: str,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    groups: ProcessGroupCollection,
    load_rng: bool,
    cfg: CheckpointConfig,
    run_args: Optional[Dict[str, Any]],
) -> Tuple[Dict[str, Any], Optional[Dict]]:
    """Every key of the file must fit the model (``load_state_dict(strict=True)``) whatever
    ``--dist-ckpt-strictness`` says: as in Megatron, that flag is for torch_dist checkpoints."""
    _refuse_legacy_with_ep(groups)
    path = legacy_file(iter_dir, groups.rank_in("tp"), groups.rank_in("pp"), groups.size_of("pp"))
    if not os.path.isfile(path):
        raise CheckpointingError(
            f"legacy checkpoint file not found: {path} (a torch-format checkpoint loads only "
            "under the TP/PP layout that saved it)"
        )
    if cfg.verify_checkpoint:
        _verify_legacy_file(iter_dir, path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - truncated, corrupt or holding non-plain objects
        raise CheckpointingError(f"cannot read legacy checkpoint {path}: {e}") from e
    if run_args is not None:
        check_checkpoint_args(state.get("args"), run_args, path)
    for i, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        try:
            unwrap_model(chunk).load_state_dict(state[key], strict=True)
        except (KeyError, RuntimeError) as e:
            raise CheckpointingError(f"{path}: model state does not fit: {e}") from e
    if optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointingError(
                f"{path} has no optimizer state (saved with --no-save-optim?); load with --no-load-optim or --finetune"
            )
        optimizer.load_state_dict_by_param_name(model_chunks, state["optimizer"])
    rng = None
    if load_rng:
        if "rng_state" not in state:
            raise CheckpointingError(f"{path} has no RNG state (saved with --no-save-rng?); load with --no-load-rng")
        if _same_layout(state, groups, path):
            rng = state["rng_state"][groups.rank_in("dp")]
    return state, rng
