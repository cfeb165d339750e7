"""Mixture of experts: top-k and hash routers, sequential experts, the MoE layer and its auxiliary losses."""

from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.hash_router import HashRouter
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import (
    AuxLossTracker,
    MoEAuxLossAutoScaler,
    aux_loss_pairs,
    get_aux_loss_tracker,
    use_aux_loss_tracker,
)
from megatron.core.transformer.moe.router import TopKRouter

__all__ = [
    "AuxLossTracker",
    "GroupedMLP",
    "HashRouter",
    "MoEAuxLossAutoScaler",
    "MoELayer",
    "MoESubmodules",
    "SequentialMLP",
    "TopKRouter",
    "get_aux_loss_tracker",
    "aux_loss_pairs",
    "use_aux_loss_tracker",
]
