"""Put the FAKE ``transformer_engine`` (``tests/fakes``) on ``sys.path`` for the length of a block."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

FAKES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakes")


def _drop_te_modules() -> None:
    for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
        del sys.modules[name]


@contextlib.contextmanager
def fake_transformer_engine() -> Iterator[object]:
    """Within the block ``import transformer_engine`` finds the fake; yields its ``pytorch`` module."""
    if "transformer_engine" in sys.modules:
        raise RuntimeError("a transformer_engine is already imported: the fake would not be the one used")
    sys.path.insert(0, FAKES)
    try:
        import transformer_engine.pytorch as te_pytorch

        te_pytorch.RECORD.clear()
        yield te_pytorch
    finally:
        sys.path.remove(FAKES)
        _drop_te_modules()
