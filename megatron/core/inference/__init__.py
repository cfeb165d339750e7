"""Text generation: the KV-cache inference context, sampling parameters and the static-batch engine."""

from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.sampling_params import SamplingParams

__all__ = ["SamplingParams", "StaticInferenceContext"]
