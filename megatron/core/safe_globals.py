"""Classes ``torch.load(weights_only=True)`` may rebuild, registered when ``megatron.core`` is imported (as upstream).

Megatron-LM checkpoints and tests store these plain containers (``argparse.Namespace`` of the run's
arguments, ``BytesIO`` buffers, paths, signal numbers); registering them lets a weights-only load
read such files without allowing arbitrary classes. Upstream also lists numpy's array rebuild and
its own enums/configs (``ModelType``, ``OptimizerConfig``, the rerun state machine's classes);
those are left out here: our checkpoints never pickle them, and numpy's rebuild hook is a wider door.
"""

from __future__ import annotations

from argparse import Namespace
from io import BytesIO
from pathlib import PosixPath
from signal import Signals
from types import SimpleNamespace

import torch

SAFE_GLOBALS = [SimpleNamespace, PosixPath, Namespace, BytesIO, Signals]


def register_safe_globals() -> None:
    """Add ``SAFE_GLOBALS`` to torch's weights-only allow-list (a no-op on torch without one)."""
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:
        add(list(SAFE_GLOBALS))
