"""Megatron Core: the library of typed building blocks (no argparse, no global args)."""

from megatron.core.safe_globals import register_safe_globals

register_safe_globals()
