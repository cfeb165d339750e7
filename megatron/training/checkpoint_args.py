"""Which saved flags describe the model, how a run must agree with them, and taking them over.

A checkpoint's ``common.json`` (or legacy ``.pt``) holds the run's flags as plain data
(``args_to_plain_data``). ``check_checkpoint_args`` compares every architecture flag the
checkpoint holds with this run's: a checkpoint of another architecture whose tensors
happen to have the same shapes (other head count, RMSNorm for LayerNorm, post-LN
residuals, RoPE over a learned-position model) would otherwise load and train silently.
Which flags are compared and taken is said by their records (``Flag.architecture``, ``Flag.from_checkpoint``).
``apply_checkpoint_args`` is ``--use-checkpoint-args``: the checkpoint's model flags replace
the command line's before validation, as Megatron's ``load_args_from_checkpoint`` does.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from megatron.core.dist_checkpointing import CheckpointingError
from megatron.training.flags import registry
from megatron.training.flags.record import FILLED, TAKEN
from megatron.training.flags_table import megatron_flag_specs as flag_specs

logger = logging.getLogger(__name__)

PlainArgs = Mapping[str, Any]


def architecture_args() -> Dict[str, Callable[[PlainArgs], bool]]:
    """Flag destination -> when it matters, judged from the checkpoint's own flags: every flag whose record says
    it changes what the weights mean (``Flag.architecture``). Dropout, precision, fusion, recomputation and the
    parallel layout do not and may change on resume."""
    return registry.architecture_flags()


def taken_from_checkpoint() -> Tuple[str, ...]:
    """What ``--use-checkpoint-args`` replaces: the records' ``TAKEN`` flags (architecture ones by default)."""
    return tuple(registry.checkpoint_uses(TAKEN))


def filled_from_checkpoint() -> Tuple[str, ...]:
    """Taken only when the command line leaves them unset (Megatron's rule for these): the ``FILLED`` records."""
    return tuple(registry.checkpoint_uses(FILLED))


def flag_label(dest: str) -> str:
    """How a user writes the flag of ``dest`` (``--disable-bias-linear (add_bias_linear)`` for negated ones)."""
    label = registry.RECORDS[dest].label if dest in registry.RECORDS else None
    if label is not None:
        return label
    for spec in flag_specs():
        if spec.dest == dest:
            return spec.name if spec.name[2:].replace("-", "_") == dest else f"{spec.name} ({dest})"
    return dest


def _table_default(dest: str) -> Any:
    return next((spec.default for spec in flag_specs() if spec.dest == dest), None)


def architecture_mismatches(saved: PlainArgs, run: PlainArgs) -> List[Tuple[str, Any, Any]]:
    """(dest, checkpoint value, run value) for every architecture flag both hold and disagree on."""
    out = []
    for dest, matters in architecture_args().items():
        if dest in saved and dest in run and matters(saved) and saved[dest] != run[dest]:
            out.append((dest, saved[dest], run[dest]))
    return out


def check_checkpoint_args(saved: Optional[PlainArgs], run: PlainArgs, where: str) -> None:
    """Raise CheckpointingError naming every architecture flag on which ``run`` and ``saved`` differ.

    ``saved`` is the checkpoint's ``args`` (None or missing flags: nothing to compare, as for
    converted checkpoints that store the model flags only); both are plain data.
    """
    if saved is None:
        logger.warning("checkpoint %s holds no arguments: its architecture cannot be checked", where)
        return
    if not isinstance(saved, Mapping):
        raise CheckpointingError(f"checkpoint {where}: 'args' is a {type(saved).__name__}, expected a JSON object")
    found = architecture_mismatches(saved, run)
    if not found:
        return
    lines = [f"  {flag_label(d)}: checkpoint {s!r}, this run {r!r}" for d, s, r in found]
    hint = (
        "--use-checkpoint-args is set: the rest comes from the tokenizer or the parallel layout"
        if run.get("use_checkpoint_args")
        else "give the checkpoint's values, or --use-checkpoint-args to take the model flags from the checkpoint"
    )
    raise CheckpointingError(
        f"checkpoint {where} was saved with another model architecture than this run:\n"
        + "\n".join(lines)
        + f"\n{hint}"
    )


def apply_checkpoint_args(args: argparse.Namespace, saved: PlainArgs, where: str) -> List[str]:
    """Set the model flags of ``args`` from the checkpoint's ``saved`` flags; returns the dests changed.

    Taken flags replace the command line's (a different command-line value is logged as
    overridden); filled ones only fill unset flags.
    """
    changed = []
    filled = filled_from_checkpoint()
    for dest in taken_from_checkpoint() + filled:
        if dest not in saved or (dest in filled and getattr(args, dest, None) is not None):
            continue
        from_plain = registry.RECORDS[dest].from_plain
        value = saved[dest] if from_plain is None else from_plain(saved[dest])
        current = getattr(args, dest, None)
        if current == value:
            continue
        if args.rank == 0:
            given = current != _table_default(dest)
            logger.log(
                logging.WARNING if given else logging.INFO,
                "--use-checkpoint-args: %s=%r from %s replaces %s %r",
                flag_label(dest),
                value,
                where,
                "the command line's" if given else "the default",
                current,
            )
        setattr(args, dest, value)
        changed.append(dest)
    return changed
