"""NCCL's rules on every collective and point-to-point call, over the ``fake`` process group.

``install_nccl_rules`` wraps the ``torch.distributed`` functions the code base (and torch's
own helpers) call. Each tensor handed to a group whose backend is NCCL must be a contiguous
tensor on this rank's GPU (``cuda:0``; the dry run models one GPU per rank); a group created
with ``backend="gloo"`` takes CPU tensors only. A violation raises ``DeviceRuleError`` naming
the call, the tensor and the source line. ``get_backend`` answers "nccl" for the fake groups,
so ``comm_device(group)`` and the pipeline choose the GPU as they would with NCCL.

Calls are recorded (collective, p2p, and host syncs for ``barrier`` and the object
collectives, which pickle on the host and read sizes back with NCCL). The object
collectives cannot move data over the fake backend; they are emulated with every rank
holding this rank's object.
"""

from __future__ import annotations

import copy
import functools
import inspect
import pickle
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tools.dry_run.fake_cuda import Patcher, describe_tensor
from tools.dry_run.report import DeviceRuleError, Recorder

TENSOR_CALLS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)
P2P_CALLS = ("send", "recv", "isend", "irecv")


class NcclRules:
    """Which backend each group stands for, and the checks applied to its calls."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.backends: Dict[int, str] = {}
        self._depth = 0  # > 0 inside a wrapped call: torch's own nested calls are not re-checked

    def backend_of(self, group: Optional[dist.ProcessGroup]) -> str:
        group = group if group is not None else c10d._get_default_group()
        return self.backends.get(id(group), "nccl")

    def describe_group(self, group: Optional[dist.ProcessGroup]) -> str:
        group = group if group is not None else c10d._get_default_group()
        ranks = c10d.get_process_group_ranks(group)
        shown = ranks if len(ranks) <= 8 else ranks[:4] + ["..."] + ranks[-2:]
        return f"group of ranks {shown} ({self.backend_of(group)})"

    def check(self, call: str, group: Optional[dist.ProcessGroup], tensors: Iterable[torch.Tensor]) -> None:
        """Raise DeviceRuleError unless every tensor suits the group's backend."""
        backend = self.backend_of(group)
        for tensor in tensors:
            problem = None
            if backend == "nccl" and tensor.device.type != "cuda":
                problem = "NCCL only moves CUDA tensors"
            elif backend == "nccl" and (tensor.device.index or 0) != torch.cuda.current_device():
                problem = f"NCCL's communicator of this rank is bound to cuda:{torch.cuda.current_device()}"
            elif backend == "gloo" and tensor.device.type != "cpu":
                problem = "a gloo group only moves CPU tensors here"
            elif not tensor.is_contiguous():
                problem = f"{backend} needs contiguous tensors"
            if problem:
                raise DeviceRuleError(
                    f"torch.distributed.{call} over the {self.describe_group(group)} got a "
                    f"{describe_tensor(tensor)} tensor: {problem}"
                )

    def record(self, kind: str, call: str, group: Optional[dist.ProcessGroup], tensors: List[torch.Tensor]) -> None:
        self.recorder.add(
            kind, call, {"group": self.describe_group(group), "tensors": [describe_tensor(t) for t in tensors]}
        )


def _tensors_of(values: Iterable[Any]) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _wrap_tensor_call(rules: NcclRules, name: str, original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if rules._depth:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        tensors = _tensors_of(bound.arguments.values())
        rules.check(name, group, tensors)
        rules.record("p2p" if name in P2P_CALLS else "collective", name, group, tensors)
        rules._depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            rules._depth -= 1

    return wrapper


def _wrap_batch_p2p(rules: NcclRules, original: Callable) -> Callable:
    @functools.wraps(original)
    def batch_isend_irecv(p2p_op_list: List[dist.P2POp]) -> Any:
        for op in p2p_op_list:
            rules.check(f"batch_isend_irecv ({getattr(op.op, '__name__', op.op)})", op.group, [op.tensor])
        if p2p_op_list:
            rules.record("p2p", "batch_isend_irecv", p2p_op_list[0].group, [op.tensor for op in p2p_op_list])
        rules._depth += 1
        try:
            return original(p2p_op_list)
        finally:
            rules._depth -= 1

    return batch_isend_irecv


def _copy_object(obj: Any) -> Any:
    """What another rank would unpickle: a pickled copy (fake tensors cannot be pickled: shared)."""
    try:
        return pickle.loads(pickle.dumps(obj))
    except Exception:  # noqa: BLE001 - fake tensors and the like: the same object stands in
        return copy.copy(obj)


def _object_calls(rules: NcclRules) -> Dict[str, Callable]:
    """Emulations of the object collectives: every rank holds this rank's object."""

    def note(call: str, group: Optional[dist.ProcessGroup]) -> None:
        rules.record("collective", call, group, [])
        if rules.backend_of(group) == "nccl":
            rules.recorder.add("sync", f"{call} (host round trip with NCCL)")

    def all_gather_object(object_list: List[Any], obj: Any, group: Any = None) -> None:
        note("all_gather_object", group)
        object_list[:] = [_copy_object(obj) for _ in object_list]

    def gather_object(
        obj: Any,
        object_gather_list: Optional[List[Any]] = None,
        dst: Optional[int] = None,
        group: Any = None,
        group_dst: Optional[int] = None,
    ) -> None:
        note("gather_object", group)
        if object_gather_list is not None:
            object_gather_list[:] = [_copy_object(obj) for _ in object_gather_list]

    def broadcast_object_list(
        object_list: List[Any],
        src: Optional[int] = None,
        group: Any = None,
        device: Any = None,
        group_src: Optional[int] = None,
    ) -> None:
        note("broadcast_object_list", group)  # this rank's objects stand for the source's

    def scatter_object_list(
        scatter_object_output_list: List[Any],
        scatter_object_input_list: Any = None,
        src: Optional[int] = None,
        group: Any = None,
        group_src: Optional[int] = None,
    ) -> None:
        note("scatter_object_list", group)
        if scatter_object_input_list:
            index = dist.get_rank(group) % len(scatter_object_input_list)
            scatter_object_output_list[0] = _copy_object(scatter_object_input_list[index])

    return {f.__name__: f for f in (all_gather_object, gather_object, broadcast_object_list, scatter_object_list)}


def _group_calls(rules: NcclRules) -> Dict[str, Callable]:
    original_new_group, original_barrier = dist.new_group, dist.barrier

    def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None, **kwargs: Any) -> Any:
        group = original_new_group(ranks, timeout, **kwargs)  # the fake backend stands for any
        rules.backends[id(group)] = "nccl" if backend in (None, "nccl") else str(backend).lower()
        return group

    def get_backend(group: Any = None) -> str:
        return rules.backend_of(group)

    def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, timeout: Any = None) -> Any:
        rules.record("collective", "barrier", group, [])
        if rules.backend_of(group) == "nccl":
            rules.recorder.add("sync", "barrier (the host waits for the GPU with NCCL)")
        return original_barrier(group=group, async_op=async_op)

    def monitored_barrier(group: Any = None, *args: Any, **kwargs: Any) -> None:
        raise DeviceRuleError(
            f"torch.distributed.monitored_barrier over the {rules.describe_group(group)}: "
            "only gloo implements monitored_barrier, NCCL does not"
        )

    return {
        "new_group": new_group,
        "get_backend": get_backend,
        "barrier": barrier,
        "monitored_barrier": monitored_barrier,
    }


def install_nccl_rules(patcher: Patcher, recorder: Recorder) -> NcclRules:
    """Wrap torch.distributed's communication calls (see the module docstring); returns the rules."""
    rules = NcclRules(recorder)
    replacements: Dict[str, Callable] = {}
    for name in TENSOR_CALLS:
        original = getattr(dist, name, None)
        if original is not None:
            replacements[name] = _wrap_tensor_call(rules, name, original)
    replacements["batch_isend_irecv"] = _wrap_batch_p2p(rules, dist.batch_isend_irecv)
    replacements.update(_object_calls(rules))
    replacements.update(_group_calls(rules))
    for name, function in replacements.items():
        patcher.set(dist, name, function)
        if name in P2P_CALLS:  # P2POp accepts only distributed_c10d's own isend / irecv
            patcher.set(c10d, name, function)
    return rules
