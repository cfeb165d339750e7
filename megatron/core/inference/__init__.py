"""Text generation: the KV-cache inference context, sampling parameters and the static-batch engine."""

from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.engine import GenerationResult, InferenceEngine
from megatron.core.inference.sampling_params import SamplingParams

__all__ = ["GenerationResult", "InferenceEngine", "SamplingParams", "StaticInferenceContext"]
