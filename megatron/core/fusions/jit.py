"""Megatron's ``jit_fuser``: a fused region compiled by ``torch.compile`` once per input signature.

``jit_fuser(fn)`` returns a callable that, while the fuser is enabled (the default; Megatron's
``--disable-jit-fuser`` turns it off process-wide through ``set_jit_fuser_enabled``), runs ``fn``
compiled with ``fullgraph=True`` (a graph break raises instead of silently splitting the region) and
``dynamic=False`` (one specialised kernel per shape: training shapes are stable, so a run compiles
each region once per shape). The first call of each new signature (shapes, dtypes, which optional
arguments are None) is timed and its compile time is logged and kept in ``compile_log()``. With the
fuser off, or with torch's own ``TORCHDYNAMO_DISABLE=1`` (the default test tier sets it), ``fn``
runs eagerly: the same math, op by op; so it does on fake tensors (the GPU dry run).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, List, Set, Tuple

import torch

logger = logging.getLogger(__name__)

_STATE = {"enabled": True}
_COMPILE_LOG: List[Tuple[str, float]] = []  # (region and signature, seconds of its first call)


def set_jit_fuser_enabled(enabled: bool) -> None:
    """Compile the fused regions (True, default) or run them eagerly (``--disable-jit-fuser``)."""
    _STATE["enabled"] = bool(enabled)


def jit_fuser_enabled() -> bool:
    """Whether fused regions are compiled: the fuser is on and torch's dynamo is not disabled."""
    return _STATE["enabled"] and not _dynamo_disabled()


def _dynamo_disabled() -> bool:
    import torch._dynamo.config as dynamo_config

    return bool(dynamo_config.disable) or os.environ.get("TORCHDYNAMO_DISABLE", "") == "1"  # torch's own switches


def compile_log() -> List[Tuple[str, float]]:
    """The compilations of this process: (region and signature, seconds its first call took)."""
    return list(_COMPILE_LOG)


def _any_fake(args: tuple) -> bool:
    """Fake tensors (the GPU dry run's ``cuda`` tensors on a CPU-only torch) have no kernels to compile: the
    region runs op by op on them, the same ops the compiled kernel would fuse."""
    from torch._subclasses.fake_tensor import is_fake

    return any(isinstance(a, torch.Tensor) and is_fake(a) for a in args)


def _signature(args: tuple) -> tuple:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


class _Fused:
    """``fn`` compiled lazily on first use (see the module doc)."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.name = fn, fn.__name__
        self._compiled = None
        self._seen: Set[tuple] = set()
        self._unavailable = False  # compiling failed here (e.g. no C++ compiler for Inductor): run eagerly

    def __call__(self, *args):
        if not jit_fuser_enabled() or _any_fake(args) or self._unavailable:
            return self.fn(*args)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, fullgraph=True, dynamic=False)
        key = _signature(args)
        if key in self._seen:
            return self._compiled(*args)
        start = time.perf_counter()
        try:
            out = self._compiled(*args)
        except Exception as err:  # the compiler, not the math: the eager region computes the same
            self._unavailable = True
            logger.warning("jit_fuser: %s runs unfused (compiling failed: %s: %s)", self.name, type(err).__name__, err)
            return self.fn(*args)
        seconds = time.perf_counter() - start
        self._seen.add(key)
        _COMPILE_LOG.append((f"{self.name}{key}", seconds))
        logger.info("jit_fuser: compiled %s for %s in %.1f s", self.name, key, seconds)
        return out


def jit_fuser(fn: Callable) -> Callable:
    """Mark ``fn`` as a fused region (module doc); a decorator."""
    return _Fused(fn)
