"""``CUDA_DEVICE_MAX_CONNECTIONS=1`` for the run, set before CUDA starts, where Megatron needs it.

With one hardware work queue per device the GPU starts kernels in the order they were issued, so
a communication kernel issued before a GEMM (the linears' asynchronous gathers and reductions, the
``tp_comm_overlap`` ring, context parallelism's transfers) starts before the GEMM takes every SM.
Megatron-LM requires the variable to be 1 when tensor or context parallelism is used on a GPU
older than Blackwell (compute capability < 10; FSDP, which wants more queues, is not supported
here). The driver reads it when the CUDA context is created, so ``initialize_run`` calls
``set_device_max_connections`` after validating the flags and before anything touches CUDA; a
value the user set is kept (with a warning when it is not 1).
"""

from __future__ import annotations

import argparse
import os
from typing import MutableMapping, Optional, Tuple

import torch

VAR = "CUDA_DEVICE_MAX_CONNECTIONS"
BLACKWELL_MAJOR = 10  # compute capability from which Megatron no longer needs one connection


def needs_one_connection(tp_size: int, cp_size: int, gpus: int, arch_major: Optional[int]) -> bool:
    """Megatron's rule: TP > 1 or CP > 1 on a GPU older than Blackwell (an unknown architecture counts
    as older: one queue never changes results)."""
    old_gpu = arch_major is None or arch_major < BLACKWELL_MAJOR
    return gpus > 0 and (tp_size > 1 or cp_size > 1) and old_gpu


def visible_gpus() -> Tuple[int, Optional[int]]:
    """(GPUs visible, the first one's compute-capability major or None), without creating a CUDA
    context: torch counts devices through NVML; the capability comes from ``pynvml`` where installed."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return 0, None
    try:
        import pynvml

        pynvml.nvmlInit()
        return count, pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(0))[0]
    except Exception:  # no pynvml, or NVML cannot say: the rule treats the GPU as pre-Blackwell
        return count, None


def set_device_max_connections(
    args: argparse.Namespace, environ: Optional[MutableMapping[str, str]] = None
) -> Optional[str]:
    """Set ``CUDA_DEVICE_MAX_CONNECTIONS=1`` in ``environ`` (``os.environ``) when the rule holds and it is
    unset. Returns the line to print (what was set, or why a user's value is kept), or None."""
    environ = os.environ if environ is None else environ
    gpus, arch_major = visible_gpus()
    if not needs_one_connection(args.tensor_model_parallel_size, args.context_parallel_size, gpus, arch_major):
        return None
    current = environ.get(VAR)
    if current == "1":
        return None
    if current is not None:
        return (
            f"warning: {VAR}={current} kept as set; tensor/context parallelism overlaps communication with "
            f"GEMMs only with {VAR}=1"
        )
    environ[VAR] = "1"
    late = " (CUDA had already started: takes effect in new processes only)" if torch.cuda.is_initialized() else ""
    return f"{VAR}=1 set: tensor/context parallelism on a GPU before Blackwell{late}"
