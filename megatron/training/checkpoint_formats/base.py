"""The ``CheckpointFormat`` interface: what one ``--ckpt-format`` does, and the requests it is handed.

Imports nothing of the training application (and torch only for type hints), so that flag records
and configs may name the formats; ``registry.py`` holds the formats by name.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence, Tuple

if TYPE_CHECKING:
    import torch

    from megatron.core.parallel_state import ProcessGroupCollection

TORCH_DIST = "torch_dist"  # sharded torch.distributed.checkpoint files; loads under any layout (the default)
TORCH = "torch"  # Megatron's legacy per-rank model_optim_rng.pt files

# (common state as saved, this rank's RNG state or None)
Loaded = Tuple[Dict[str, Any], Optional[Dict[str, Any]]]


@dataclass
class SaveRequest:
    """One rank's part of a save: what to write where."""

    iter_dir: str  # exists; the format writes its files inside
    model_chunks: Sequence[torch.nn.Module]
    optimizer: Any  # None: model only (--no-save-optim)
    groups: ProcessGroupCollection
    common: Dict[str, Any]  # plain data: iteration, train state, scheduler, args, layout, format
    rng_state: Optional[Dict[str, Any]]  # this rank's; None: --no-save-rng


@dataclass
class LoadRequest:
    """One rank's part of a load: what to read, into what, and how strictly."""

    iter_dir: str
    model_chunks: Sequence[torch.nn.Module]
    optimizer: Any  # None: leave the optimizer alone
    groups: ProcessGroupCollection
    load_rng: bool
    verify_checkpoint: bool  # check the files against their recorded checksums first
    strictness: str  # --dist-ckpt-strictness (formats that can load a subset of the keys)
    check_args: Optional[Callable[[Any, str], None]]  # (saved args, where): raises if they do not fit this run


@dataclass
class StagedWrite:
    """An asynchronous save that ``CheckpointFormat.stage`` prepared: ``write`` runs on the background writer
    (local: no collective; a failure is raised on every rank by the finalization), ``finalize`` on the
    training thread once every rank's ``write`` has finished (collective: makes the directory complete)."""

    write: Callable[[], None]
    finalize: Callable[[], None]


class CheckpointFormat(abc.ABC):
    """How one ``--ckpt-format`` writes, finds and reads an ``iter_*`` directory.

    ``checkpointing.save_checkpoint`` / ``load_checkpoint`` do what every format shares (the
    directory, the tracker, the scheduler, RNG restore, the report lines); a format does the files.
    Every method is called on every rank; ``save`` and ``load`` are collective over the world and
    must make every rank raise when one rank fails (``checkpoint_formats.common``'s agreements).
    ``registry.py`` holds one instance of each under its ``name``.
    """

    name: str  # the --ckpt-format value, also written in the checkpoint's common state
    marker: str  # what ``detect`` looks for, for the message naming an incomplete directory
    supports_async = False  # whether ``stage`` prepares a background save (--async-save)

    @abc.abstractmethod
    def detect(self, names: Sequence[str]) -> bool:
        """Whether a directory holding the files/folders ``names`` is a complete checkpoint of this format."""

    def validate(self, groups: ProcessGroupCollection) -> None:  # noqa: B027 - optional: most formats hold any layout
        """Raise ``CheckpointingError`` if this format cannot hold the layout of ``groups`` (default: any can)."""

    @abc.abstractmethod
    def save(self, request: SaveRequest) -> None:
        """Write the model (and the optimizer's state unless None), the common state and this rank's RNG
        state (None: not saved) into the existing ``request.iter_dir``; complete when it returns."""

    def stage(self, request: SaveRequest, staging: Dict[Any, Any]) -> StagedWrite:
        """Collective: what an asynchronous save must do on the training thread (plan, a host snapshot of the
        tensors, reusing ``staging``'s buffers); the returned ``write`` and ``finalize`` do the rest. Only
        formats with ``supports_async``; the bytes written are those ``save`` writes."""
        raise NotImplementedError(f"--ckpt-format {self.name} saves only synchronously")

    @abc.abstractmethod
    def load(self, request: LoadRequest) -> Loaded:
        """Read the model (and the optimizer's state unless None) in place after ``check_args`` accepted the
        saved args; return the common state and this rank's RNG state (None: not restored)."""

    @abc.abstractmethod
    def saved_args(self, iter_dir: str) -> Any:
        """The ``args`` the checkpoint was saved with, read without torch.distributed (``--use-checkpoint-args``)."""
