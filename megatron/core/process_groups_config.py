"""Megatron-core's module path for ``ProcessGroupCollection`` (ours lives in ``megatron.core.process_groups``)."""

from megatron.core.process_groups import ProcessGroupCollection

__all__ = ["ProcessGroupCollection"]
