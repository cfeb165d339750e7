"""Transformer Engine adapter: TE's ``Linear`` as the tensor-parallel linears, our recipes as TE's.

Transformer Engine (``transformer_engine``) is imported lazily, on first use, so the CPU install
never needs it; ``te_import_error()`` says whether it imports here (its core library needs CUDA).

* ``TEColumnParallelLinear`` / ``TERowParallelLinear`` (Megatron's names and keyword arguments)
  are ``te.pytorch.Linear`` with ``parallel_mode="column"`` / ``"row"`` over the layer's TP group.
  Their parameters are ``weight`` (``[o/tp, h]`` / ``[o, h/tp]``) and ``bias`` with our TP
  attributes and our initialization (the same seed gives the same weights as the local layers),
  so a checkpoint loads into either implementation. They are built lazily (module ``__getattr__``),
  as subclasses of the ``te.pytorch.Linear`` importable at that moment.
* ``te_recipe(config)``: the config's ``--fp8-recipe`` / ``--fp4-recipe`` as a TE recipe object:

  ==========  ============================================================================
  tensorwise  ``Float8CurrentScaling(fp8_format)``
  delayed     ``DelayedScaling(margin, fp8_format, amax_history_len, amax_compute_algo)``
  blockwise   ``Float8BlockScaling(fp8_format)``
  mxfp8       ``MXFP8BlockScaling(fp8_format)``
  nvfp4       ``NVFP4BlockScaling()``
  ==========  ============================================================================

  ``fp8_format``: ``Format.E4M3`` for ``--fp8-format e4m3``, ``Format.HYBRID`` for ``hybrid``.
  ``--no-fp8-wgrad`` needs a recipe field keeping wgrad in high precision (``DelayedScaling``'s
  ``override_linear_precision``, where the installed TE has it); otherwise it is refused.
* ``te_autocast(recipe, amax_group)``: TE's ``autocast`` (``fp8_autocast`` in older TE) with that
  recipe and amax-reduction group, entered once around a transformer block's layers, so delayed
  scaling's amaxes are all-reduced once per block forward (TE reduces when the outermost region
  exits); layers kept in high precision run in a nested ``enabled=False`` region (``fp8_utils``).
* FP8 state: TE keeps delayed scaling's scales and amax histories in ``fp8_meta`` and checkpoints
  them as a pickled byte tensor. Here ``_extra_state`` is a plain fp32 tensor instead: forward
  scales ``[3]``, forward histories ``[len, 3]``, backward scales ``[2]``, backward histories
  ``[len, 2]`` (TE's per-GEMM meta tensors: input, weight, output / grad output, grad input),
  flattened; its size is fixed by the config (empty unless the recipe is ``delayed``), so a
  distributed checkpoint can read into it. Loading never unpickles: any other tensor is refused.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, ContextManager, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.parallel_state import get_tensor_model_parallel_group_if_none
from megatron.core.quantization.recipes import recipe_from_config
from megatron.core.tensor_parallel.layers import (
    InitMethod,
    _home_device,
    init_weight_shard_,
    mark_column_bias,
    mark_row_bias,
    weight_rng_stream,
)

TE_PACKAGE = "transformer_engine"
TE_CLASS_NAMES = ("TEColumnParallelLinear", "TERowParallelLinear")
# TE's meta tensors of one GEMM: forward (input, weight, output), backward (grad output, grad input).
FP8_META_TENSORS = (("scaling_fwd", 3), ("scaling_bwd", 2))
_FP8_RECIPE_CLASSES = {
    "tensorwise": "Float8CurrentScaling",
    "blockwise": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
}
_BUILT: Dict[type, Dict[str, type]] = {}


def te_import_error() -> Optional[str]:
    """None when Transformer Engine's PyTorch API imports here, else why not (one line)."""
    try:
        importlib.import_module(f"{TE_PACKAGE}.pytorch")
        importlib.import_module(f"{TE_PACKAGE}.common.recipe")
    except (ImportError, OSError, RuntimeError) as err:  # not installed, or its CUDA library fails to load
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return None


def is_te_available() -> bool:
    """Whether ``transformer_engine.pytorch`` can be imported."""
    return te_import_error() is None


def is_te_linear(cls: Any, parallel_mode: str) -> bool:
    """Whether ``cls`` is the adapter's linear for ``parallel_mode`` ("column" / "row"); never imports TE."""
    return isinstance(cls, type) and getattr(cls, "te_parallel_mode", None) == parallel_mode


def _te_pytorch() -> Any:
    return importlib.import_module(f"{TE_PACKAGE}.pytorch")


def _te_recipes() -> Any:
    return importlib.import_module(f"{TE_PACKAGE}.common.recipe")


def te_recipe(config: ModelParallelConfig) -> Any:
    """The TE recipe object for the config's FP8/FP4 settings (module doc's table)."""
    quant = recipe_from_config(config)
    if quant is None:
        raise ValueError("te_recipe: the config has neither fp8 nor fp4 set")
    recipes = _te_recipes()
    if quant.recipe == "nvfp4":
        return recipes.NVFP4BlockScaling()
    fmt = recipes.Format.E4M3 if quant.fmt == "e4m3" else recipes.Format.HYBRID
    if quant.recipe == "delayed":
        return recipes.DelayedScaling(
            margin=quant.margin,
            fp8_format=fmt,
            amax_history_len=quant.amax_history_len,
            amax_compute_algo=quant.amax_compute_algo,
            **_high_precision_wgrad(recipes.DelayedScaling, quant.wgrad),
        )
    cls = getattr(recipes, _FP8_RECIPE_CLASSES[quant.recipe])
    _high_precision_wgrad(cls, quant.wgrad)
    return cls(fp8_format=fmt)


def _high_precision_wgrad(cls: type, wgrad: bool) -> Dict[str, Tuple[bool, bool, bool]]:
    """The recipe keyword for ``--no-fp8-wgrad`` (fprop, dgrad in FP8; wgrad not), or a refusal."""
    if wgrad:
        return {}
    if "override_linear_precision" not in {f.name for f in dataclasses.fields(cls)}:
        raise ValueError(
            f"fp8_wgrad=False: Transformer Engine's {cls.__name__} here has no "
            "override_linear_precision to keep weight gradients in high precision; use transformer_impl='local'"
        )
    return {"override_linear_precision": (False, False, True)}


def te_autocast(recipe: Any, amax_group: Optional[dist.ProcessGroup], enabled: bool = True) -> ContextManager:
    """TE's quantization autocast with ``recipe`` (``te_recipe(config)``), amaxes reduced over ``amax_group``
    when the outermost such region exits; ``enabled=False``: a high-precision region nested in one."""
    te = _te_pytorch()
    if hasattr(te, "autocast"):  # newer TE; fp8_autocast is its deprecated spelling
        return te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=amax_group)
    return te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=amax_group)


def fp8_state_size(config: ModelParallelConfig) -> int:
    """Elements of a TE linear's ``_extra_state``: scales and histories under delayed scaling, else 0."""
    quant = recipe_from_config(config)
    if quant is None or quant.recipe != "delayed":
        return 0
    return sum(n * (1 + quant.amax_history_len) for _, n in FP8_META_TENSORS)


def _initial_fp8_state(history_len: int) -> torch.Tensor:
    """The state before any FP8 step: scales 1, histories 0 (what TE initializes)."""
    parts = []
    for _, n in FP8_META_TENSORS:
        parts += [torch.ones(n), torch.zeros(history_len * n)]
    return torch.cat(parts)


def __getattr__(name: str) -> type:
    """``TEColumnParallelLinear`` / ``TERowParallelLinear``, built on the importable ``te.pytorch.Linear``."""
    if name not in TE_CLASS_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    base = _te_pytorch().Linear
    if base not in _BUILT:
        _BUILT[base] = _make_classes(base)
    return _BUILT[base][name]


def _make_classes(base: type) -> Dict[str, type]:
    """The adapter's linears as subclasses of ``base`` (``te.pytorch.Linear``)."""

    class TELinear(base):
        """``te.pytorch.Linear`` with our parameter layout, attributes, initialization and FP8 state format."""

        te_parallel_mode: Optional[str] = None
        # TE's weight caching: True for the step's first forward (cast the weight and keep it), False for the
        # later microbatches (reuse it), None outside a step (cast every call); see quantization/step.py.
        is_first_microbatch: Optional[bool] = None

        def __init__(
            self,
            input_size: int,
            output_size: int,
            *,
            config: ModelParallelConfig,
            init_method: InitMethod,
            bias: bool,
            skip_bias_add: bool,
            is_expert: bool,
            stride: int,
            tp_group: Optional[dist.ProcessGroup],
        ) -> None:
            if is_expert:
                raise NotImplementedError(
                    f"{type(self).__name__}(is_expert=True): not supported yet; MoE experts use the local linears"
                )
            group = get_tensor_model_parallel_group_if_none(tp_group)
            super().__init__(
                input_size,
                output_size,
                sequence_parallel=config.sequence_parallel,
                fuse_wgrad_accumulation=bool(config.gradient_accumulation_fusion),
                tp_group=group,
                tp_size=dist.get_world_size(group),
                init_method=_leave_to_adapter,
                bias=bias,
                return_bias=skip_bias_add,
                params_dtype=config.params_dtype,
                parallel_mode=self.te_parallel_mode,
                device=_home_device(),
            )
            self.config, self.tp_group, self.is_expert = config, group, is_expert
            self.input_size, self.output_size, self.skip_bias_add = input_size, output_size, skip_bias_add
            self.fp8_state_size = fp8_state_size(config)
            column = self.te_parallel_mode == "column"
            init_weight_shard_(
                self.weight, (output_size, input_size), 0 if column else 1, stride, init_method, config, group,
                weight_rng_stream(is_expert),
            )  # fmt: skip
            self.weight.allreduce = True
            if bias:
                mark_column_bias(self.bias, stride, False) if column else mark_row_bias(
                    self.bias, config.sequence_parallel, False
                )

        def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
            """``[s(/tp), b, h]`` -> (output, bias or None): ours and Megatron's return convention."""
            out = super().forward(input_, is_first_microbatch=self.is_first_microbatch)
            if self.is_first_microbatch:
                self.is_first_microbatch = False  # weights cannot change before the step ends
            if not self.skip_bias_add:
                return out, None
            out, bias = out  # TE hands the bias back for a later fused add
            return out, (bias if self.use_bias else None)

        def get_extra_state(self) -> torch.Tensor:
            """Delayed scaling's scales and histories as one flat fp32 tensor (module doc); empty without."""
            if self.fp8_state_size == 0:
                return torch.empty(0, dtype=torch.float32)
            meta = getattr(self, "fp8_meta", {})
            if not all(hasattr(meta.get(key), "amax_history") for key, _ in FP8_META_TENSORS):
                return _initial_fp8_state(self.config.fp8_amax_history_len)  # no FP8 step yet
            parts = []
            for key, _ in FP8_META_TENSORS:
                parts += [meta[key].scale, meta[key].amax_history]
            state = torch.cat([p.detach().float().reshape(-1).cpu() for p in parts])
            _check_state_size(self, state)
            return state

        def set_extra_state(self, state: Any) -> None:
            """Load what ``get_extra_state`` wrote; an empty tensor keeps the fresh state. Never unpickles."""
            if not isinstance(state, torch.Tensor) or state.dtype != torch.float32:
                what = f"a {state.dtype} tensor" if isinstance(state, torch.Tensor) else type(state).__name__
                raise ValueError(
                    f"{type(self).__name__}: _extra_state must be the flat fp32 tensor this adapter writes, got "
                    f"{what} (Transformer Engine's own format, a pickled byte tensor, is refused: unpickling runs code)"
                )
            if state.numel() == 0:
                return
            _check_state_size(self, state)
            recipe = te_recipe(self.config)
            self.fp8_meta["num_gemms"], self.fp8_meta["recipe"] = 1, recipe
            self.init_fp8_meta_tensors(recipe)
            offset = 0
            for key, _ in FP8_META_TENSORS:
                for target in (self.fp8_meta[key].scale, self.fp8_meta[key].amax_history):
                    with torch.no_grad():
                        target.copy_(state[offset : offset + target.numel()].view(target.shape))
                    offset += target.numel()

        def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
            """A checkpoint without ``_extra_state`` (saved without FP8 state, or by the local layers)
            loads as the empty state: weights only."""
            state_dict.setdefault(prefix + "_extra_state", torch.empty(0, dtype=torch.float32))
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    class TEColumnParallelLinear(TELinear):
        """Megatron's column-parallel TE linear: weight ``[o/tp, h]``; under SP the input is gathered."""

        te_parallel_mode = "column"

        def __init__(
            self,
            input_size: int,
            output_size: int,
            *,
            config: ModelParallelConfig,
            init_method: InitMethod,
            gather_output: bool = False,
            bias: bool = True,
            skip_bias_add: bool = False,
            is_expert: bool = False,
            skip_weight_param_allocation: bool = False,
            tp_comm_buffer_name: Optional[str] = None,
            tp_group: Optional[dist.ProcessGroup] = None,
            stride: int = 1,
        ) -> None:
            if gather_output or skip_weight_param_allocation:
                raise ValueError(
                    f"TEColumnParallelLinear: gather_output={gather_output}, skip_weight_param_allocation="
                    f"{skip_weight_param_allocation}: Transformer Engine's linear supports neither (both must be False)"
                )
            del tp_comm_buffer_name  # userbuffer overlap (GPU communicators): unused here
            super().__init__(
                input_size, output_size, config=config, init_method=init_method, bias=bias,
                skip_bias_add=skip_bias_add, is_expert=is_expert, stride=stride, tp_group=tp_group,
            )  # fmt: skip

    class TERowParallelLinear(TELinear):
        """Megatron's row-parallel TE linear: weight ``[o, h/tp]``; output all-reduced (reduce-scattered under SP)."""

        te_parallel_mode = "row"

        def __init__(
            self,
            input_size: int,
            output_size: int,
            *,
            config: ModelParallelConfig,
            init_method: InitMethod,
            bias: bool = True,
            input_is_parallel: bool = False,
            skip_bias_add: bool = False,
            is_expert: bool = False,
            tp_comm_buffer_name: Optional[str] = None,
            tp_group: Optional[dist.ProcessGroup] = None,
            stride: int = 1,
        ) -> None:
            if not input_is_parallel:
                raise ValueError(
                    "TERowParallelLinear: input_is_parallel=False is not supported (Transformer Engine's too)"
                )
            del tp_comm_buffer_name  # userbuffer overlap (GPU communicators): unused here
            super().__init__(
                input_size, output_size, config=config, init_method=init_method, bias=bias,
                skip_bias_add=skip_bias_add, is_expert=is_expert, stride=stride, tp_group=tp_group,
            )  # fmt: skip

    return {"TEColumnParallelLinear": TEColumnParallelLinear, "TERowParallelLinear": TERowParallelLinear}


def _leave_to_adapter(weight: torch.Tensor) -> None:
    """TE's ``init_method``: nothing; the adapter initializes the shard itself (``init_weight_shard_``)."""


def _check_state_size(module: torch.nn.Module, state: torch.Tensor) -> None:
    if state.numel() != module.fp8_state_size:
        raise ValueError(
            f"{type(module).__name__}: FP8 state has {state.numel()} values, this config expects "
            f"{module.fp8_state_size} (saved with another TransformerConfig.fp8_recipe or "
            "TransformerConfig.fp8_amax_history_len?)"
        )
