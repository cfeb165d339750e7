"""FP8 model weights (``--fp8-param-gather``): linear weights stored as FP8 bytes plus one scale.

A weight converted here is an ``nn.Parameter`` of dtype ``float8_e4m3fn`` (1 byte per element)
carrying ``fp8_meta`` (``FP8WeightMeta``: its quantizer, its fp32 ``scale_inv [1, 1]`` and the
high-precision dtype it replaced). The forward GEMM uses the bytes and the scale as they are
(no re-quantization); gradients go to the data-parallel buffer's ``main_grad`` in the
high-precision (or fp32) grad dtype; the distributed optimizer keeps fp32 main weights.

After each optimizer step every data-parallel rank casts its shard of the fp32 main weights
(``cast_shards``) with the scale of the *whole* weight, the same on every rank:

* ``tensorwise`` (current scaling): ``fp8_max / amax`` with the amax of the whole weight: the
  shards' amaxes reduced (MAX) over the data-parallel group, then over the quantizer's amax
  group (the linear's TP group, as the forward of the bf16 path reduces it);
* ``delayed``: the weight's ``DelayedScalingState``: its scale is first updated from the amax
  history (the amax the previous cast recorded), the cast uses it and records its own amax
  (reduced the same way) in ``amax_history[0]`` for the next update. A checkpoint thus holds the
  scale the last cast used, and recasting the saved main weights (``record=False``) gives the
  same bytes.

Checkpoints hold ``dequantize`` (the high-precision values), so runs without the flag load them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.quantization.fp8 import cast_to_fp8, current_scale, tensor_amax, update_delayed_scaling
from megatron.core.quantization.tensor import QuantizedTensor

WEIGHT_FORMAT = "e4m3"
PARAM_GATHER_RECIPES = ("tensorwise", "delayed")


@dataclass
class FP8WeightMeta:
    """What an FP8 weight parameter carries besides its bytes."""

    quantizer: torch.nn.Module  # the linear's LinearQuantizer (recipe, amax group, delayed state)
    scale_inv: torch.Tensor  # [1, 1] fp32: real = bytes * scale_inv
    hp_dtype: torch.dtype  # the dtype the weight had (checkpoints, gradients)
    # The high-precision tensor the last ``state_dict`` handed out (a sharded load fills it).
    checkpoint_values: Optional[torch.Tensor] = None


def is_fp8_param(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a weight stored as FP8 by ``to_fp8_param``."""
    return getattr(tensor, "fp8_meta", None) is not None


def fp8_operand(param: torch.Tensor) -> QuantizedTensor:
    """The FP8 weight as the GEMM operand ``[out, in]`` (its bytes, not a copy)."""
    rows, cols = param.shape
    return QuantizedTensor(param.detach(), param.fp8_meta.scale_inv, (max(rows, 1), max(cols, 1)))


def dequantize(param: torch.Tensor) -> torch.Tensor:
    """The weight's real values in its high-precision dtype ``[out, in]``, with the TP attributes."""
    values = fp8_operand(param).dequantize(param.fp8_meta.hp_dtype)
    for name in ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce", "is_expert"):
        if hasattr(param, name):
            setattr(values, name, getattr(param, name))
    return values


def _weight_state(quantizer):
    return quantizer.delayed["weight"] if quantizer.recipe.recipe == "delayed" else None


def _scale(quantizer, amax: torch.Tensor, record: bool) -> torch.Tensor:
    """The cast's scale ``[1]`` from the whole weight's ``amax [1]`` (module doc)."""
    state = _weight_state(quantizer)
    if state is None:
        return current_scale(amax, WEIGHT_FORMAT)
    if record:
        update_delayed_scaling(state.amax_history, state.scale, state.fmt, state.algo, state.margin)
        state.amax_history[0] = amax[0]
    return state.scale.clone()


def _reduce_amaxes(
    amaxes: torch.Tensor, dp_group: Optional[dist.ProcessGroup], quantizers: Sequence[torch.nn.Module]
) -> None:
    """MAX-reduce ``amaxes [n]`` in place over ``dp_group``, then each over its quantizer's amax group.

    One collective per group: entries sharing an amax group are reduced together, groups taken in
    order of first appearance (the same on every rank: same modules in the same order).
    """
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=dp_group)
    by_group: Dict[int, Tuple[dist.ProcessGroup, List[int]]] = {}
    for i, quantizer in enumerate(quantizers):
        group = quantizer.amax_group
        if group is not None and dist.get_world_size(group) > 1:
            by_group.setdefault(id(group), (group, []))[1].append(i)
    for group, indices in by_group.values():
        picked = amaxes[indices]  # [k]
        dist.all_reduce(picked, op=dist.ReduceOp.MAX, group=group)
        amaxes[indices] = picked


@torch.no_grad()
def cast_shards(
    shards: Sequence[Tuple[torch.nn.Parameter, Optional[torch.Tensor], Optional[Tuple[int, int]]]],
    dp_group: Optional[dist.ProcessGroup],
    record: bool = True,
) -> None:
    """Write each FP8 weight's shard from its fp32 main values, with the whole weight's scale.

    Args:
        shards: ``(param, main, (start, end))`` per FP8 weight of ``dp_group``'s buffers, in the same
            order on every rank; ``main`` is the fp32 values of ``param.view(-1)[start:end]`` (this
            rank's shard), or None (no element of ``param`` here: it still takes part and gets the
            scale).
        dp_group: the group the weights are sharded over (None: whole weights, no reduction).
        record: delayed scaling: update the scale and record this cast's amax (False when recasting
            restored main weights, which must give the bytes the checkpointed run had).
    """
    if not shards:
        return
    device = shards[0][0].device
    amaxes = torch.stack(
        [tensor_amax(main)[0] if main is not None else torch.zeros((), device=device) for _, main, _ in shards]
    ).float()  # [n]
    quantizers = [param.fp8_meta.quantizer for param, _, _ in shards]
    _reduce_amaxes(amaxes, dp_group, quantizers)
    for i, (param, main, flat_range) in enumerate(shards):
        scale = _scale(quantizers[i], amaxes[i : i + 1].to(device), record)  # [1]
        param.fp8_meta.scale_inv = scale.reciprocal().reshape(1, 1)
        if main is not None:
            data = cast_to_fp8(main.reshape(1, -1), scale, WEIGHT_FORMAT).data  # [1, end - start]
            param.detach().view(-1)[flat_range[0] : flat_range[1]].copy_(data.view(-1))


def check_param_gather_recipe(recipe: str) -> None:
    """The one rule on which recipes FP8 weights take (per-tensor scales only, for now).

    Raises:
        ValueError: naming ``fp8_recipe``, its value and the recipes allowed.
    """
    if recipe not in PARAM_GATHER_RECIPES:
        raise ValueError(
            f"fp8_param_gather=True with fp8_recipe={recipe!r}: not supported yet (only {PARAM_GATHER_RECIPES})"
        )


def to_fp8_param(weight: torch.nn.Parameter, quantizer: torch.nn.Module) -> torch.nn.Parameter:
    """A new FP8 parameter holding ``weight`` cast with its whole amax (``quantizer.amax_group``).

    Delayed scaling records that amax and updates the scale first, so the first cast is scaled by
    the weight itself rather than the initial scale 1. Attributes of ``weight`` are kept.
    """
    check_param_gather_recipe(quantizer.recipe.recipe)
    param = torch.nn.Parameter(
        torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device),
        requires_grad=weight.requires_grad,
    )
    param.__dict__.update({k: v for k, v in weight.__dict__.items() if k not in ("main_grad", "fp8_meta")})
    param.fp8_meta = FP8WeightMeta(quantizer, torch.ones(1, 1, device=weight.device), weight.dtype)
    main = weight.detach().float()
    state = _weight_state(quantizer)
    if state is not None:
        state.amax_history[0] = tensor_amax(main, quantizer.amax_group)[0]
        update_delayed_scaling(state.amax_history, state.scale, state.fmt, state.algo, state.margin)
    cast_shards([(param, main.view(-1), (0, main.numel()))], None)
    return param


@torch.no_grad()
def load_values(param: torch.nn.Parameter, values: torch.Tensor, delayed_scale: Optional[torch.Tensor] = None) -> None:
    """Set an FP8 weight from high-precision ``values [out, in]`` (a checkpoint's), nothing recorded.

    ``tensorwise``: scale from the amax of ``values`` (reduced over the amax group); ``delayed``: the
    state's scale, or ``delayed_scale`` (the checkpoint's, read before the state is loaded).
    """
    quantizer = param.fp8_meta.quantizer
    values = values.to(param.device).float()
    state = _weight_state(quantizer)
    if state is None:
        scale = current_scale(tensor_amax(values, quantizer.amax_group), WEIGHT_FORMAT)
    else:
        scale = (state.scale if delayed_scale is None else delayed_scale).to(param.device).float().clone()
    param.fp8_meta.scale_inv = scale.reciprocal().reshape(1, 1)
    param.detach().copy_(cast_to_fp8(values, scale, WEIGHT_FORMAT).data)
