"""Import one megatron-core module without running the ``megatron`` and ``megatron.core`` package
``__init__`` files, which import nearly all of megatron-core (Inductor, wandb: about 6 CPU-seconds of the
oracle's start). For pure functions whose module imports what it needs itself (``parallel_state``'s rank
generator, ``moe_utils``' token dropping); the dataset oracles import the packages as upstream does.
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
    return importlib.import_module(name)
