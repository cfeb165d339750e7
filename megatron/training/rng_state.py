"""Every random generator of this rank as plain data, for checkpoints and for ``rng_untouched``.

Python ``random``, NumPy, the torch CPU generator, each CUDA device's generator and the
model-parallel tracker's named streams; encoded with ``plain_data`` (JSON, nothing pickled).
"""

from __future__ import annotations

import logging
import random
from typing import Any, Dict, Optional

import numpy as np
import torch

from megatron.core.dist_checkpointing import plain_data
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

logger = logging.getLogger(__name__)


def collect_rng_state(tracker: CudaRNGStatesTracker) -> Dict[str, Any]:
    """This rank's generator states as plain data, ``tracker``'s named streams among them.

    Python ``random``, NumPy's global generator, the torch CPU generator, every CUDA
    device's generator (a list, one per visible device; None without CUDA) and the
    model-parallel tracker's named streams (CUDA states on GPU, CPU states otherwise,
    hence ``device``).
    """
    np_state = np.random.get_state()
    on_cuda = torch.cuda.is_available()
    state = {
        "random": random.getstate(),
        "numpy": {
            "keys": np_state[1].tolist(),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch_cpu": torch.get_rng_state(),
        "device": "cuda" if on_cuda else "cpu",
        "cuda": list(torch.cuda.get_rng_state_all()) if on_cuda else None,
        "cuda_device": torch.cuda.current_device() if on_cuda else None,
        "tracker": tracker.get_states(),
    }
    return plain_data.encode(state, "rng_state")


def restore_rng_state(encoded: Dict[str, Any], tracker: CudaRNGStatesTracker) -> None:
    """Inverse of ``collect_rng_state``: the named streams go back into ``tracker``.

    Device states saved on another kind of device (CPU vs CUDA) are not restored and a
    warning says so; the host generators always are.
    """
    state = plain_data.decode(encoded)
    random.setstate(state["random"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np.array(np_state["keys"], dtype=np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch_cpu"])
    saved_on = state.get("device") or ("cpu" if state["cuda"] is None else "cuda")  # older files lack "device"
    running_on = "cuda" if torch.cuda.is_available() else "cpu"
    if saved_on != running_on:
        logger.warning(
            "RNG state saved on %s, this run is on %s: CUDA and model-parallel tracker states are not "
            "restored (host generators are)",
            saved_on,
            running_on,
        )
        return
    if running_on == "cuda":
        _restore_cuda_rng(state["cuda"], state.get("cuda_device"))
    tracker.set_states(state["tracker"])


def _restore_cuda_rng(saved: Any, saved_device: Optional[int]) -> None:
    """Every device's CUDA generator when the device count matches, else only the current device's."""
    if isinstance(saved, torch.Tensor):  # checkpoints that kept the current device's state only
        torch.cuda.set_rng_state(saved)
        return
    if len(saved) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(saved)
        return
    logger.warning(
        "RNG state holds %d CUDA generators, this process sees %d devices: only the current "
        "device's generator is restored (from saved device %s)",
        len(saved),
        torch.cuda.device_count(),
        saved_device,
    )
    torch.cuda.set_rng_state(saved[saved_device or 0])
