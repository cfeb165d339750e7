"""Attention variants beyond standard and multi-latent attention (Megatron-core's package name)."""
