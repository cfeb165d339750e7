"""``CheckpointConfig``: what the training application saves and loads, and how strictly."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megatron.core import compatibility
from megatron.core.dist_checkpointing.validation import parse_strictness
from megatron.training.checkpoint_formats.base import TORCH_DIST
from megatron.training.checkpoint_formats.registry import format_names, get_format

GLOBAL, LOCAL, IN_MEMORY = "global", "local", "in_memory"  # --non-persistent-ckpt-type
NON_PERSISTENT_SUBDIR = "non_persistent"  # the global non-persistent checkpoints' default home under --save/--load
_LOCAL_ALGOS = ("fully_parallel", "atomic")
_MEGATRON_ONLY_FORMATS = ("torch_dcp", "fsdp_dtensor")
_FLAGS = (
    "no_save_optim",
    "no_save_rng",
    "no_load_optim",
    "no_load_rng",
    "finetune",
    "exit_on_missing_checkpoint",
    "async_save",
    "use_persistent_ckpt_worker",
)


@dataclass
class CheckpointConfig:
    """Where and what to save and load (Megatron's checkpointing flags).

    Attributes:
        save: directory to save to (``--save``); None disables saving.
        load: directory to resume from (``--load``); None starts from scratch.
        save_interval: iterations between saves (``--save-interval``).
        no_save_optim / no_save_rng: leave optimizer / RNG state out of saves.
        no_load_optim / no_load_rng: ignore optimizer (and scheduler) / RNG state on load.
        finetune: load the model only and start at iteration 0 with a fresh train state.
        pretrained_checkpoint: while ``load`` holds no checkpoint (or is None), load this one as ``finetune``
            does (``--pretrained-checkpoint``); once ``load`` holds one, the run resumes from it.
        ckpt_format: a registered ``checkpoint_formats`` name: ``torch_dist`` (sharded, any layout) or
            ``torch`` (legacy, per TP/PP rank).
        exit_on_missing_checkpoint: a ``load`` without a checkpoint is an error, not a fresh start.
        ckpt_step: load this iteration instead of the tracker's (``--ckpt-step``).
        dist_ckpt_strictness: what a torch_dist load does with keys the model and the checkpoint do
            not share (``--dist-ckpt-strictness``; see ``dist_checkpointing/validation.py``).
        verify_checkpoint: check every file against the checksums in ``metadata.json`` on load
            (``--no-verify-checkpoint`` turns it off).
        async_save: the training thread only snapshots the tensors; a background writer writes them
            and the tracker follows once every rank's files are durable (``--async-save``).
        use_persistent_ckpt_worker: one writer thread for the whole run instead of one per save.
        non_persistent_save_interval: iterations between non-persistent checkpoints, saved besides the
            ``save_interval`` ones (an iteration with a persistent save takes no non-persistent one).
        non_persistent_ckpt_type: ``global`` (the ``ckpt_format`` files under ``non_persistent_global_ckpt_dir``,
            only the newest kept) or ``local`` (each rank's own state in one file under
            ``non_persistent_local_ckpt_dir``, node-local storage); ``in_memory`` is refused.
        non_persistent_global_ckpt_dir: None: ``<save>/non_persistent`` (``<load>/non_persistent`` on load).
        non_persistent_local_ckpt_dir: where each rank writes (and finds) its local checkpoints.
        non_persistent_local_ckpt_algo: ``fully_parallel`` or ``atomic``: both name the one local writer here
            (each rank writes its own file, then its completion marker).
    """

    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_save_optim: bool = False
    no_save_rng: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    pretrained_checkpoint: Optional[str] = None
    ckpt_format: str = TORCH_DIST
    exit_on_missing_checkpoint: bool = False
    ckpt_step: Optional[int] = None
    dist_ckpt_strictness: str = "assume_ok_unexpected"
    verify_checkpoint: bool = True
    async_save: bool = False
    use_persistent_ckpt_worker: bool = False
    non_persistent_save_interval: Optional[int] = None
    non_persistent_ckpt_type: Optional[str] = None
    non_persistent_global_ckpt_dir: Optional[str] = None
    non_persistent_local_ckpt_dir: Optional[str] = None
    non_persistent_local_ckpt_algo: str = "fully_parallel"

    def __post_init__(self) -> None:
        parse_strictness(self.dist_ckpt_strictness)
        if not isinstance(self.verify_checkpoint, bool):
            raise ValueError(f"verify_checkpoint={self.verify_checkpoint!r}: must be True or False")
        for name in _FLAGS:
            value = getattr(self, name)
            if value is None:  # Megatron's store_true flags default to None
                setattr(self, name, False)
            elif not isinstance(value, bool):
                raise ValueError(f"{name}={value!r}: must be True or False")
        if self.ckpt_format in _MEGATRON_ONLY_FORMATS:
            raise ValueError(
                f"ckpt_format={self.ckpt_format!r}: not supported yet: --ckpt-format "
                f"{self.ckpt_format} (use one of {format_names()})"
            )
        if self.ckpt_format not in format_names():
            raise ValueError(f"ckpt_format={self.ckpt_format!r}: must be one of {format_names()}")
        if self.async_save and not get_format(self.ckpt_format).supports_async:
            raise ValueError(
                f"async_save=True with ckpt_format={self.ckpt_format!r}: --async-save needs a format that saves "
                f"in the background ({', '.join(n for n in format_names() if get_format(n).supports_async)})"
            )
        self._check_non_persistent()
        compatibility.check(self)
        for name, lowest in (("save_interval", 1), ("ckpt_step", 0), ("non_persistent_save_interval", 1)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < lowest):
                raise ValueError(f"{name}={value!r}: must be an integer >= {lowest} or None")

    def _check_non_persistent(self) -> None:
        kind = self.non_persistent_ckpt_type
        if kind == IN_MEMORY:
            raise ValueError(
                "non_persistent_ckpt_type='in_memory' (--non-persistent-ckpt-type in_memory): not supported: Megatron "
                "keeps it in the host memory of the running processes for its in-process restart, and this project's "
                "in-job restart starts new processes, which would find nothing; use global or local"
            )
        if kind not in (None, GLOBAL, LOCAL):
            raise ValueError(f"non_persistent_ckpt_type={kind!r}: must be None, {GLOBAL!r} or {LOCAL!r}")
        if self.non_persistent_local_ckpt_algo not in _LOCAL_ALGOS:
            raise ValueError(
                f"non_persistent_local_ckpt_algo={self.non_persistent_local_ckpt_algo!r}: must be one of {_LOCAL_ALGOS}"
            )
        if kind == LOCAL and not self.non_persistent_local_ckpt_dir:
            raise ValueError(
                "non_persistent_ckpt_type='local' needs non_persistent_local_ckpt_dir "
                "(--non-persistent-local-ckpt-dir): the node-local directory each rank writes its checkpoint to"
            )
        if self.non_persistent_save_interval is not None and (kind is None or self.save is None):
            needs = "save (--save)" if kind else "non_persistent_ckpt_type (--non-persistent-ckpt-type global|local)"
            raise ValueError(f"non_persistent_save_interval={self.non_persistent_save_interval!r} needs {needs}")

    def non_persistent_global_dir(self, root: str) -> str:
        """Where the global non-persistent checkpoints of ``root`` (``save`` or ``load``) live."""
        return self.non_persistent_global_ckpt_dir or os.path.join(root, NON_PERSISTENT_SUBDIR)
