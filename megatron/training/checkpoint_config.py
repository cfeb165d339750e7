"""``CheckpointConfig``: what the training application saves and loads, and how strictly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.core.dist_checkpointing.validation import parse_strictness
from megatron.training.checkpoint_formats.base import TORCH_DIST
from megatron.training.checkpoint_formats.registry import format_names, get_format

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
        for name, lowest in (("save_interval", 1), ("ckpt_step", 0)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < lowest):
                raise ValueError(f"{name}={value!r}: must be an integer >= {lowest} or None")
