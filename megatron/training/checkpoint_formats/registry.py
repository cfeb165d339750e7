"""The one registry of checkpoint formats, by ``--ckpt-format`` name: the built-ins, then any registered.

A new format is a module with a ``base.CheckpointFormat`` subclass, added here among the built-ins or
registered by its own module with ``register`` (``tests/unit_tests/dist_checkpointing/json_format.py``).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from megatron.training.checkpoint_formats.base import TORCH, TORCH_DIST, CheckpointFormat  # noqa: F401 - re-exported
from megatron.training.checkpoint_formats.torch_dist import TorchDistFormat
from megatron.training.checkpoint_formats.torch_legacy import TorchLegacyFormat

# Detection asks in this order: the built-ins first.
_FORMATS: Dict[str, CheckpointFormat] = {fmt.name: fmt for fmt in (TorchDistFormat(), TorchLegacyFormat())}
_BUILTIN = tuple(_FORMATS)


def register(fmt: CheckpointFormat) -> CheckpointFormat:
    """Add ``fmt`` under ``fmt.name`` (a name another format holds is refused); returns it."""
    if not isinstance(fmt, CheckpointFormat):
        raise TypeError(f"{fmt!r} is not a CheckpointFormat")
    known = _FORMATS.get(fmt.name)
    if known is not None and type(known) is not type(fmt):
        raise ValueError(f"checkpoint format {fmt.name!r} is already registered ({type(known).__name__})")
    _FORMATS[fmt.name] = fmt
    return fmt


def unregister(name: str) -> None:
    """Remove the format ``name`` (a test's own; the built-ins stay)."""
    if name in _BUILTIN:
        raise ValueError(f"checkpoint format {name!r} is built in")
    _FORMATS.pop(name, None)


def format_names() -> Tuple[str, ...]:
    """Every registered ``--ckpt-format`` value, the built-ins first."""
    return tuple(_FORMATS)


def get_format(name: str) -> CheckpointFormat:
    """The format registered as ``name``."""
    if name not in _FORMATS:
        raise ValueError(f"ckpt_format={name!r}: must be one of {format_names()}")
    return _FORMATS[name]


def detect(names: Sequence[str]) -> Optional[str]:
    """The first registered format whose ``detect`` accepts ``names`` (a directory's listing), or None."""
    for fmt in _FORMATS.values():
        if fmt.detect(names):
            return fmt.name
    return None


def markers() -> List[str]:
    """``marker (name)`` of every format, for the message naming a directory no format recognises."""
    return [f"{fmt.marker} ({fmt.name})" for fmt in _FORMATS.values()]
