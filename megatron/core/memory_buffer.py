"""Megatron's reusable scratch buffers (``parallel_state.get_global_memory_buffer()``).

Code that needs a temporary tensor of a known shape in every step (an all-gather's
output, say) asks the buffer for it by name instead of allocating anew; the storage
of each (name, dtype) grows to the largest request and is reused. Two users must
not hold tensors of the same name at the same time.
"""

from __future__ import annotations

import contextlib
from math import prod
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch


class GlobalMemoryBuffer:
    """Scratch storage by (name, dtype), on the current CUDA device (the CPU without CUDA)."""

    def __init__(self) -> None:
        self.buffer: Dict[Tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(
        self,
        tensor_shape: Sequence[int],
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Optional[Callable[[], contextlib.AbstractContextManager]] = None,
    ) -> torch.Tensor:
        """A ``tensor_shape`` view of buffer ``name`` (contents undefined); grows the buffer if needed.

        ``mem_alloc_context`` is entered around a new allocation (e.g. a memory pool).
        """
        needed = prod(tensor_shape)
        held = self.buffer.get((name, dtype))
        if held is None or held.numel() < needed:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
            with (mem_alloc_context or contextlib.nullcontext)():
                held = torch.empty(needed, dtype=dtype, device=device, requires_grad=False)
            self.buffer[(name, dtype)] = held
        return held[:needed].view(*tensor_shape)


_GLOBAL_MEMORY_BUFFER: Optional[GlobalMemoryBuffer] = None


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    """The process-wide buffer (created on first use; Megatron creates it in ``initialize_model_parallel``)."""
    global _GLOBAL_MEMORY_BUFFER
    if _GLOBAL_MEMORY_BUFFER is None:
        _GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()
    return _GLOBAL_MEMORY_BUFFER


def destroy_global_memory_buffer() -> None:
    """Drop the process-wide buffer (and its storage)."""
    global _GLOBAL_MEMORY_BUFFER
    _GLOBAL_MEMORY_BUFFER = None
