"""State-space (Mamba-2) layers and the hybrid stack (Megatron-core's ``megatron.core.ssm``)."""
