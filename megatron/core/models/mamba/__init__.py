"""Hybrid Mamba language models (Megatron-core's ``megatron.core.models.mamba``)."""

from megatron.core.models.mamba.mamba_model import MambaModel

__all__ = ["MambaModel"]
