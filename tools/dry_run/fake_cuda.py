"""``torch.cuda`` as seen on a machine with one GPU per rank, for a run whose tensors are fake.

``patch_cuda_api`` makes ``torch.cuda`` answer like a real one-GPU machine (available,
one device, device 0, bf16 supported, Hopper capability, memory queries), keeps the
CUDA generator state as plain bytes (no generator exists), turns streams and events into
objects that are always complete, and reports ``torch.cuda.synchronize`` and event /
stream ``synchronize`` as host synchronisations. ``torch.set_rng_state`` accepts the fake
CPU byte tensors that checkpointed RNG states become (validated, not applied).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

from tools.dry_run.report import DeviceRuleError, Recorder

_MISSING = object()
_GIB = 1024**3
GPU_NAME = "NVIDIA H100 80GB HBM3 (dry run)"
NCCL_VERSION = (2, 21, 5)


class Patcher:
    """Sets attributes and puts the old values back, in reverse order, on ``restore``."""

    def __init__(self) -> None:
        self._saved: List[Tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, old in reversed(self._saved):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._saved.clear()


def _is_fake(tensor: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def check_rng_state(state: Any, where: str) -> None:
    """A generator state must be a CPU uint8 tensor, as torch requires (also for the CUDA generator)."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.device.type != "cpu":
        got = f"{state.dtype} on {state.device}" if isinstance(state, torch.Tensor) else type(state).__name__
        raise DeviceRuleError(f"{where}: a generator state must be a torch.uint8 tensor on the CPU, got {got}")


class PaperGenerator:
    """The CUDA generator's state as 16 bytes (seed and offset), without a generator."""

    def __init__(self) -> None:
        self.state: torch.Tensor = self._bytes(0)

    @staticmethod
    def _bytes(seed: int) -> torch.Tensor:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            return torch.tensor(list(int(seed).to_bytes(8, "little", signed=False)) + [0] * 8, dtype=torch.uint8)

    def manual_seed(self, seed: int) -> None:
        self.state = self._bytes(int(seed) % 2**64)

    def get_state(self, device: Any = "cuda") -> torch.Tensor:
        return self.state.clone()

    def set_state(self, state: torch.Tensor, device: Any = "cuda") -> None:
        check_rng_state(state, "torch.cuda.set_rng_state")
        self.state = state.clone()


class PaperStream:
    """A CUDA stream that has always finished its work."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = torch.device("cuda", 0)
        self.priority = priority
        self._sync: Callable[[str], None] = lambda what: None

    def synchronize(self) -> None:
        self._sync("Stream.synchronize()")

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> PaperEvent:
        return event or PaperEvent()

    def query(self) -> bool:
        return True

    def __enter__(self) -> PaperStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class PaperEvent:
    """A CUDA event that is always complete; ``synchronize`` counts as a host sync."""

    sync_hook: Callable[[str], None] = staticmethod(lambda what: None)

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        PaperEvent.sync_hook("Event.synchronize()")

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


def _properties() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name=GPU_NAME,
        major=9,
        minor=0,
        total_memory=80 * _GIB,
        multi_processor_count=132,
        is_integrated=False,
        is_multi_gpu_board=False,
        L2_cache_size=50 * 1024**2,
    )


def _device_index(device: Any) -> int:
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise DeviceRuleError(f"torch.cuda.set_device({device}): not a CUDA device")
    return device.index or 0


class _DeviceContext:
    """``torch.cuda.device(d)``: the only device is 0."""

    def __init__(self, device: Any) -> None:
        _device_index(device)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _set_device(device: Any) -> None:
    index = _device_index(device)
    if index != 0:
        raise DeviceRuleError(
            f"torch.cuda.set_device({index}): the dry run models one GPU per rank "
            "(device_count() == 1), so the only valid device is 0"
        )


def _cpu_set_rng_state(original: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    def set_rng_state(new_state: torch.Tensor) -> None:
        check_rng_state(new_state, "torch.set_rng_state")
        if not _is_fake(new_state):
            original(new_state)

    return set_rng_state


def patch_cuda_api(patcher: Patcher, recorder: Recorder) -> None:
    """Install the one-GPU ``torch.cuda`` (see the module docstring)."""
    cuda = torch.cuda
    generator = PaperGenerator()

    def sync(what: str) -> None:
        recorder.add("sync", what)

    PaperEvent.sync_hook = staticmethod(sync)
    default_stream = PaperStream()
    default_stream._sync = sync
    simple = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "is_initialized": lambda: True,
        "_lazy_init": lambda: None,
        "init": lambda: None,
        "set_device": _set_device,
        "device": _DeviceContext,
        "synchronize": lambda device=None: sync("torch.cuda.synchronize()"),
        "get_rng_state": generator.get_state,
        "set_rng_state": generator.set_state,
        "get_rng_state_all": lambda: [generator.get_state()],
        "set_rng_state_all": lambda states: [generator.set_state(s) for s in states],
        "manual_seed": generator.manual_seed,
        "manual_seed_all": generator.manual_seed,
        "seed": lambda: None,
        "seed_all": lambda: None,
        "initial_seed": lambda: 0,
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: 0,
        "memory_stats": lambda device=None: {},
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
        "mem_get_info": lambda device=None: (80 * _GIB, 80 * _GIB),
        "get_device_properties": lambda device=None: _properties(),
        "get_device_capability": lambda device=None: (9, 0),
        "get_device_name": lambda device=None: GPU_NAME,
        "is_bf16_supported": lambda *a, **k: True,
        "Stream": PaperStream,
        "Event": PaperEvent,
        "current_stream": lambda device=None: default_stream,
        "default_stream": lambda device=None: default_stream,
        "set_stream": lambda stream: None,
        "stream": lambda stream=None: contextlib.nullcontext(stream),
    }
    for name, value in simple.items():
        patcher.set(cuda, name, value)
    import torch.cuda.nccl as nccl

    patcher.set(nccl, "version", lambda: NCCL_VERSION)  # torch's loggers ask it of NCCL groups
    patcher.set(torch, "set_rng_state", _cpu_set_rng_state(torch.set_rng_state))
    patcher.set(torch.random, "set_rng_state", torch.set_rng_state)


@contextlib.contextmanager
def patched(install: Callable[[Patcher], None]) -> Iterator[Patcher]:
    """Run ``install(patcher)``, yield, and restore everything afterwards."""
    patcher = Patcher()
    try:
        install(patcher)
        yield patcher
    finally:
        patcher.restore()


def describe_tensor(tensor: Optional[torch.Tensor]) -> str:
    """``cuda:0 bfloat16[2, 32]`` (or ``None``)."""
    if tensor is None:
        return "None"
    return f"{tensor.device} {str(tensor.dtype).replace('torch.', '')}{list(tensor.shape)}"
