"""The values the MoE string settings of ``TransformerConfig`` accept, written once.

Read by the config's checks, the routing functions, the token dispatchers, the aux-loss logging
and the flag records (``megatron/training/flags/moe.py``). A module of constants with no imports,
outside the ``moe`` package so that ``TransformerConfig`` can read it without a cycle.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

# moe_router_score_function: how logits become routing scores. Megatron-LM 0.16's table lists softmax and
# sigmoid; "sqrtsoftplus" (sqrt(softplus(logits)), DeepSeek-V4's router) is this project's extension, the
# parser's choices come from here (megatron/training/flags/moe.py).
SCORE_FUNCTIONS: Tuple[str, ...] = ("softmax", "sigmoid", "sqrtsoftplus")
# moe_token_drop_policy: which tokens an expert over capacity keeps.
DROP_POLICIES: Tuple[str, ...] = ("probs", "position")
# moe_token_dispatcher_type: how tokens reach their experts (the same result; Megatron's 'flex' is GPU-only).
DISPATCHER_TYPES: Tuple[str, ...] = ("allgather", "alltoall")
# moe_router_dtype: the router's computation dtype (None: the model's).
ROUTER_DTYPES: Tuple[Optional[str], ...] = (None, "fp32", "fp64")
# moe_router_load_balancing_type -> the name its loss is tracked and logged under (Megatron's); "sinkhorn"
# balances by Sinkhorn-Knopp routing instead of a loss; "none": no loss.
BALANCE_LOSS_NAMES: Dict[str, str] = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}
BALANCE_TYPES: Tuple[str, ...] = (*BALANCE_LOSS_NAMES, "sinkhorn", "none")
