"""The fake tensor mode of the dry run: GPU device rules, host syncs and stand-in values.

``DryRunMode`` is torch's ``FakeTensorMode`` (tensors have shapes, dtypes and devices but no
data; an op mixing ``cuda:0`` with a non-scalar CPU tensor raises exactly where a GPU
would) plus:

* host synchronisations: ``_local_scalar_dense`` (``.item()``, ``bool(t)``, ``float(t)``,
  ``int(t)``) and ``.tolist()`` (once) on a CUDA tensor, blocking copies between host and device
  (``.cpu()``, ``.to('cpu')``, ``torch.tensor(..., device='cuda')``, ``.cuda()`` without
  ``non_blocking``), and ops whose output shape depends on data (``nonzero``,
  ``masked_select``) are recorded with their source line;
* stand-in values: a value read on the host is the one the dry run can infer (constants,
  ``zeros``/``ones``/``full``, pointwise arithmetic of known values, copies), else a
  healthy one: ``isfinite`` -> True, ``isnan``/``isinf`` -> False, other bools False,
  integers 1, floats 1.0 (finite losses, no skipped step); ``nonzero`` returns half the
  elements;
* multi-tensor kernels (fused / foreach optimizer steps, AMP unscaling): every tensor list
  must be on the device of the first (a fused kernel reads each state tensor, ``step``
  included, on the GPU) and so must plain tensor arguments (found_inf, the scale); foreach
  ops allow CPU 0-dim tensors, as torch's slow path does, AMP kernels do not.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._pytree import tree_flatten

from tools.dry_run.fake_cuda import describe_tensor
from tools.dry_run.report import DeviceRuleError, Recorder

aten = torch.ops.aten
_GUESS = "_dry_run_value"
_PASSTHROUGH = {
    aten._to_copy,
    aten.clone,
    aten.detach,
    aten.alias,
    aten.view,
    aten._unsafe_view,
    aten.reshape,
    aten.expand,
    aten.select,
    aten.slice,
    aten.squeeze,
    aten.unsqueeze,
    aten.permute,
    aten.t,
    aten.transpose,
    aten.contiguous,
    aten.amax,
    aten.amin,
    aten.max,
    aten.min,
    aten.mean,
    aten.lift_fresh,
    aten.lift_fresh_copy,
    aten.view_as_real,
    aten.flatten,
    aten.index_select,
}
_FACTORIES = {aten.zeros: 0, aten.zeros_like: 0, aten.new_zeros: 0, aten.ones: 1, aten.ones_like: 1, aten.new_ones: 1}
_FILL_ARG = {aten.full: 1, aten.full_like: 1, aten.new_full: 2, aten.scalar_tensor: 0, aten.fill_: 1}
_HEALTHY_BOOL = {aten.isfinite: True, aten.isnan: False, aten.isinf: False, aten.isposinf: False, aten.isneginf: False}
# In-place writes whose healthy outcome is known: the AMP inf check leaves found_inf at 0.
_HEALTHY_WRITES = {aten._amp_foreach_non_finite_check_and_unscale_: {1: 0.0}}


def _guess_of(value: Any) -> Optional[Any]:
    """A known Python value for every element of ``value`` (a tensor or a number), else None."""
    if isinstance(value, (bool, int, float)):
        return value
    if not isinstance(value, torch.Tensor):
        return None
    if isinstance(value, FakeTensor):
        if value.constant is not None and value.constant.numel() == 1:
            return value.constant.item()
        return getattr(value, _GUESS, None)
    if value.numel() == 1 and value.device.type == "cpu":
        with unset_fake_temporarily():
            return value.item()
    return None


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return bool(value)
    if dtype.is_floating_point or dtype.is_complex:
        return float(value)
    return int(value)


def _set_guess(tensor: Any, value: Any) -> None:
    if isinstance(tensor, FakeTensor):
        setattr(tensor, _GUESS, None if value is None else _cast(value, tensor.dtype))


def _default_value(tensor: torch.Tensor) -> Any:
    return _cast(1 if tensor.dtype != torch.bool else 0, tensor.dtype)


def _pointwise_guess(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[Any]:
    """Run a pointwise op on 0-dim stand-ins when every tensor input has a known value."""
    flat, spec = tree_flatten((args, kwargs))
    tensors = [a for a in flat if isinstance(a, torch.Tensor)]
    if not tensors or any(_guess_of(t) is None for t in tensors):
        return None
    with unset_fake_temporarily():
        swapped = [torch.tensor(_guess_of(a), dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in flat]
        new_args, new_kwargs = spec.unflatten(swapped)
        new_kwargs = {k: v for k, v in new_kwargs.items() if k != "device"}
        try:
            out = func(*new_args, **new_kwargs)
        except Exception:  # noqa: BLE001 - a stand-in is optional; unknown values fall back to defaults
            return None
        return out.item() if isinstance(out, torch.Tensor) and out.numel() == 1 else None


@functools.cache
def _writes(func: Any) -> List[int]:
    """Positions of the arguments ``func`` writes in place."""
    return [i for i, arg in enumerate(func._schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write]


def _tensor_lists(args: Sequence[Any], kwargs: Dict[str, Any]) -> List[Sequence[torch.Tensor]]:
    values = list(args) + list(kwargs.values())
    return [v for v in values if isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v)]


def _list_rule(name: str, fused: bool) -> str:
    if name.startswith("_amp_"):
        return "torch's AMP kernels take every tensor (found_inf, the scale) on the GPU of the gradients"
    if fused:
        return "a fused optimizer kernel reads every tensor of every list (step counts included) on the GPU"
    return "a foreach kernel needs tensors of the same index on one device"


def check_list_devices(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> None:
    """Multi-tensor kernels (``_foreach_*``, ``_fused_*``, ``_amp_*``): lists elementwise on one device
    (foreach also allows CPU 0-dim tensors, as torch's slow path does); plain tensor arguments on the
    lists' device (a CPU 0-dim scalar allowed, except for the AMP kernels)."""
    name = func.overloadpacket.__name__
    lists = _tensor_lists(args, kwargs)
    plain = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    reference = lists[0][0] if lists else (plain[0] if plain else None)
    if reference is None:
        return
    fused, amp = name.startswith("_fused_"), name.startswith("_amp_")
    for k, other in enumerate(lists[1:], start=1):
        for i, (ref, tensor) in enumerate(zip(lists[0], other)):
            if tensor.device == ref.device or (not fused and tensor.device.type == "cpu" and tensor.dim() == 0):
                continue
            raise DeviceRuleError(
                f"torch.{name}: tensor {i} of list {k} is {describe_tensor(tensor)} while list 0 "
                f"holds {describe_tensor(ref)}: {_list_rule(name, fused)}"
            )
    for tensor in plain:
        if tensor.device != reference.device and (amp or not (tensor.device.type == "cpu" and tensor.dim() == 0)):
            raise DeviceRuleError(
                f"torch.{name}: a {describe_tensor(tensor)} argument with tensors on "
                f"{reference.device}: {_list_rule(name, fused)}"
            )


def check_generator_device(func: Any, kwargs: Dict[str, Any], out: Any) -> None:
    """A random op's ``generator`` must be on the device of the tensor it fills, as torch checks on a GPU."""
    generator = kwargs.get("generator")
    if generator is None or not isinstance(out, torch.Tensor) or generator.device.type == out.device.type:
        return
    raise DeviceRuleError(
        f"torch.{func.overloadpacket.__name__}: a generator on {generator.device} draws for a tensor on "
        f"{out.device}: a kernel takes a generator of its own device (torch.Generator(device=...))"
    )


def _stand_in_values(tensor: torch.Tensor) -> Any:
    """Nested lists (or a scalar) of the values the dry run assumes ``tensor`` holds."""
    value = _guess_of(tensor)
    value = _cast(value if value is not None else _default_value(tensor), tensor.dtype)
    nested: Any = value
    for size in reversed(tensor.shape):
        nested = [nested if not isinstance(nested, list) else list(nested) for _ in range(size)]
    return nested


def install_tensor_methods(patcher: Any, recorder: Recorder) -> None:
    """``tolist`` on a fake tensor: one host sync (one copy on a GPU), stand-in values;
    ``numpy`` refuses CUDA tensors, as torch does."""
    original_numpy = torch.Tensor.numpy

    def tolist(self: torch.Tensor) -> Any:
        if self.device.type == "cuda":
            recorder.add("sync", ".tolist()", {"tensor": describe_tensor(self)})
        return _stand_in_values(self)

    def numpy(self: torch.Tensor, *, force: bool = False) -> Any:
        if not isinstance(self, FakeTensor):
            return original_numpy(self, force=force)
        if self.device.type == "cuda":
            raise TypeError(
                f"can't convert {self.device} device type tensor to numpy: use Tensor.cpu() first "
                "(as torch says on a GPU)"
            )
        import numpy as np

        return np.array(_stand_in_values(self))

    patcher.set(FakeTensor, "tolist", tolist)
    patcher.set(torch.Tensor, "numpy", numpy)


class DryRunMode(FakeTensorMode):
    """FakeTensorMode with host-sync recording, stand-in values and optimizer-kernel device rules."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.recorder = recorder
        self._special: Dict[Any, Callable] = {
            aten._local_scalar_dense: self._scalar,
            aten.nonzero: self._nonzero,
            aten.masked_select: self._masked_select,
        }

    @property
    def avoid_device_init(self) -> bool:
        """Never run a real op on the GPU (no constant folding onto it): it exists only on paper."""
        return True

    def dispatch(self, func: Any, types: Sequence[type], args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        packet = func.overloadpacket
        special = self._special.get(packet)
        if special is not None:
            return special(func, types, args, kwargs)
        if packet.__name__.startswith(("_foreach_", "_fused_", "_amp_")):
            check_list_devices(func, args, kwargs)
        self._note_copy(packet, args, kwargs)
        out = super().dispatch(func, types, args, kwargs)
        check_generator_device(func, kwargs, out)
        self._track(func, packet, args, kwargs, out)
        return out

    # --- host synchronisations ----------------------------------------------------------
    def _sync(self, what: str, tensor: torch.Tensor) -> None:
        self.recorder.add("sync", what, {"tensor": describe_tensor(tensor)})

    def _scalar(self, func: Any, types: Sequence[type], args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        tensor = args[0]
        if not isinstance(tensor, FakeTensor):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if tensor.device.type == "cuda":
            self._sync(".item()/bool()/float()/int()", tensor)
        value = _guess_of(tensor)
        return _cast(value if value is not None else _default_value(tensor), tensor.dtype)

    def _note_copy(self, packet: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> None:
        if packet is aten._to_copy and isinstance(args[0], torch.Tensor) and kwargs.get("device") is not None:
            source, target = args[0].device, torch.device(kwargs["device"])
        elif packet is aten.copy_ and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            source, target = args[1].device, args[0].device
        else:
            return
        blocking = not kwargs.get("non_blocking", args[2] if packet is aten.copy_ and len(args) > 2 else False)
        copied = args[1] if packet is aten.copy_ else args[0]
        if source.type == "cuda" and target.type == "cpu":
            self._sync("device-to-host copy (.cpu())", copied)
        elif source.type == "cpu" and target.type == "cuda" and blocking:
            self._sync("blocking host-to-device copy", copied)

    def _empty(self, types: Sequence[type], shape: List[int], dtype: torch.dtype, device: torch.device) -> Any:
        return super().dispatch(aten.empty.memory_format, types, (shape,), {"dtype": dtype, "device": device})

    def _nonzero(self, func: Any, types: Sequence[type], args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        tensor = args[0]
        if tensor.device.type == "cuda":
            self._sync("nonzero (data-dependent shape)", tensor)
        return self._empty(types, [max(1, tensor.numel() // 2), tensor.dim()], torch.int64, tensor.device)

    def _masked_select(self, func: Any, types: Sequence[type], args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        tensor, mask = args[0], args[1]
        if tensor.device.type == "cuda":
            self._sync("masked_select (data-dependent shape)", tensor)
        numel = torch.broadcast_shapes(tensor.shape, mask.shape).numel()
        return self._empty(types, [max(1, numel // 2)], tensor.dtype, tensor.device)

    # --- stand-in values ----------------------------------------------------------------
    def _track(self, func: Any, packet: Any, args: Sequence[Any], kwargs: Dict[str, Any], out: Any) -> None:
        if func.namespace == "c10d":
            return  # collectives: this rank's values stand for every rank's (their results are not modelled)
        written = _writes(func)
        target = args[written[0]] if written and written[0] < len(args) else out
        healthy = _HEALTHY_WRITES.get(packet)
        if healthy is not None:
            for index, value in healthy.items():
                _set_guess(args[index] if index < len(args) else None, value)
            return
        if not isinstance(target, FakeTensor):
            for index in written:  # lists written in place (foreach, fused): values unknown now
                for tensor in args[index] if isinstance(args[index], (list, tuple)) else []:
                    _set_guess(tensor, None)
            return
        _set_guess(target, self._value_after(func, packet, args, kwargs, target))

    def _value_after(
        self, func: Any, packet: Any, args: Sequence[Any], kwargs: Dict[str, Any], target: torch.Tensor
    ) -> Optional[Any]:
        if packet in _FACTORIES:
            return _FACTORIES[packet]
        if packet in _FILL_ARG:
            return _guess_of(args[_FILL_ARG[packet]] if len(args) > _FILL_ARG[packet] else kwargs.get("fill_value"))
        if packet is aten.zero_:
            return 0
        if packet is aten.copy_:
            return _guess_of(args[1])
        if packet in _HEALTHY_BOOL:
            guess = _pointwise_guess(func, args, kwargs)
            return _HEALTHY_BOOL[packet] if guess is None else guess
        if packet in (aten.all, aten.any) or packet in _PASSTHROUGH:
            return _guess_of(args[0]) if args else None
        if torch.Tag.pointwise in func.tags:
            return _pointwise_guess(func, args, kwargs)
        return None
