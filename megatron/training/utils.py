"""Small helpers of the training application: rank-aware printing (Megatron's names), provider calls."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.utils import unwrap_model  # noqa: F401 - Megatron-LM's training.utils exports it


def _rank_and_world() -> tuple:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_rank_0() -> bool:
    """True on global rank 0, or when not distributed."""
    return _rank_and_world()[0] == 0


def is_last_rank() -> bool:
    """True on the last global rank (it holds the last pipeline stage, hence the loss)."""
    rank, world = _rank_and_world()
    return rank == world - 1


def print_rank_0(message: Any) -> None:
    """Print (flushed) on rank 0 only."""
    if is_rank_0():
        print(message, flush=True)


def print_rank_last(message: Any) -> None:
    """Print (flushed) on the last rank only."""
    if is_last_rank():
        print(message, flush=True)


def call_provider(fn: Callable, *args: Any, offered: Optional[Dict[str, Any]] = None, **required: Any) -> Any:
    """Call an entry point's provider: ``required`` keywords always, ``offered`` ones where it declares them.

    ``required`` keywords decide what the provider must build (``pre_process``, ``post_process``,
    ``vp_stage`` under virtual pipelining): a provider that cannot take one raises ``TypeError``
    naming it, before it is called, as Megatron-LM's call would. ``offered`` keywords (``config``,
    ``args``, ``tokenizer``, ``pg_collection``) carry what a provider written for Megatron-LM reads
    from ``get_args()`` and the global groups instead, so such a provider works without declaring
    them; a provider taking ``**kwargs`` receives them all. A name in both is passed as required.
    """
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    missing = [name for name in required if not takes_any and name not in params]
    if missing:
        raise TypeError(f"{getattr(fn, '__name__', fn)} does not take {', '.join(missing)}, which this run passes")
    extra = {k: v for k, v in (offered or {}).items() if (takes_any or k in params) and k not in required}
    return fn(*args, **required, **extra)


def next_batch_on_device(data_iterator: Iterator, keys: Optional[Sequence[str]] = None) -> Dict[str, torch.Tensor]:
    """The next micro batch as tensors (only ``keys`` when given), on the GPU if there is one."""
    batch = next(data_iterator)
    batch = {key: torch.as_tensor(batch[key]) for key in (keys if keys is not None else batch)}
    if torch.cuda.is_available():
        batch = {key: value.cuda(non_blocking=True) for key, value in batch.items()}
    return batch


def masked_token_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Dict]:
    """Megatron's token-summed LM loss: the masked sum of per-token losses, its token count, and the
    ``lm loss`` ``[sum, count]`` pair to report (GPT and T5 forward steps).

    Under context parallelism both cover this CP rank's tokens only: the schedule sums the counts
    over CP before dividing, and the report's pairs are summed over ``dp_cp``.
    """
    losses = output_tensor.float().view(-1)  # [b*s(/cp)]
    mask = loss_mask.float().view(-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}
