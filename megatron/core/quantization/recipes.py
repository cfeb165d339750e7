"""Recipes: how each operand of a linear layer's three GEMMs is quantized.

A linear ``Y = X W^T`` runs three GEMMs: forward ``X W^T``, input gradient ``dY W`` and weight
gradient ``dY^T X``. Its operands are quantized by role: ``input`` (X), ``weight`` (W) and
``grad_output`` (dY). ``--fp8-format`` picks the formats (``e4m3``: all e4m3; ``hybrid``:
e4m3 forward, e5m2 for ``grad_output``); ``--fp8-recipe`` picks the scales:

=============  ========================================================================
tensorwise     per-tensor current scaling (``fp8.quantize_current``), amax reduced over TP
delayed        per-tensor delayed scaling (``fp8.DelayedScalingState`` per role), amax
               reduced over the amax group (TP x DP x CP, as Megatron's default)
blockwise      1x128 blocks for activations and gradients, 128x128 for weights
mxfp8          32-element blocks with e8m0 (power-of-two) scales
nvfp4          (``--fp4-format e2m1``) 16-element e2m1 blocks, e4m3 block scales x fp32
=============  ========================================================================

Per-tensor operands are quantized once and transposed exactly for the backward GEMMs; block
recipes quantize each GEMM's operands along that GEMM's inner dimension.

Weights are quantized once per step inside a weight cache (``start_weight_cache``, opened by the
schedules through ``quantization.step.quantized_step``), as Transformer Engine's
``is_first_microbatch`` caching does: the weight does not change between the microbatches of one
step. An entry is reused while the parameter is the same storage at the same ``_version``; the
cache is dropped when the step ends (the optimizer then writes the weights, through ``.data``, which
``_version`` does not see) and by ``invalidate_weight_cache`` (Megatron's ``set_is_first_microbatch``).
Under delayed scaling a weight's amax is then recorded once per step, as in TE, where the cached
microbatches skip the weight's cast and amax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.quantization.block_recipes import BLOCK_RECIPES, BlockOperandQuantizer
from megatron.core.quantization.fp8 import DelayedScalingState, quantize_current
from megatron.core.quantization.tensor import QuantizedTensor

ROLES = ("input", "weight", "grad_output")
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
PER_TENSOR_RECIPES = ("tensorwise", "delayed")
FP4_RECIPES = ("nvfp4",)
FP4_FORMATS = ("e2m1",)


@dataclass(frozen=True)
class QuantRecipe:
    """What a linear layer needs to know to quantize its GEMM operands (from ``TransformerConfig``)."""

    recipe: str
    fmt: str = "hybrid"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True

    @property
    def per_tensor(self) -> bool:
        """One scale per operand: quantized once, transposed for backward."""
        return self.recipe in PER_TENSOR_RECIPES

    def format_of(self, role: str) -> str:
        """The element format of ``role``'s operand: e5m2 only for gradients under ``hybrid``."""
        if self.recipe == "nvfp4":
            return "e2m1"
        return "e5m2" if (self.fmt == "hybrid" and role == "grad_output") else "e4m3"


def recipe_from_config(config) -> Optional[QuantRecipe]:
    """The config's recipe (``fp4`` wins over ``fp8``), or None in high precision."""
    if getattr(config, "fp4", None):
        return QuantRecipe(config.fp4_recipe, "e2m1")
    if not getattr(config, "fp8", None):
        return None
    return QuantRecipe(
        config.fp8_recipe,
        config.fp8,
        config.fp8_margin,
        config.fp8_amax_history_len,
        config.fp8_amax_compute_algo,
        config.fp8_wgrad,
    )


class LinearQuantizer(torch.nn.Module):
    """Quantizes one linear layer's GEMM operands by role, following ``recipe``.

    ``amax_group`` is the process group the per-tensor amax is reduced over: every rank of it
    holding part of (or a replica of) the same operand then uses one scale. Delayed scaling
    keeps one ``DelayedScalingState`` per role, a submodule, so it is in the ``state_dict``.
    """

    def __init__(self, recipe: QuantRecipe, amax_group: Optional[dist.ProcessGroup], seed: int = 0) -> None:
        super().__init__()
        self.recipe, self.amax_group = recipe, amax_group
        self.per_tensor = recipe.per_tensor
        if recipe.recipe == "delayed":
            self.delayed = torch.nn.ModuleDict(
                {
                    role: DelayedScalingState(
                        recipe.format_of(role), recipe.amax_history_len, recipe.amax_compute_algo, recipe.margin
                    )
                    for role in ROLES
                }
            )
        elif recipe.recipe not in PER_TENSOR_RECIPES + BLOCK_RECIPES:
            raise ValueError(f"fp8_recipe={recipe.recipe!r}: must be one of {FP8_RECIPES} (fp4_recipe: {FP4_RECIPES})")
        elif not recipe.per_tensor:
            self._block = BlockOperandQuantizer(recipe.recipe, amax_group, seed)
        self._weight_cache: Optional[Dict[str, Tuple[tuple, QuantizedTensor]]] = None  # None: no caching

    def quantize(self, role: str, x: torch.Tensor, gemm: str = "fprop", phase: Optional[str] = None) -> QuantizedTensor:
        """Quantize ``role``'s 2-D operand ``x [rows, k]`` for ``gemm`` (blocks, if any, along ``k``).

        ``phase``: ``"checkpointed"`` / ``"recompute"`` inside activation recomputation (delayed
        scaling then reuses the first forward's scales and records nothing the second time).
        """
        fmt = self.recipe.format_of(role)
        if self.recipe.recipe == "delayed":
            return self.delayed[role].quantize(x, self.amax_group, phase)
        if self.recipe.recipe == "tensorwise":
            return quantize_current(x, fmt, self.amax_group)
        return self._block(x, role, gemm, fmt)

    def quantize_weight(
        self, weight: torch.Tensor, gemm: str = "fprop", phase: Optional[str] = None
    ) -> QuantizedTensor:
        """The weight ``[o, h]`` quantized for ``gemm``: as is for ``fprop``, transposed (``[h, o]``)
        for ``dgrad``; from the weight cache while it is open (module doc).

        A cached weight is quantized outside the recompute phases: it is recorded once, and the
        recompute of a checkpointed forward finds the same cached tensor.
        """
        operand = (lambda: weight) if gemm == "fprop" else (lambda: weight.t().contiguous())
        if self._weight_cache is None:
            return self.quantize("weight", operand(), gemm, phase)
        key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype)
        hit = self._weight_cache.get(gemm)
        if hit is not None and hit[0] == key:
            return hit[1]
        q = self.quantize("weight", operand(), gemm)
        self._weight_cache[gemm] = (key, q)
        return q

    def start_weight_cache(self) -> None:
        """Quantize each weight once until ``stop_weight_cache`` (the schedules' step)."""
        self._weight_cache = {}

    def invalidate_weight_cache(self) -> None:
        """Forget the cached weights (they are quantized again at their next use), keeping caching on."""
        if self._weight_cache is not None:
            self._weight_cache = {}

    def stop_weight_cache(self) -> None:
        """Drop the cached weights and quantize on every use again."""
        self._weight_cache = None

    def extra_repr(self) -> str:
        r = self.recipe
        return f"recipe={r.recipe}, format={r.fmt}, wgrad={'fp8' if r.wgrad else 'high precision'}"
