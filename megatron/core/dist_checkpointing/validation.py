"""``--dist-ckpt-strictness``: what a load does when the model's keys and the checkpoint's differ.

Two kinds of mismatch, in Megatron's words:

- *unexpected*: a key this model asks for that the checkpoint lacks (checked per rank);
- *missing*: a key the checkpoint holds that no rank of this model asks for (checked over all
  ranks with one all-reduce of a 0/1 mask over the checkpoint's keys). Keys the caller does not
  mean to read (optimizer state under ``--no-load-optim``) are not mismatches.

Megatron's values, and what each does here:

==================== ====================================== ========================================
value                unexpected (model key not saved)       missing (saved key unused)
==================== ====================================== ========================================
assume_ok_unexpected error                                  error (Megatron does not look)
raise_unexpected     error                                  one info line with the count
raise_all            error                                  error
log_unexpected       warning; those tensors keep their init one info line with the count
log_all              warning; those tensors keep their init warning
return_unexpected    as log_unexpected (a training run has no caller to return them to)
return_all           as log_all
ignore_all           skipped quietly                        skipped quietly
==================== ====================================== ========================================

The default keeps Megatron's value but also refuses unused tensors: a checkpoint of another
architecture with equal shapes (a learned position table under ``--position-embedding-type
rope``) would otherwise load with part of it silently dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.agreement import agree_on_error
from megatron.core.dist_checkpointing.errors import CheckpointingError
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.utils import comm_device

logger = logging.getLogger(__name__)
_SHOWN = 8  # keys named in a message


class StrictHandling(str, Enum):
    """The values of ``--dist-ckpt-strictness`` (Megatron's names)."""

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"


_S = StrictHandling
_RAISE_ON_UNEXPECTED = {_S.ASSUME_OK_UNEXPECTED, _S.RAISE_UNEXPECTED, _S.RAISE_ALL}
_RAISE_ON_MISSING = {_S.ASSUME_OK_UNEXPECTED, _S.RAISE_ALL}
_WARN_ON_MISSING = {_S.LOG_ALL, _S.RETURN_ALL}


@dataclass
class KeyMismatch:
    """``unexpected``: this rank's keys the checkpoint lacks; ``missing``: saved keys no rank reads."""

    unexpected: List[str]
    missing: List[str]


def parse_strictness(value: str) -> StrictHandling:
    """The enum member of a flag value; the error names the flag and the choices."""
    try:
        return StrictHandling(value)
    except ValueError:
        raise ValueError(
            f"dist_ckpt_strictness={value!r}: must be one of {', '.join(s.value for s in StrictHandling)}"
        ) from None


def find_mismatches(
    requested: Iterable[str],
    saved: Iterable[str],
    not_read_prefixes: Sequence[str] = (),
    process_group: Optional[dist.ProcessGroup] = None,
) -> KeyMismatch:
    """Collective over ``process_group``: compare this rank's keys with the checkpoint's."""
    saved_keys = sorted(saved)
    index = {key: i for i, key in enumerate(saved_keys)}
    used = [0] * len(saved_keys)
    unexpected = []
    for key in requested:
        if key in index:
            used[index[key]] = 1
        else:
            unexpected.append(key)
    mask = torch.tensor(used, dtype=torch.int32, device=comm_device(process_group))
    if dist.is_initialized():
        dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=process_group)
    prefixes = tuple(not_read_prefixes)
    missing = [k for k, u in zip(saved_keys, mask.tolist()) if not u and not (prefixes and k.startswith(prefixes))]
    return KeyMismatch(sorted(unexpected), missing)


def _shown(keys: List[str]) -> str:
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return ", ".join(keys[:_SHOWN]) + more


def _unexpected_error(keys: List[str], strict: StrictHandling, where: str) -> Optional[str]:
    if not keys:
        return None
    message = f"{len(keys)} tensor(s) of this model are not in the checkpoint {where}: {_shown(keys)}"
    if strict in _RAISE_ON_UNEXPECTED:
        return (
            message + f" (dist_ckpt_strictness={strict.value}; log_unexpected loads the others and keeps "
            "these at their initial values)"
        )
    if strict is not StrictHandling.IGNORE_ALL:
        logger.warning("%s; they keep their initial values (dist_ckpt_strictness=%s)", message, strict.value)
    return None


def _handle_missing(keys: List[str], strict: StrictHandling, where: str) -> None:
    if not keys:
        return
    message = f"{len(keys)} tensor(s) in the checkpoint {where} are not used by this model"
    if strict in _RAISE_ON_MISSING:
        raise CheckpointingError(
            f"{message}: {_shown(keys)}; the checkpoint holds another architecture (e.g. a learned position table "
            f"under position_embedding_type='rope'). dist_ckpt_strictness={strict.value} refuses this; "
            "raise_unexpected or log_all loads it anyway"
        )
    first_rank = not dist.is_initialized() or dist.get_rank() == 0
    if strict in _WARN_ON_MISSING and first_rank:
        logger.warning("%s, not loaded: %s (dist_ckpt_strictness=%s)", message, _shown(keys), strict.value)
    elif strict is not StrictHandling.IGNORE_ALL and first_rank:
        logger.info("%s, not loaded (dist_ckpt_strictness=%s)", message, strict.value)


def apply_strictness(
    sharded_sd: ShardedStateDict,
    saved: Iterable[str],
    strict: StrictHandling,
    where: str,
    not_read_prefixes: Sequence[str] = (),
    process_group: Optional[dist.ProcessGroup] = None,
) -> Tuple[ShardedStateDict, KeyMismatch]:
    """Collective: raise, log or drop mismatched keys as ``strict`` says; returns what is left to load.

    Every rank raises together: unused keys are found over all ranks, absent ones are agreed.
    """
    found = find_mismatches(sharded_sd, saved, not_read_prefixes, process_group)
    agree_on_error(_unexpected_error(found.unexpected, strict, where), process_group)
    _handle_missing(found.missing, strict, where)
    absent = set(found.unexpected)
    kept = {key: value for key, value in sharded_sd.items() if key not in absent}
    return kept, found
