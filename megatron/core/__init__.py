"""Megatron Core: the library of typed building blocks (no argparse, no global args)."""
