"""Megatron-core's process-wide experimental switch (``megatron.core.config``).

Code decorated with ``megatron.core.utils.experimental_cls`` runs only while it is on.
"""

ENABLE_EXPERIMENTAL = False


def set_experimental_flag(flag: bool) -> None:
    """Turn experimental features on (True) or off (False)."""
    global ENABLE_EXPERIMENTAL
    ENABLE_EXPERIMENTAL = flag


def is_experimental_enabled() -> bool:
    """Whether experimental features are on."""
    return ENABLE_EXPERIMENTAL
