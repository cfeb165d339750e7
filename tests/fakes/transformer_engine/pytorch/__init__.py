"""Fake ``transformer_engine.pytorch``: ``Linear`` in high precision, ``autocast`` / ``fp8_autocast``.

Nothing is quantized: ``Linear`` computes ``x W^T + b`` with the tensor-parallel communication
its ``parallel_mode`` implies (through ``megatron.core.tensor_parallel.mappings``), so a model
built on it must equal the local layers without FP8. What the adapter hands over is recorded in
``RECORD`` (the recipe and amax group of every autocast, the recipe each forward ran under).
Under a delayed recipe, ``fp8_meta`` holds real-shaped state: scales ``[3]`` / ``[2]`` and
histories ``[len, 3]`` / ``[len, 2]``; each forward writes the input's and weight's local amax into
the forward history's first row, so checkpoints have non-trivial state to carry.

Amax reduction as TE 2.9's ``FP8GlobalStateManager`` does it (``quantization.py``): a linear's first
delayed forward adds it to a global buffer keyed by (recipe, amax group); autocast contexts nest, and
only when the OUTERMOST one exits (enabled, not ``_graph``, grad enabled) is every buffer's first
history row concatenated and all-reduced (MAX) over its group: one collective per buffer key and
region, recorded as ``{"kind": "amax_reduction", ...}`` (``all_reduce`` False where the group has
one rank or the recipe says ``reduce_amax=False``, where TE skips the collective). Inner regions,
``enabled=False`` ones included, reduce nothing of their own. Backward likewise: each delayed
forward's output-gradient amax goes to the backward history's first row, and the first quantized
linear of an outermost region (the last to run backward) reduces the backward rows after its own
(``forward: False`` records).
"""

import contextlib
import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import mappings

RECORD: List[dict] = []
_ACTIVE: List[dict] = []  # the autocast regions entered, outermost first
# TE's global amax buffer: (str(recipe), group) -> (recipe, group, linears registered under it)
_AMAX_BUFFER: Dict[Tuple[str, Any], Tuple[Any, Any, List["Linear"]]] = {}
_FIRST_MODULE = [False]  # TE's IS_FIRST_FP8_MODULE: set entering an outermost region, taken by its first linear


@contextlib.contextmanager
def _quantizing(entry: dict, graph: bool):
    RECORD.append(entry)
    if not _ACTIVE:
        _FIRST_MODULE[0] = True
    _ACTIVE.append(entry)
    try:
        yield
    finally:
        _ACTIVE.pop()
        if entry["enabled"] and not _ACTIVE and not graph and torch.is_grad_enabled():
            _reduce_amaxes("scaling_fwd")  # TE's autocast_exit at depth 0


def _reduce_amaxes(meta_key: str) -> None:
    """TE's ``reduce_and_update_fp8_tensors``: one MAX all-reduce per buffer key of ``meta_key``'s rows."""
    for recipe, group, linears in _AMAX_BUFFER.values():
        rows = [m.fp8_meta[meta_key].amax_history[0] for m in linears]  # each [3] (forward) or [2]
        amaxes = torch.cat(rows)  # [n * len(linears)]
        collective = (
            recipe.reduce_amax and torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1
        )
        if collective:
            torch.distributed.all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX, group=group)
            for row, reduced in zip(rows, amaxes.split([r.numel() for r in rows])):
                row.copy_(reduced)
        RECORD.append(
            {
                "kind": "amax_reduction",
                "forward": meta_key == "scaling_fwd",
                "group": group,
                "linears": len(linears),
                "all_reduce": collective,
            }
        )


def autocast(
    enabled: bool = True,
    calibrating: bool = False,
    recipe=None,
    amax_reduction_group=None,
    _graph: bool = False,
):
    entry = {"kind": "autocast", "enabled": enabled, "recipe": recipe, "group": amax_reduction_group}
    return _quantizing(entry, _graph)


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe=None, fp8_group=None, _graph=False):
    """Older TE's name (deprecated in newer TE)."""
    return _quantizing({"kind": "fp8_autocast", "enabled": enabled, "recipe": fp8_recipe, "group": fp8_group}, _graph)


class _DelayedState:
    def __init__(self, n: int, history_len: int) -> None:
        self.scale = torch.ones(n)
        self.amax_history = torch.zeros(history_len, n)


class Linear(torch.nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        rng_tracker_name: Optional[str] = None,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        device="cuda",
    ) -> None:
        super().__init__()
        self.parallel_mode, self.sequence_parallel = parallel_mode, sequence_parallel
        self.tp_group, self.tp_size = tp_group, tp_size
        out_local = out_features // tp_size if parallel_mode == "column" else out_features
        in_local = in_features // tp_size if parallel_mode == "row" else in_features
        self.weight = torch.nn.Parameter(torch.empty(out_local, in_local, dtype=params_dtype, device=device))
        if init_method is not None:
            init_method(self.weight)
        self.use_bias, self.return_bias = bias, return_bias
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_local, dtype=params_dtype, device=device))
        else:
            self.bias = torch.Tensor().to(dtype=params_dtype, device=device)
        self.fp8_meta = {"fp8_checkpoint": False}
        self.fp8_meta_tensors_initialized = False

    def init_fp8_meta_tensors(self, recipe) -> None:
        for key, n in (("scaling_fwd", 3), ("scaling_bwd", 2)):
            self.fp8_meta[key] = _DelayedState(n, recipe.amax_history_len)
        self.fp8_meta_tensors_initialized = True

    def _record(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> Optional[bool]:
        """Record the forward; under delayed scaling write the local amaxes and return whether this
        linear is its region's first (it reduces the backward amaxes), else None."""
        recipe = _ACTIVE[-1]["recipe"] if _ACTIVE and _ACTIVE[-1]["enabled"] else None  # the innermost autocast
        RECORD.append({"kind": "forward", "recipe": recipe, "mode": self.parallel_mode, "first": is_first_microbatch})
        if recipe is None:
            return None
        first, _FIRST_MODULE[0] = _FIRST_MODULE[0], False
        if not recipe.delayed():
            return None
        if not self.fp8_meta_tensors_initialized:
            self.fp8_meta["num_gemms"] = 1
            self.init_fp8_meta_tensors(recipe)
        self.fp8_meta["recipe"] = recipe
        self._join_amax_buffer(recipe, _ACTIVE[-1]["group"])
        amaxes = torch.stack([x.detach().abs().max().float(), self.weight.detach().abs().max().float()])
        history = self.fp8_meta["scaling_fwd"].amax_history
        history[0, :2] = torch.maximum(history[0, :2], amaxes)  # local; reduced when the outermost region exits
        return first

    def _backward_amax(self, first: bool, grad: torch.Tensor) -> None:
        """Output-gradient amax into the backward history; the region's first linear then reduces them."""
        history = self.fp8_meta["scaling_bwd"].amax_history
        history[0, 0] = torch.maximum(history[0, 0], grad.detach().abs().max().float())
        if first:
            _reduce_amaxes("scaling_bwd")

    def _join_amax_buffer(self, recipe, group) -> None:
        """TE's ``add_fp8_tensors_to_global_buffer``: once per linear, under its first region's key."""
        if self.fp8_meta.get("in_amax_buffer"):
            return
        self.fp8_meta["in_amax_buffer"] = True
        _AMAX_BUFFER.setdefault((str(recipe), group), (recipe, group, []))[2].append(self)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        first = self._record(inp, is_first_microbatch)
        parallel = self.tp_size > 1
        if self.parallel_mode == "column" and parallel:
            if self.sequence_parallel:
                inp = mappings.gather_from_sequence_parallel_region(inp, True, self.tp_group)  # [s, b, h]
            else:
                inp = mappings.copy_to_tensor_model_parallel_region(inp, self.tp_group)
        bias = self.bias if self.use_bias else None
        fused_bias = bias if (self.parallel_mode != "row" and not self.return_bias) else None
        out = F.linear(inp, self.weight, fused_bias)
        if self.parallel_mode == "row" and parallel:
            if self.sequence_parallel:
                out = mappings.reduce_scatter_to_sequence_parallel_region(out, self.tp_group)  # [s/tp, b, o]
            else:
                out = mappings.reduce_from_tensor_model_parallel_region(out, self.tp_group)
        if self.parallel_mode == "row" and bias is not None and not self.return_bias:
            out = out + bias
        if first is not None and out.requires_grad:
            out.register_hook(functools.partial(self._backward_amax, first))
        if self.return_bias:
            return out, bias if bias is not None else self.bias
        return out
