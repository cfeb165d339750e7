"""Megatron-core's optimizer CPU offloading path: ``HybridDeviceOptimizer``."""

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

__all__ = ["HybridDeviceOptimizer"]
