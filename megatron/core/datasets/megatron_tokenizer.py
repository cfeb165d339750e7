"""Megatron-core's path of the legacy tokenizer interface (``MegatronLegacyTokenizer``).

Our tokenizers' abstract base, ``megatron.core.tokenizers.MegatronTokenizer``, is that interface.
"""

from megatron.core.tokenizers.base import MegatronTokenizer as MegatronLegacyTokenizer

__all__ = ["MegatronLegacyTokenizer"]
