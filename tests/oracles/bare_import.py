"""Import one megatron-core module without running the ``megatron`` and ``megatron.core`` package
``__init__`` files, which import nearly all of megatron-core (Inductor, wandb: about 6 CPU-seconds of the
oracle's start). The oracles use megatron-core's pure functions and datasets (``parallel_state``'s rank
generator, ``moe_utils``' token dropping, the masked datasets), whose modules import what they need
themselves. ``megatron.core.parallel_state`` is imported first, as the package ``__init__`` does: it and
``megatron.core.utils`` import each other, and only that order resolves.
"""

import importlib
import os
import sys
import types


def import_bare(name: str) -> types.ModuleType:
    """``importlib.import_module(name)`` with ``megatron`` and ``megatron.core`` as empty packages."""
    for package in ("megatron", "megatron.core"):
        if package in sys.modules:
            continue
        roots = [os.path.join(p, *package.split(".")) for p in sys.path if p]
        module = types.ModuleType(package)
        module.__path__ = [r for r in roots if os.path.isdir(r)]
        sys.modules[package] = module
    importlib.import_module("megatron.core.parallel_state")
    return importlib.import_module(name)
