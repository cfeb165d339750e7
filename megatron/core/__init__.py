"""Megatron Core: the library of typed building blocks (no argparse, no global args)."""

import sys

if "torch" in sys.modules:  # a torch-free import (the tokenizers) stays torch-free; core/utils.py registers too
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()
