"""Checkpoint directories: ``iter_*`` paths, the tracker file, format detection, complete checkpoints.

Pure file-system logic with no collective; ``checkpointing.py`` decides which rank calls it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import List, Optional, Tuple

from megatron.core.dist_checkpointing import CheckpointingError
from megatron.training.checkpoint_config import GLOBAL, CheckpointConfig
from megatron.training.checkpoint_formats import registry

logger = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int, release: bool = False) -> str:
    """``root/iter_{iteration:07d}`` (or ``root/release``)."""
    return os.path.join(root, "release" if release else f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[Tuple[int, bool]]:
    """(iteration, release) from the tracker file, None if there is none."""
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointingError(
            f"corrupt tracker file {path}: {text[:40]!r} is neither an iteration nor 'release'"
        ) from None
    if iteration < 0:
        raise CheckpointingError(f"corrupt tracker file {path}: negative iteration {iteration}")
    return iteration, False


def update_tracker(root: str, iteration: int) -> None:
    """Point the tracker at ``iteration`` (temporary file + rename: never half-written)."""
    path = os.path.join(root, TRACKER_FILE)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def detect_format(iter_dir: str) -> str:
    """The registered format that recognises ``iter_dir`` (``torch_dist``: ``metadata.json``; ``torch``:
    ``mp_rank_*`` folders); raises when none does (an interrupted save, or not a checkpoint)."""
    if not os.path.isdir(iter_dir):
        raise CheckpointingError(f"checkpoint directory not found: {iter_dir}")
    found = registry.detect(os.listdir(iter_dir))
    if found is None:
        raise CheckpointingError(
            f"{iter_dir} holds neither {' nor '.join(registry.markers())}: "
            "the checkpoint is incomplete (interrupted save?) or not a checkpoint"
        )
    return found


_ITER_DIR = re.compile(r"iter_(\d{7,})")


def _is_complete(iter_dir: str) -> bool:
    try:
        detect_format(iter_dir)
    except CheckpointingError:
        return False
    return True


def complete_checkpoints(root: str) -> List[Tuple[int, str]]:
    """(iteration, directory) of every complete ``iter_*`` checkpoint under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = [
        (int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root) if (m := _ITER_DIR.fullmatch(name))
    ]
    return sorted((it, path) for it, path in found if _is_complete(path))


def remove_other_checkpoints(root: str, iteration: int) -> None:
    """Remove every ``iter_*`` directory under ``root`` but ``iteration``'s (the global non-persistent checkpoints,
    once a new one is published: only it is kept, older ones and stale ones an earlier job left alike).
    ``metadata.json`` goes first."""
    for name in os.listdir(root):
        m = _ITER_DIR.fullmatch(name)
        if m and int(m.group(1)) != iteration:
            path = os.path.join(root, name)
            marker = os.path.join(path, registry.get_format(registry.TORCH_DIST).marker)
            if os.path.exists(marker):  # never complete-looking while half removed
                os.remove(marker)
            shutil.rmtree(path)


def refuse_untracked(root: str) -> None:
    """No tracker but complete checkpoints: a fresh start would overwrite them, so stop and say how to resume."""
    saved = complete_checkpoints(root)
    release = checkpoint_dir(root, 0, release=True)
    if saved:
        iteration, newest = saved[-1]
        raise CheckpointingError(
            f"{root} has no {TRACKER_FILE} but holds {len(saved)} complete checkpoint(s), the newest {newest}: "
            f"starting from scratch would overwrite them. Resume with --ckpt-step {iteration}, or restore the "
            f"tracker: echo {iteration} > {os.path.join(root, TRACKER_FILE)}"
        )
    if _is_complete(release):
        raise CheckpointingError(
            f"{root} has no {TRACKER_FILE} but holds a complete {release}: restore the "
            f"tracker to load it: echo release > {os.path.join(root, TRACKER_FILE)}"
        )


def no_checkpoint_message(load: str) -> str:
    """What a ``--load`` without a tracker lacks, for errors and the fresh-start warning."""
    return f"no checkpoint to load: {os.path.join(load, TRACKER_FILE)} not found" + (
        "" if os.path.isdir(load) else f" (directory {load} does not exist)"
    )


def checkpoint_required(exit_on_missing_checkpoint: bool, finetune: bool, skip_train: bool = False) -> Optional[str]:
    """Why this run cannot start from random weights, or None (the one list of reasons: the load path and
    the start-up preflight both ask here)."""
    if exit_on_missing_checkpoint:
        return "--exit-on-missing-checkpoint is set"
    if skip_train:
        return "nothing is trained (--skip-train: evaluating or serving)"
    return "--finetune starts from its weights" if finetune else None


def iteration_to_load(cfg: CheckpointConfig) -> Optional[Tuple[int, bool]]:
    """(iteration, release) to load, or None when there is no checkpoint (fresh start: the caller warns)."""
    if cfg.ckpt_step is not None:
        return cfg.ckpt_step, False
    found = read_tracker(cfg.load) if os.path.isdir(cfg.load) else None
    if found is None:
        refuse_untracked(cfg.load)
        why = checkpoint_required(cfg.exit_on_missing_checkpoint, cfg.finetune)
        if why:
            raise CheckpointingError(f"{no_checkpoint_message(cfg.load)}, and {why}")
    return found


Target = Tuple[int, bool, str, str]  # (iteration, release, format, root directory)


def load_target(cfg: CheckpointConfig) -> Tuple[Optional[Target], Optional[str]]:
    """(iteration, release, format, root) to load or None, and the error that stops the load, as this rank sees
    them (``checkpointing.load_checkpoint`` asks rank 0 alone and hands its answer to every rank).

    With ``non_persistent_ckpt_type`` global (and no ``ckpt_step``) the newest of the persistent tracker's
    checkpoint and the non-persistent directory's (its own tracker) wins; a tie goes to the persistent one.
    """
    try:
        newer = _newer_global_non_persistent(cfg)
        if newer is not None:
            iteration, root = newer
            return (iteration, False, detect_format(checkpoint_dir(root, iteration)), root), None
        found = iteration_to_load(cfg)
        return (None if found is None else (*found, detect_format(checkpoint_dir(cfg.load, *found)), cfg.load)), None
    except CheckpointingError as e:
        return None, str(e)


def _newer_global_non_persistent(cfg: CheckpointConfig) -> Optional[Tuple[int, str]]:
    """(iteration, root) of the global non-persistent checkpoint when it is newer than the persistent one."""
    if cfg.non_persistent_ckpt_type != GLOBAL or cfg.ckpt_step is not None:
        return None
    root = cfg.non_persistent_global_dir(cfg.load)
    found = read_tracker(root) if os.path.isdir(root) else None
    persistent = read_tracker(cfg.load) if os.path.isdir(cfg.load) else None
    if found is None or (persistent is not None and not persistent[1] and persistent[0] >= found[0]):
        return None
    return found[0], root


def writable_dir_problem(flag: str, path: Optional[str], what: str = "the directory") -> Optional[str]:
    """``path`` can be created and written (a probe file), else the flag, the path and why."""
    if not path:
        return None
    probe = os.path.join(path, f".write_probe.{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as e:
        return f"{flag} {path}: {what} cannot be created or written: {e}"
    return None


def save_dir_problem(cfg: CheckpointConfig) -> Optional[str]:
    """Why ``--save`` cannot be used (not writable, or its checkpoints would be overwritten); None if it can."""
    if cfg.save is None:
        return None
    unwritable = writable_dir_problem("--save", cfg.save, "the checkpoint directory")
    if unwritable:
        return unwritable
    same = cfg.load is not None and os.path.realpath(cfg.load) == os.path.realpath(cfg.save)
    saved = complete_checkpoints(cfg.save)
    if cfg.non_persistent_ckpt_type == GLOBAL:  # a stale one there would win a later resume
        saved = sorted(saved + complete_checkpoints(cfg.non_persistent_global_dir(cfg.save)))
    if not saved or (same and not cfg.finetune):
        return None
    why = (
        "--finetune restarts at iteration 0"
        if same
        else f"this run does not resume from it (--load {cfg.load})"
        if cfg.load
        else "this run starts from scratch"
    )
    return (
        f"--save {cfg.save} already holds {len(saved)} complete checkpoint(s), the newest {saved[-1][1]}, and "
        f"{why}: its saves would overwrite them. Resume with --load {cfg.save}, or save to another directory"
    )


def missing_checkpoint(load: str, ckpt_step: Optional[int], why: Optional[str]) -> Optional[str]:
    """Why ``--load`` cannot start this run, or None: no checkpoint although the run needs one (``why``),
    or complete checkpoints without a tracker (a fresh start would overwrite them).

    A load without a checkpoint starts from random weights only when nothing needs the weights:
    with ``--exit-on-missing-checkpoint``, ``--finetune``, ``--skip-train`` or a server it is an error.
    """
    if ckpt_step is not None:
        return None
    try:
        if os.path.isdir(load) and read_tracker(load) is not None:
            return None
        refuse_untracked(load)
    except CheckpointingError as e:
        return f"--load {load}: {e}"
    return f"--load {load}: {no_checkpoint_message(load)}, and {why}: check the path" if why else None
