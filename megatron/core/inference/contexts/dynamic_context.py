"""Megatron-core's path of ``DynamicInferenceContext`` (ours: ``megatron.core.inference.dynamic_context``)."""

from megatron.core.inference.dynamic_context import DynamicInferenceContext

__all__ = ["DynamicInferenceContext"]
