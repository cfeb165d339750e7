"""Megatron-core's module path of ``StaticInferenceContext`` (defined in ``megatron.core.inference.contexts``)."""

from megatron.core.inference.contexts import StaticInferenceContext

__all__ = ["StaticInferenceContext"]
