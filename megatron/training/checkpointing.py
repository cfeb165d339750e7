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

The files of each format are written and read by its ``CheckpointFormat`` in ``checkpoint_formats/``
(``torch_dist.py``, ``torch_legacy.py``); this module does what every format shares and dispatches
through ``checkpoint_formats.registry``.
"""

from __future__ import annotations

import dataclasses
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
from megatron.core.dist_checkpointing import CheckpointingError
from megatron.core.dist_checkpointing.agreement import agree_on_error
from megatron.core.dist_checkpointing.async_save import AsyncCallsQueue, AsyncRequest
from megatron.core.dist_checkpointing.write_errors import WRITE_FAILURES, describe_write_failure
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker, get_cuda_rng_tracker
from megatron.core.utils import unwrap_model
from megatron.training import run_report
from megatron.training.checkpoint_args import apply_checkpoint_args, check_checkpoint_args
from megatron.training.checkpoint_config import GLOBAL, LOCAL, CheckpointConfig
from megatron.training.checkpoint_dirs import (  # noqa: F401
    TRACKER_FILE,
    Target,
    checkpoint_dir,
    complete_checkpoints,
    detect_format,
    iteration_to_load,
    load_target,
    missing_checkpoint,
    no_checkpoint_message,
    read_tracker,
    refuse_untracked,
    remove_other_checkpoints,
    save_dir_problem,
    update_tracker,
)
from megatron.training.checkpoint_formats.base import TORCH_DIST, LoadRequest, SaveRequest, StagedWrite  # noqa: F401
from megatron.training.checkpoint_formats.common import COMMON_FILE, agreed_write, layout  # noqa: F401 - COMMON_FILE
from megatron.training.checkpoint_formats.registry import get_format
from megatron.training.checkpoint_local import agreed_iteration, load_local, save_local
from megatron.training.flags.registry import config_from_args
from megatron.training.rng_state import collect_rng_state, restore_rng_state  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

CHECKPOINT_VERSION = 3.0


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
    non_persistent: bool = False,
) -> str:
    """Write ``SAVE/iter_{iteration:07d}`` on every rank, then point the tracker at it; returns the dir.

    Collective over the world. ``train_state`` (consumed samples, FLOPs so far, ...) and
    ``args_dict`` must be plain data (see ``args_to_plain_data``). ``rng_tracker`` is the run's
    model-parallel RNG tracker (the training loop passes its own; None: ``get_cuda_rng_tracker()``).
    With ``async_queue`` (``--async-save``) the format only stages the save (plan, host snapshot) and the
    queue's background writer writes it; ``metadata.json`` and the tracker follow when the queue
    finalizes it, after every rank's files are durable (``dist_checkpointing/async_save.py``).
    ``non_persistent``: a ``--non-persistent-ckpt-type`` checkpoint instead: global, this same save into
    ``non_persistent_global_dir(save)`` (its own tracker), whose other checkpoints go once it is published;
    local, each rank's own file (``checkpoint_local.py``), synchronously.
    """
    if ckpt_config.save is None:
        raise ValueError("save_checkpoint needs CheckpointConfig.save (--save)")
    published: Callable[[], None] = lambda: None  # noqa: E731
    if non_persistent and ckpt_config.non_persistent_ckpt_type == GLOBAL:
        root = ckpt_config.non_persistent_global_dir(ckpt_config.save)
        ckpt_config = dataclasses.replace(ckpt_config, save=root)
        published = lambda: agreed_write(lambda: remove_other_checkpoints(root, iteration), root)  # noqa: E731
    _require_plain("train_state", train_state)
    _require_plain("args_dict", args_dict)
    fmt = get_format(ckpt_config.ckpt_format)
    if async_queue is not None and not fmt.supports_async:
        raise CheckpointingError(f"an asynchronous save: --ckpt-format {fmt.name} saves only synchronously")
    if async_queue is not None and async_queue.get_num_unfinalized_calls():
        logger.warning("checkpoint %d: the previous save is still being written; waiting for it", iteration)
        async_queue.maybe_finalize_async_calls(blocking=True)  # its snapshot buffers are reused now
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
        "layout": layout(groups),
        "ckpt_format": ckpt_config.ckpt_format,
    }
    _require_plain("opt_param_scheduler.state_dict()", common["opt_param_scheduler"])
    save_optim = optimizer is not None and not ckpt_config.no_save_optim
    rng_state = None if ckpt_config.no_save_rng else collect_rng_state(rng_tracker or get_cuda_rng_tracker())
    started = time.time()
    if non_persistent and ckpt_config.non_persistent_ckpt_type == LOCAL:
        root = ckpt_config.non_persistent_local_ckpt_dir
        save_local(root, iteration, model_chunks, optimizer if save_optim else None, common, rng_state)
        seconds = time.time() - started
        run_report.report(run_report.saved_line(iteration, f"{root} (local)", _position(groups), seconds))
        return root
    request = SaveRequest(iter_dir, model_chunks, optimizer if save_optim else None, groups, common, rng_state)
    run_report.report(run_report.saving_line(iteration, ckpt_config.save, ckpt_config.ckpt_format))

    def write() -> Optional[StagedWrite]:
        fmt.validate(groups)
        agreed_write(lambda: _start_directory(iter_dir), iter_dir)
        if async_queue is not None:
            return fmt.stage(request, async_queue.staging_buffers)
        fmt.save(request)
        dist.barrier()
        return None

    def publish() -> None:  # after every rank's files: the tracker names the new checkpoint
        agreed_write(lambda: update_tracker(ckpt_config.save, iteration), ckpt_config.save)
        seconds = time.time() - started
        run_report.report(run_report.saved_line(iteration, ckpt_config.save, _position(groups), seconds))
        published()

    staged = _naming_failures(write, iter_dir, ckpt_config.save)
    if staged is None:
        publish()
        return iter_dir
    run_report.report(run_report.save_scheduled_line(iteration, time.time() - started))
    finalize = [lambda: _naming_failures(staged.finalize, iter_dir, ckpt_config.save), publish]
    async_queue.schedule_async_request(AsyncRequest(staged.write, finalize))
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


# ---------------------------------------------------------------- load
def _agreed_target(cfg: CheckpointConfig) -> Optional[Target]:
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

    ``pretrained_checkpoint``: while ``load`` has no checkpoint, that one is loaded with ``finetune``.
    Model always; optimizer and scheduler unless ``no_load_optim``/``finetune``/release, when the
    optimizer's main weights are instead copied from the loaded model (``reload_model_params``);
    RNG unless ``no_load_rng``/``finetune``/release. With ``finetune`` or a release
    checkpoint the iteration is 0 and the train state empty. Without a checkpoint,
    returns (0, {}) (or raises with ``exit_on_missing_checkpoint``; a directory holding
    complete checkpoints but no tracker raises). ``run_args`` (this run's flags as plain
    data) must agree with the checkpoint's on every architecture flag, finetuning included.
    The saved model-parallel RNG streams go into ``rng_tracker`` (None: ``get_cuda_rng_tracker()``).
    """
    pretrained = ckpt_config.pretrained_checkpoint
    if pretrained is not None and (ckpt_config.load is None or _agreed_target(ckpt_config) is None):
        from_pretrained = dataclasses.replace(ckpt_config, load=pretrained, finetune=True, pretrained_checkpoint=None)
        if _agreed_target(dataclasses.replace(from_pretrained, finetune=False)) is None:  # None: not there
            raise CheckpointingError(f"--pretrained-checkpoint {pretrained}: {no_checkpoint_message(pretrained)}")
        return load_checkpoint(
            model_chunks, optimizer, opt_param_scheduler, from_pretrained, pg_collection, run_args, rng_tracker
        )
    if ckpt_config.load is None:
        return 0, {}
    groups = dc.model_process_groups(unwrap_model(model_chunks[0]), pg_collection)
    target = _agreed_target(ckpt_config)
    local = _newer_local(ckpt_config, target, groups)
    if target is None and local is None:
        if run_report.is_reporting_rank():  # every rank got rank 0's answer: said once
            logger.warning("%s; starting from random initialization", no_checkpoint_message(ckpt_config.load))
        return 0, {}
    if local is not None:
        target = (local, False, LOCAL, ckpt_config.non_persistent_local_ckpt_dir)
    iteration, release, fmt, root = target
    _report_choice(ckpt_config, target)
    fresh = ckpt_config.finetune or release
    load_optim = optimizer is not None and not ckpt_config.no_load_optim and not fresh
    load_rng = not ckpt_config.no_load_rng and not fresh
    started = time.time()
    run_report.report(run_report.loading_line(root, iteration, fmt))
    check_args = None if run_args is None else lambda saved, where: check_checkpoint_args(saved, run_args, where)
    if fmt == LOCAL:
        optim, verify = optimizer if load_optim else None, ckpt_config.verify_checkpoint
        common, rng = load_local(root, iteration, model_chunks, optim, load_rng, verify, check_args)
    else:
        reader = get_format(fmt)
        reader.validate(groups)
        request = LoadRequest(
            checkpoint_dir(root, iteration, release),
            model_chunks,
            optimizer if load_optim else None,
            groups,
            load_rng,
            ckpt_config.verify_checkpoint,
            ckpt_config.dist_ckpt_strictness,
            check_args,
        )
        common, rng = reader.load(request)
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
    run_report.report(run_report.loaded_line(root, iteration, _position(groups), elapsed, what))
    if fresh:
        return 0, {}
    return int(common["iteration"]), dict(common.get("train_state") or {})


def _newer_local(
    cfg: CheckpointConfig, target: Optional[Tuple[int, bool, str, str]], groups: ProcessGroupCollection
) -> Optional[int]:
    """Collective with local non-persistent checkpoints: the newest iteration every rank holds complete, when it
    is newer than ``target`` (ties go to ``target``); None otherwise, and without local checkpoints."""
    if cfg.non_persistent_ckpt_type != LOCAL or cfg.ckpt_step is not None or cfg.finetune:
        return None
    found = agreed_iteration(cfg.non_persistent_local_ckpt_dir, layout(groups))
    if found is None or (target is not None and not target[1] and target[0] >= found):
        return None
    return found


def _report_choice(cfg: CheckpointConfig, target: Target) -> None:
    """Which checkpoint resume chose, when non-persistent ones were candidates."""
    if cfg.non_persistent_ckpt_type is None:
        return
    iteration, release, _, root = target
    kind = "persistent" if root == cfg.load else f"non-persistent ({cfg.non_persistent_ckpt_type})"
    at = "release" if release else f"iteration {iteration}"
    run_report.report(f" resuming from the newest complete checkpoint: {kind}, {at}, in {root}")


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
    """The ``args`` a checkpoint was saved with (its format's ``saved_args``)."""
    return get_format(detect_format(iter_dir)).saved_args(iter_dir)
