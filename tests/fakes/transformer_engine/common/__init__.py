"""Fake ``transformer_engine.common`` (see the package docstring)."""
