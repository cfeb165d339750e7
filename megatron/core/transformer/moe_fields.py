"""TransformerConfig's mixture-of-experts fields and their rules (a base class of ``TransformerConfig``).

The fields keep Megatron-core's names on ``TransformerConfig``; the rules run from its ``__post_init__``
(``_check_moe``) and read the fields of the whole config (widths, parallel sizes, ``num_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Union

from megatron.core.model_parallel_config import require_divisible, require_positive
from megatron.core.transformer import moe_choices


def check_moe_training_layout(
    num_moe_experts: Optional[int], tensor_model_parallel_size: int, sequence_parallel: bool
) -> None:
    """Megatron's rule for training MoE: under tensor parallelism each TP rank routes its own sequence shard,
    so TP > 1 needs sequence parallelism. Inference may run the layout (every TP rank routes all tokens), so the
    rule is checked by the training entry points at start-up and by ``MoELayer`` in training mode, not by the config."""
    if num_moe_experts is not None and tensor_model_parallel_size > 1 and not sequence_parallel:
        raise ValueError(
            f"num_moe_experts={num_moe_experts} with tensor_model_parallel_size={tensor_model_parallel_size} "
            "needs sequence_parallel=True to train (each TP rank routes its own sequence shard; Megatron refuses "
            "MoE with TP > 1 and no sequence parallelism in training, and allows it for inference)"
        )


@dataclass
class MoEFields:
    """Mixture-of-experts fields of ``TransformerConfig`` (validated by the whole config, never alone)."""

    # Mixture of experts (experts split over EP and expert-TP = TP; see moe/moe_layer.py).
    num_moe_experts: Optional[int] = None
    """Experts per MoE layer (--num-experts); None: dense MLPs."""
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    """Each expert's MLP width; default ffn_hidden_size."""
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_router_pre_softmax: bool = False
    """True: softmax over all experts, then top-k. False: top-k logits, softmax over those k."""
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_score_function: str = "softmax"
    """'softmax' or 'sigmoid' (top-k sigmoid scores renormalised); see moe/routing.py."""
    moe_router_num_groups: Optional[int] = None
    """Group-limited routing: experts in this many equal groups (with moe_router_group_topk)."""
    moe_router_group_topk: Optional[int] = None
    """Groups each token may route into: those with the largest sums of their topk/group_topk best scores."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias (sigmoid routing only) picks the experts, updated each step."""
    moe_router_bias_update_rate: float = 1e-3
    """How far each step moves the expert bias (sign of mean count minus the expert's count)."""
    moe_hash_router_vocab_size: Optional[int] = None
    """Token ids covered by a HashRouter's frozen token -> experts table (DeepSeek-V4 hash_moe); None: none."""
    moe_router_dtype: Optional[str] = None
    """'fp32' or 'fp64': router logits and routing computed in that dtype; None: the model's."""
    moe_router_force_load_balancing: bool = False
    """Benchmarking only: route on random logits (balanced on average), gradient straight through."""
    moe_input_jitter_eps: Optional[float] = None
    """Multiply router inputs by noise uniform in [1 - eps, 1 + eps] (in eval too, as Megatron does)."""
    moe_token_dispatcher_type: str = "allgather"
    """'allgather' or 'alltoall': the same computation here (tokens all-gathered over EP)."""
    moe_layer_freq: Union[int, List[int]] = 1
    """N: layers 0, N, 2N... (0-based) are MoE; or one 0/1 entry per layer."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of the shared experts' MLP (all shared experts as one), run on every token; None: none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(x . w), a learned [1, h] gate (Qwen2-MoE)."""
    moe_shared_expert_overlap: bool = False
    """Overlap the shared experts with dispatch on GPU streams; the same result (sequential here)."""
    moe_expert_capacity_factor: Optional[float] = None
    """Each expert keeps at most ceil(T * topk / E * factor) of a rank's T routed tokens; None (or < 0): dropless."""
    moe_token_drop_policy: str = "probs"
    """Which pairs an expert keeps: 'probs' (largest routing probs) or 'position' (earliest tokens)."""
    moe_pad_expert_input_to_capacity: bool = False
    """Pad each expert's tokens to its capacity with weight-0 tokens: the same result, fixed shapes."""
    moe_grouped_gemm: bool = False
    """Run the local experts as one grouped GEMM per projection (torch._grouped_mm), else a loop."""

    def _check_moe(self) -> None:
        if self.num_moe_experts is None:
            return
        require_positive("num_moe_experts", self.num_moe_experts)
        require_positive("moe_router_topk", self.moe_router_topk)
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(
                f"moe_router_topk={self.moe_router_topk} must be <= num_moe_experts={self.num_moe_experts}"
            )
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        require_positive("moe_ffn_hidden_size", self.moe_ffn_hidden_size)
        require_divisible(
            "moe_ffn_hidden_size",
            self.moe_ffn_hidden_size,
            "expert_tensor_parallel_size",
            self.expert_tensor_parallel_size,
        )
        choices = {
            "moe_router_load_balancing_type": moe_choices.BALANCE_TYPES,
            "moe_token_dispatcher_type": moe_choices.DISPATCHER_TYPES,
            "moe_router_score_function": moe_choices.SCORE_FUNCTIONS,
            "moe_router_dtype": moe_choices.ROUTER_DTYPES,
            "moe_token_drop_policy": moe_choices.DROP_POLICIES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be one of {allowed}")
        self._check_sinkhorn()
        if self.moe_aux_loss_coeff < 0 or (self.moe_z_loss_coeff is not None and self.moe_z_loss_coeff < 0):
            raise ValueError(
                f"moe_aux_loss_coeff={self.moe_aux_loss_coeff}, moe_z_loss_coeff="
                f"{self.moe_z_loss_coeff}: coefficients must be >= 0"
            )
        factor = self.moe_router_topk_scaling_factor
        if factor is not None and factor <= 0:
            raise ValueError(f"moe_router_topk_scaling_factor={factor}: must be > 0")
        self._check_router()
        self._check_capacity()
        self._check_shared_experts()
        require_divisible(
            "num_moe_experts", self.num_moe_experts, "expert_model_parallel_size", self.expert_model_parallel_size
        )
        self._check_moe_layer_freq()

    def _check_sinkhorn(self) -> None:
        """Sinkhorn routing picks experts itself: the settings of the other routers would be ignored."""
        if self.moe_router_load_balancing_type != "sinkhorn":
            return
        ignored = {
            "moe_aux_loss_coeff": (self.moe_aux_loss_coeff, 0.0),
            "moe_router_enable_expert_bias": (self.moe_router_enable_expert_bias, False),
            "moe_router_num_groups": (self.moe_router_num_groups, None),
            "moe_router_topk_scaling_factor": (self.moe_router_topk_scaling_factor, None),
            "moe_router_pre_softmax": (self.moe_router_pre_softmax, False),
            "moe_router_score_function": (self.moe_router_score_function, "softmax"),
        }
        for name, (value, default) in ignored.items():
            if value != default:
                raise ValueError(
                    f"{name}={value!r} does not apply with moe_router_load_balancing_type='sinkhorn' "
                    f"(Sinkhorn routing has no auxiliary loss and its own scores); leave it at {default!r}"
                )

    def _check_router(self) -> None:
        if self.moe_hash_router_vocab_size is not None:
            require_positive("moe_hash_router_vocab_size", self.moe_hash_router_vocab_size)
        eps = self.moe_input_jitter_eps
        if eps is not None and not 0 < eps < 1:
            raise ValueError(f"moe_input_jitter_eps={eps}: must be in (0, 1)")
        if (self.moe_router_num_groups is None) != (self.moe_router_group_topk is None):
            raise ValueError(
                f"moe_router_num_groups={self.moe_router_num_groups}, moe_router_group_topk="
                f"{self.moe_router_group_topk}: group-limited routing needs both"
            )
        if self.moe_router_group_topk is None:
            return
        groups, picked, k = self.moe_router_num_groups, self.moe_router_group_topk, self.moe_router_topk
        require_positive("moe_router_num_groups", groups)
        require_positive("moe_router_group_topk", picked)
        require_divisible("num_moe_experts", self.num_moe_experts, "moe_router_num_groups", groups)
        require_divisible("moe_router_topk", k, "moe_router_group_topk", picked)
        if picked > groups or k > picked * (self.num_moe_experts // groups):
            raise ValueError(
                f"moe_router_group_topk={picked}, moe_router_num_groups={groups}, moe_router_topk={k}: "
                "need group_topk <= num_groups and topk <= group_topk * experts per group"
            )

    def _check_capacity(self) -> None:
        factor = self.moe_expert_capacity_factor
        if factor is not None and factor < 0:
            self.moe_expert_capacity_factor = factor = None  # Megatron: a negative factor means dropless
        if factor == 0:
            raise ValueError("moe_expert_capacity_factor=0: must be > 0 (or negative / None for dropless)")

    def _check_shared_experts(self) -> None:
        size = self.moe_shared_expert_intermediate_size
        if size is None:
            return
        require_positive("moe_shared_expert_intermediate_size", size)
        require_divisible(
            "moe_shared_expert_intermediate_size", size, "tensor_model_parallel_size", self.tensor_model_parallel_size
        )

    def _check_moe_layer_freq(self) -> None:
        freq = self.moe_layer_freq
        if isinstance(freq, int) and not isinstance(freq, bool):
            require_positive("moe_layer_freq", freq)
            return
        pattern = list(freq)
        if len(pattern) != self.num_layers or any(p not in (0, 1) for p in pattern):
            raise ValueError(
                f"moe_layer_freq={freq!r}: a list needs one 0/1 entry per layer (num_layers={self.num_layers})"
            )
        self.moe_layer_freq = pattern

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether the global 1-based ``layer_number`` holds a MoE layer (``moe_layer_freq``)."""
        if self.num_moe_experts is None:
            return False
        if isinstance(self.moe_layer_freq, int):
            return (layer_number - 1) % self.moe_layer_freq == 0
        return bool(self.moe_layer_freq[layer_number - 1])
