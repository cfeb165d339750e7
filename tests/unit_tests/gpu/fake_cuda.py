"""Fake CUDA and NCCL-like process groups for CPU-only tests of device placement.

``FakeCuda`` is a ``FakeTensorMode``: tensors made on ``"cuda"`` live on ``cuda:0`` without a GPU,
and an op mixing a ``cuda`` tensor with a CPU tensor that is not a 0-dim scalar raises
``FakeTensorDeviceMismatchError`` exactly where a GPU raises "Expected all tensors to be on the
same device". It also counts what costs a GPU run its asynchrony:

* ``syncs``: host reads of device values (``.item()``, ``bool(t)``, ``.tolist()``: answered with
  0 / False, since fake tensors hold no data) and device-to-host copies;
* ``host_to_device``: copies of CPU tensors to the device (``cpu_tensor.to("cuda")``,
  ``cuda_tensor.copy_(cpu_tensor)``).

A CPU build cannot run autograd's backward on fake CUDA tensors (the engine aborts the process
looking for a CUDA device guard): tests set ``.grad`` themselves.

``nccl_like(monkeypatch)`` makes every process group report the ``nccl`` backend (so
``comm_device`` answers ``cuda:0``) and makes the collectives refuse non-CUDA tensors as NCCL
does ("Tensors must be CUDA and dense"). Combine with ``fake_world`` (the ``fake`` backend: any
rank of any world size in this process, collectives leave the data alone).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

aten = torch.ops.aten

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "gather",
    "scatter",
    "reduce",
    "send",
    "recv",
    "isend",
    "irecv",
    "all_to_all_single",
)


_DATA_ONLY = (aten.copy_.default, aten.uniform_.default)


def _copy_through_dispatcher(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    return aten.copy_.default(self, src, non_blocking)


def _basic_index(tensor: torch.Tensor, index: Any) -> torch.Tensor:
    """``tensor[index]`` for ints, slices, None and Ellipsis, through aten ops (views, like indexing)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = tensor.dim() - sum(1 for i in items if i is not None and i is not Ellipsis)
        items = items[:at] + [slice(None)] * fill + items[at + 1 :]
    out, dim = tensor, 0
    for item in items:
        if isinstance(item, slice):
            start, stop, step = item.indices(out.shape[dim])
            out, dim = aten.slice.Tensor(out, dim, start, max(start, stop), step), dim + 1
        elif isinstance(item, int):
            out = aten.select.int(out, dim, item)
        elif item is None:
            out, dim = out.unsqueeze(dim), dim + 1
        else:
            raise NotImplementedError(f"FakeCuda indexes with ints, slices, None and ...; got {type(item).__name__}")
    return out


def _getitem(self: torch.Tensor, index: Any) -> torch.Tensor:
    return _basic_index(self, index)


def _setitem(self: torch.Tensor, index: Any, value: Any) -> None:
    target = _basic_index(self, index)
    if isinstance(value, torch.Tensor):
        aten.copy_.default(target, value)
    else:
        target.fill_(value)


_REROUTED = {
    "copy_": _copy_through_dispatcher,
    "__getitem__": _getitem,
    "__setitem__": _setitem,
    "__int__": lambda self: int(self.item()),
    "__float__": lambda self: float(self.item()),
}


class FakeCuda(FakeTensorMode):
    """A FakeTensorMode that counts host syncs and host-to-device copies (see the module doc)."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self._depth = 0
        self._saved: dict = {}
        self.syncs = 0
        self.host_to_device = 0

    def __enter__(self) -> FakeCuda:
        # The Python bindings of copy_, indexing, int() and float() take a CUDA device guard, which a
        # CPU build lacks; the aten ops themselves reach this mode. Torch re-enters the mode
        # internally, so only the outermost entry patches and its exit restores.
        if self._depth == 0:
            self._saved = {name: getattr(torch.Tensor, name) for name in _REROUTED}
            for name, method in _REROUTED.items():
                setattr(torch.Tensor, name, method)
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            for name, method in self._saved.items():
                setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def counts(self) -> tuple:
        """``(syncs, host_to_device)`` so far."""
        return self.syncs, self.host_to_device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            self.syncs += 1
            return False if args[0].dtype == torch.bool else 0
        if func is aten._to_copy.default and kwargs.get("device") is not None:
            self._count_copy(args[0].device, torch.device(kwargs["device"]))
        if func in _DATA_ONLY:
            # These only write values, which fake tensors do not hold; a CPU build cannot run them
            # on fake CUDA ("not linked with support for cuda devices"). copy_ may cross devices.
            if func is aten.copy_.default:
                self._count_copy(args[1].device, args[0].device)
            return args[0]
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _count_copy(self, source: torch.device, target: torch.device) -> None:
        if source.type == "cpu" and target.type == "cuda":
            self.host_to_device += 1
        elif source.type == "cuda" and target.type == "cpu":
            self.syncs += 1  # the host waits for the device


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as ``rank`` of a ``world_size``-rank ``fake`` process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _cuda_only(name: str, collective: Callable) -> Callable:
    @functools.wraps(collective)
    def checked(*args: Any, **kwargs: Any) -> Any:
        for tensor in _tensors(list(args) + list(kwargs.values())):
            if tensor.device.type != "cuda":
                raise ValueError(f"NCCL {name}: Tensors must be CUDA and dense (got a tensor on {tensor.device})")
        return collective(*args, **kwargs)

    return checked


def nccl_like(monkeypatch: pytest.MonkeyPatch, device_index: int = 0) -> None:
    """Every group reports ``nccl`` and its collectives take only CUDA tensors (until the test ends)."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device_index)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # read by broadcast
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 0, 0))  # read by c10d's error logging
    for name in COLLECTIVES:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, _cuda_only(name, getattr(dist, name)))


def on_cuda(tensor: Optional[torch.Tensor]) -> bool:
    """Whether ``tensor`` is on the (fake) GPU."""
    return tensor is not None and tensor.device.type == "cuda"
