"""Every tensor a region of code creates or saves for backward: the largest, and the peak of live bytes.

``TensorMeter`` is a ``TorchDispatchMode`` (it sees the output of every op run inside it, forward and
backward, custom autograd functions and collectives included) joined with a
``saved_tensors_hooks`` pack hook (every tensor autograd keeps for backward). It records:

* ``largest_created`` / ``largest_saved``: the most elements of one tensor and its shape;
* ``peak_bytes``: the peak of live bytes of the storages created inside the region (a storage counts
  once however many views share it, and stops counting when its last tensor is freed); storages that
  existed before (the inputs, parameters) are not counted.

Shared by ``tests/unit_tests/transformer/test_context_parallel.py`` and ``benchmarks/bench_long_context.py``.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorMeter(TorchDispatchMode):
    """Use as ``with TensorMeter() as meter: ...`` (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest_created: Tuple[int, Optional[tuple]] = (0, None)
        self.largest_saved: Tuple[int, Optional[tuple]] = (0, None)
        self.live: Dict[int, List[int]] = {}  # storage pointer -> [bytes, live tensors]
        self.current = self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def __enter__(self):
        self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() > self.largest_saved[0]:
            self.largest_saved = (tensor.numel(), tuple(tensor.shape))
        return tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        before = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._created(t, before)
        return out

    def _created(self, t: torch.Tensor, inputs: set) -> None:
        if t.numel() > self.largest_created[0]:
            self.largest_created = (t.numel(), tuple(t.shape))
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or (ptr in inputs and ptr not in self.live):
            return  # empty, or a view of a storage made before the region
        if ptr not in self.live:
            self.live[ptr] = [storage.nbytes(), 0]
            self.current += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current)
        self.live[ptr][1] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]
