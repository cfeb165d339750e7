"""Megatron's ``get_args()`` / ``get_tokenizer()`` for entry points written against Megatron-LM.

Our own code passes args and tokenizers explicitly; these accessors exist so that
user scripts whose providers call ``get_args()`` keep working. Set once by ``pretrain``.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

_ARGS: Optional[argparse.Namespace] = None
_TOKENIZER: Optional[Any] = None


def set_global_variables(args: argparse.Namespace, tokenizer: Optional[Any]) -> None:
    global _ARGS, _TOKENIZER
    _ARGS, _TOKENIZER = args, tokenizer


def set_args(args: argparse.Namespace) -> None:
    """Megatron's ``set_args``: make ``args`` what ``get_args()`` returns (the tokenizer is left as it is)."""
    global _ARGS
    _ARGS = args


def get_args() -> argparse.Namespace:
    if _ARGS is None:
        raise RuntimeError("get_args(): arguments are not set; pretrain() sets them after parsing")
    return _ARGS


def get_tokenizer() -> Any:
    if _TOKENIZER is None:
        raise RuntimeError("get_tokenizer(): no tokenizer is set; pretrain() builds it from --tokenizer-type")
    return _TOKENIZER
