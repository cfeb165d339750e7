"""The shape of a flag's record: what this project knows about one Megatron flag.

Megatron's own facts about a flag (option strings, destination, default, choices,
nargs, action) stay in ``megatron_flags.tsv``. A :class:`Flag` adds ours, keyed by
the destination: the value type where the table's default does not tell, the help
text, the status, the config fields the flag fills, and whether it changes only speed
or memory (``speed_only``, proven by the speed-flag invariance suite). The parser, ``--help``, the
refusal of unsupported values and the flag -> config mapping are generated from
these records (``registry.py``).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Tuple, Union

Derive = Callable[[argparse.Namespace], Any]
SavedArgs = Mapping[str, Any]  # a checkpoint's flags as plain data (``common.json``'s ``args``)


@dataclass(frozen=True)
class Implemented:
    """The flag does what Megatron's does (read by the code named in its record's fills or use)."""


@dataclass(frozen=True)
class NoOp:
    """Accepted and without effect here; ``reason`` says why the result is the same (shown in ``--help``)."""

    reason: str


@dataclass(frozen=True)
class NotSupportedYet:
    """Only the ``harmless`` values are accepted (the default, or the choices we implement); others stop the run."""

    harmless: Tuple[Any, ...]

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` is one of the harmless values."""
        return value in self.harmless


Status = Union[Implemented, NoOp, NotSupportedYet]
IMPLEMENTED = Implemented()


def no_op(reason: str) -> NoOp:
    """Status of a flag that is accepted and changes nothing here, for ``reason``."""
    return NoOp(reason)


def not_yet(*harmless: Any) -> NotSupportedYet:
    """Status of a flag refused unless its value is one of ``harmless``."""
    return NotSupportedYet(harmless)


@dataclass(frozen=True)
class Fill:
    """One config field a flag fills: same-named (``field`` None) or renamed, copied or ``derive``d from the args."""

    target: type
    field: Optional[str] = None
    derive: Optional[Derive] = None

    def field_for(self, dest: str) -> str:
        """The filled field's name for a flag with destination ``dest``."""
        return self.field or dest

    def value(self, dest: str, args: argparse.Namespace) -> Any:
        """The field's value from validated ``args``."""
        return self.derive(args) if self.derive is not None else getattr(args, dest)


def same(*targets: type) -> Tuple[Fill, ...]:
    """Fills of the same-named field in each of ``targets``."""
    return tuple(Fill(t) for t in targets)


def to(target: type, field: str, derive: Optional[Derive] = None) -> Fill:
    """Fill ``target.field`` from the flag's value, or from ``derive(args)``."""
    return Fill(target, field, derive)


def validated(name: str) -> Derive:
    """A derive that reads ``args.<name>``, a value ``validate_args`` computes from this flag (and others)."""

    def read(args: argparse.Namespace) -> Any:
        return getattr(args, name)

    read.__name__ = f"validated_{name}"
    return read


BITWISE = "bitwise"  # the same arithmetic in the same order: losses and grad norms bit for bit
RTOL = "rtol"  # the same math summed in another order: equal within the invariance suite's relative tolerance


@dataclass(frozen=True)
class SpeedOnly:
    """The flag changes only speed or memory: runs with and without it train the same model.

    ``tolerance`` (``BITWISE`` or ``RTOL``) is how equal ``tests/unit_tests/training/test_speed_flag_invariance.py``
    requires their losses and grad norms to be.
    """

    tolerance: str = BITWISE

    def __post_init__(self) -> None:
        if self.tolerance not in (BITWISE, RTOL):
            raise ValueError(f"SpeedOnly(tolerance={self.tolerance!r}): must be {BITWISE!r} or {RTOL!r}")


SPEED_BITWISE = SpeedOnly(BITWISE)
SPEED_RTOL = SpeedOnly(RTOL)


@dataclass(frozen=True)
class Bounds:
    """The values a numeric flag accepts: ``low`` and ``high`` (None: unbounded), each inclusive
    unless ``low_open``/``high_open``; float values must also be finite. ``validation.check_bounds``
    checks every bounded flag before anything uses its value."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False

    def rule(self, value: Optional[float] = None) -> str:
        """The rule in words: ``must be > 0``, ``must be in [0, 1)``, ... (``must be finite and ...`` for nan, inf)."""
        if isinstance(value, float) and not math.isfinite(value):
            return "must be finite and " + self.rule().removeprefix("must be ")
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"must be in {left}{self.low:g}, {self.high:g}{right}"
        if self.low is not None:
            return f"must be {'>' if self.low_open else '>='} {self.low:g}"
        return f"must be {'<' if self.high_open else '<='} {self.high:g}"

    def accepts(self, value: float) -> bool:
        """Whether ``value`` is within the bounds (and finite)."""
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)


def positive() -> Bounds:
    """Bounds of a flag that must be > 0."""
    return Bounds(low=0, low_open=True)


def at_least(low: float) -> Bounds:
    """Bounds of a flag that must be >= ``low``."""
    return Bounds(low=low)


def between(low: float, high: float, high_open: bool = False) -> Bounds:
    """Bounds of a flag that must be in ``[low, high]`` (``[low, high)`` with ``high_open``)."""
    return Bounds(low=low, high=high, high_open=high_open)


# When an architecture flag's saved value must equal the run's, judged from the checkpoint's own flags.
def always(saved: SavedArgs) -> bool:
    """The flag shapes the weights of every model."""
    return True


def with_rope(saved: SavedArgs) -> bool:
    """The flag matters for a model with rotary position embeddings only."""
    return saved.get("position_embedding_type") == "rope"


def with_learned_positions(saved: SavedArgs) -> bool:
    """The flag matters for a model with a learned position table only."""
    return saved.get("position_embedding_type") == "learned_absolute"


def with_mamba_layers(saved: SavedArgs) -> bool:
    """The flag matters for a hybrid Mamba model or one with Gated DeltaNet layers: their fused input
    projection and convolution are stored per tensor-parallel rank (``[z, x, B, C, dt]`` / ``[q, k, v, z, beta,
    alpha]`` of each rank's heads), so they reshard only at the same TP size."""
    return bool(saved.get("is_hybrid_model")) or saved.get("experimental_attention_variant") == "gated_delta_net"


def with_moe(saved: SavedArgs) -> bool:
    """The flag matters for a mixture-of-experts model only."""
    return saved.get("num_experts") is not None


def tuple_from_plain(value: Any) -> Any:
    """A tuple flag's value read back from JSON, where it was saved as a list (None stays None)."""
    return None if value is None else tuple(value)


# What --use-checkpoint-args does with a flag's saved value.
TAKEN = "taken"  # replaces the command line's (every architecture flag unless it says otherwise)
FILLED = "filled"  # fills the flag only when the command line leaves it unset
CHECKED = "checked"  # compared (an architecture flag) but recomputed, never taken


@dataclass(frozen=True)
class Flag:
    """One flag's record, keyed by its destination; see the module docstring."""

    dest: str
    status: Status
    help: str = ""
    type: Optional[Callable[[str], Any]] = None
    fills: Tuple[Fill, ...] = ()
    project: Optional[ProjectFlag] = None  # set for this project's own flags only
    bounds: Optional[Bounds] = None  # the values a numeric flag accepts (checked by validation.check_bounds)
    speed_only: Optional[SpeedOnly] = None  # set when the flag changes only speed or memory
    # Changes what the weights mean (``checkpoint_args.check_checkpoint_args``): when, from the saved flags.
    architecture: Optional[Callable[[SavedArgs], bool]] = None
    from_checkpoint: Optional[str] = None  # TAKEN / FILLED / CHECKED; None: TAKEN for architecture flags
    from_plain: Optional[Callable[[Any], Any]] = None  # the saved JSON value back to the parsed type
    label: Optional[str] = None  # how messages name a value computed from other flags
    required: bool = False  # the run cannot start without it (validation.check_required)
    replaced_by: Optional[str] = None  # a flag Megatron removed: what to give instead
    stands_for: Optional[str] = None  # another name of the flag with this destination; give one of the two
    one_value: bool = False  # Megatron takes a list; one value is supported here
    data_prefixes: bool = False  # a --data-path style list whose prefixes' .bin/.idx must exist
    # This project's choices where it accepts more than the table lists (a superset of the table's; the
    # extras are its own extensions, named in the help); None: the table's.
    choices: Optional[Tuple[str, ...]] = None

    def checkpoint_use(self) -> Optional[str]:
        """What ``--use-checkpoint-args`` does with this flag (TAKEN, FILLED, CHECKED or None: nothing)."""
        if self.from_checkpoint is not None:
            return self.from_checkpoint
        return TAKEN if self.architecture is not None else None


@dataclass(frozen=True)
class ProjectFlag:
    """The table facts of a flag of this project that Megatron-LM lacks (its record then is complete)."""

    group: str
    option_strings: Tuple[str, ...]
    default: Any
    action: str  # store | storetrue | storefalse
    nargs: Optional[str] = None  # argparse's nargs ("*", "+") where the flag takes several values
