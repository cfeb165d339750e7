"""Megatron-FSDP's sharded parameters (``optim_grads_params``): gather per layer, free after use, prefetch.

Each transformer layer (a module whose class sets ``is_fsdp_unit``) is a unit: its parameters sit
in buckets of their own (``ParamAndGradBuffer(starts=...)``), stored as this rank's shard only. The
units are numbered in forward order; every other parameter (embeddings, final norm, output layer)
belongs to the root, which is gathered when the wrapper's forward starts and freed when the step's
gradients are reduced.

* Forward of unit k: wait for its gather (issuing it if nobody did), issue unit k+1's gather
  (prefetch: it runs under unit k's compute), run; afterwards free unit k's full parameters.
* Backward of unit k starts when the gradient of its output arrives (a hook on the output): gather
  unit k again, issue unit k-1's; once every parameter of unit k has its gradient accumulated
  (``grad_ready``, called by the DDP hook) free it again.

Autograd keeps references to the parameters, whose storage is freed and re-filled in place, so
backward reads the re-gathered values. A forward re-run inside backward (activation recomputation)
does not free its unit: backward is about to read it. ``events`` (when given a list) records
``(what, unit)`` in issue order: ``"gather"`` issued, ``"wait"`` done, ``"forward_end"``,
``"backward_start"``, ``"free"``; the structural tests read it.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from megatron.core.distributed.param_and_grad_buffer import Bucket, ParamAndGradBuffer

ROOT = -1  # the unit number of parameters outside every transformer layer


def fsdp_unit_modules(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules that are Megatron-FSDP units (``is_fsdp_unit``), outermost only, in forward order."""
    units: List[torch.nn.Module] = []
    inside: Set[int] = set()
    for sub in module.modules():
        if id(sub) in inside:
            continue
        if getattr(sub, "is_fsdp_unit", False):
            units.append(sub)
            inside.update(id(m) for m in sub.modules())
    return units


def unit_of_params(units: List[torch.nn.Module]) -> Dict[int, int]:
    """Parameter id -> its unit's number (parameters outside every unit are absent: ``ROOT``)."""
    return {id(p): k for k, unit in enumerate(units) for p in unit.parameters()}


def unit_starts(params: List[torch.nn.Parameter], unit_of: Dict[int, int]) -> Set[int]:
    """Indices into ``params`` (a buffer's layout order) where the unit changes: each opens a bucket."""
    return {
        i for i in range(1, len(params)) if unit_of.get(id(params[i]), ROOT) != unit_of.get(id(params[i - 1]), ROOT)
    }


class ShardedParamUnits:
    """The gather / free / prefetch schedule of the units' buckets (module docstring)."""

    def __init__(
        self,
        units: List[torch.nn.Module],
        buffers: List[ParamAndGradBuffer],
        events: Optional[List[Tuple[str, int]]] = None,
    ) -> None:
        self.events = events
        unit_of = unit_of_params(units)
        self.buckets: Dict[int, List[Tuple[Bucket, dist.ProcessGroup]]] = {}
        self.params: Dict[int, Set[int]] = {}
        for buffer in buffers:
            for bucket in buffer.buckets:
                k = unit_of.get(id(bucket.params[0]), ROOT)
                self.buckets.setdefault(k, []).append((bucket, buffer.dp_group))
                self.params.setdefault(k, set()).update(id(p) for p in bucket.params if p.requires_grad)
        self.unit_of = unit_of
        self.num_units = len(units)
        self.pending: Dict[int, Set[int]] = {}
        self.hooks = []
        for k, unit in enumerate(units):
            self.hooks.append(unit.register_forward_pre_hook(self._make_pre_forward(k)))
            self.hooks.append(unit.register_forward_hook(self._make_post_forward(k)))

    def _record(self, what: str, k: int) -> None:
        if self.events is not None:
            self.events.append((what, k))

    def gather(self, k: int, wait: bool) -> None:
        """Issue unit ``k``'s all-gathers if not done yet (units outside ``[0, n)`` except ROOT: none);
        with ``wait`` block until they are done."""
        if k not in self.buckets or (k != ROOT and not 0 <= k < self.num_units):
            return
        if any([bucket.unshard(group) for bucket, group in self.buckets[k]]):
            self._record("gather", k)
        if wait:
            for bucket, _ in self.buckets[k]:
                bucket.finish_param_gather()
            self._record("wait", k)

    def free(self, k: int) -> None:
        """Free unit ``k``'s full parameters (its shards stay)."""
        for bucket, _ in self.buckets.get(k, ()):
            bucket.reshard()
        self._record("free", k)

    def free_all(self) -> None:
        """Free every unit and the root (end of the step's backward)."""
        for k in self.buckets:
            self.free(k)
        self.pending.clear()

    def gather_all(self) -> None:
        """Gather every parameter and wait (before they are read outside forward: checkpoints)."""
        for k in self.buckets:
            self.gather(k, wait=True)

    def _make_pre_forward(self, k: int):
        def hook(module: torch.nn.Module, args: Any) -> None:
            self.gather(k, wait=True)
            self.gather(k + 1, wait=False)  # prefetch: runs under this unit's compute

        return hook

    def _make_post_forward(self, k: int):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            self._record("forward_end", k)
            outputs = [t for t in _tensors(output) if t.requires_grad]
            for tensor in outputs:
                tensor.register_hook(self._make_pre_backward(k))
            if torch._C._current_graph_task_id() == -1:  # not a re-run inside backward (recomputation)
                self.free(k)

        return hook

    def _make_pre_backward(self, k: int):
        def hook(grad: torch.Tensor) -> None:
            if k not in self.pending:
                self._record("backward_start", k)
                self.pending[k] = set(self.params.get(k, ()))
                self.gather(k, wait=True)
                self.gather(k - 1, wait=False)  # prefetch the unit backward reaches next
            return None

        return hook

    def grad_ready(self, param: torch.nn.Parameter) -> None:
        """The DDP hook accumulated ``param``'s gradient: free its unit once all of them are in."""
        k = self.unit_of.get(id(param), ROOT)
        pending = self.pending.get(k)
        if pending is None:
            return
        pending.discard(id(param))
        if not pending:
            del self.pending[k]
            self.free(k)


def _tensors(output: Any) -> Iterable[torch.Tensor]:
    """The tensors of a module's output (a tensor, or a tuple / list holding some)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []
