"""Checkpoint formats: one module per ``--ckpt-format`` value, held by name in ``registry``.

``torch_dist.py`` (sharded, any layout) and ``torch_legacy.py`` (``--ckpt-format torch``: per TP/PP
rank files) implement ``base.CheckpointFormat``; ``checkpointing.py`` dispatches through
``registry.get_format`` and ``registry.detect``. A new format is one module that subclasses
``CheckpointFormat`` and is registered (``tests/unit_tests/dist_checkpointing/json_format.py`` is one).
The formats import only ``megatron.core`` and each other: what they need of the application (the
check of the saved arguments) comes in the ``LoadRequest``.
"""
