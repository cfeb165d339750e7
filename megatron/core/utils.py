"""Small helpers shared across the core library."""

from __future__ import annotations

import importlib.metadata
import warnings
from typing import Callable, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist
from packaging.version import Version as PkgVersion

from megatron.core.safe_globals import register_safe_globals

register_safe_globals()  # upstream registers on ``import megatron.core``; most torch-using core modules import this

WrapperTypes = Union[Type[torch.nn.Module], Tuple[Type[torch.nn.Module], ...]]


def comm_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where a tensor must live to travel over ``group``: this rank's GPU for NCCL, else the CPU.

    Scalars that steer control flow (flags, norms, counts) are created on the CPU; NCCL only
    moves device tensors, gloo only host tensors, so collectives on them go through here.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_into_tensor(
    output: torch.Tensor, input_: torch.Tensor, group: Optional[dist.ProcessGroup] = None, async_op: bool = False
):
    """Gather equal pieces into one tensor (``all_gather_single`` where torch has it, else its older name)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input_, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output: torch.Tensor, input_: torch.Tensor, group: Optional[dist.ProcessGroup] = None, async_op: bool = False
):
    """Sum over ranks and keep this rank's equal piece (``reduce_scatter_single`` where torch has it)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input_, group=group, async_op=async_op)


def _is_wrapper(module: torch.nn.Module, module_instances: Optional[WrapperTypes]) -> bool:
    if module_instances is not None:
        return isinstance(module, module_instances)
    torch_ddp = torch.nn.parallel.DistributedDataParallel
    return bool(getattr(module, "is_ddp_wrapper", False)) or isinstance(module, torch_ddp)


def unwrap_model(
    model: Union[torch.nn.Module, List[torch.nn.Module]], module_instances: Optional[WrapperTypes] = None
) -> Union[torch.nn.Module, List[torch.nn.Module]]:
    """The model inside its wrappers (``wrapper.module.module...``); a list of chunks gives a list.

    Megatron-core's signature. ``module_instances``: the wrapper classes to look through (a class or a
    tuple, as ``isinstance`` takes them). By default: our ``DistributedDataParallel`` (any module whose
    class sets ``is_ddp_wrapper``) and torch's; nothing else is stripped, so a model that itself
    holds a ``.module`` is returned as it is.
    """
    if isinstance(model, list):
        return [unwrap_model(chunk, module_instances) for chunk in model]
    while _is_wrapper(model, module_instances):
        model = model.module
    return model


def named_model_params(model_chunks: Sequence[torch.nn.Module]) -> List[Tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every chunk: the one naming of parameters in checkpoints and optimizer state.

    Names are the unwrapped chunk's ``named_parameters()``, prefixed ``chunk{i}.`` when there are
    several chunks (virtual pipeline); a parameter shared inside a chunk is listed once.
    """
    named = []
    for i, chunk in enumerate(model_chunks):
        prefix = f"chunk{i}." if len(model_chunks) > 1 else ""
        named += [(prefix + name, param) for name, param in unwrap_model(chunk).named_parameters()]
    return named


def refuse_unimplemented(where: str, **settings: Tuple[object, object]) -> None:
    """Raise ``NotImplementedError`` naming each argument given as ``name=(value, only implemented value)``
    whose value is not the implemented one: accepted for Megatron's signature, never silently ignored."""
    named = [f"{name}={value!r}" for name, (value, implemented) in settings.items() if value != implemented]
    if named:
        raise NotImplementedError(f"{where}: not supported yet: {', '.join(named)}")


def apply_keeping_fp32(module: torch.nn.Module, fn, recurse: bool, names: Sequence[str]) -> torch.nn.Module:
    """``Module._apply`` under which the buffers ``names`` follow the module's moves but never its dtype casts.

    State that must stay fp32 in a bf16/fp16 model (amax histories, the router's expert bias) keeps
    its exact values: a cast applied to it is replaced by the pre-cast tensor on the new device.
    """
    saved = {name: module._buffers[name] for name in names if module._buffers.get(name) is not None}
    torch.nn.Module._apply(module, fn, recurse)
    for name, before in saved.items():
        after = module._buffers[name]
        if after.dtype != before.dtype:
            module._buffers[name] = before.to(after.device)
    return module


# ----------------------------------------------------------------------------------
# Megatron-core's version checks, experimental gate and default-group helper.
# ----------------------------------------------------------------------------------
def get_torch_version() -> PkgVersion:
    """The installed torch version."""
    return PkgVersion(torch.__version__)


def _at_least(installed: PkgVersion, version: str, check_equality: bool) -> bool:
    wanted = PkgVersion(version)
    return installed >= wanted if check_equality else installed > wanted


def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether torch is at least ``version`` (strictly newer with ``check_equality=False``)."""
    return _at_least(get_torch_version(), version, check_equality)


def get_te_version() -> Optional[PkgVersion]:
    """The installed Transformer Engine version, or None when it is not installed."""
    try:
        import transformer_engine as te
    except ImportError:
        return None
    found = getattr(te, "__version__", None)
    return PkgVersion(str(found) if found is not None else importlib.metadata.version("transformer-engine"))


def is_te_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether Transformer Engine is at least ``version``; False when it is not installed (upstream raises)."""
    installed = get_te_version()
    return installed is not None and _at_least(installed, version, check_equality)


class ExperimentalNotEnabledError(Exception):
    """Experimental code used while ``megatron.core.config`` has experimental features off."""


def _require_experimental(name: str) -> None:
    from megatron.core import config

    if config.is_experimental_enabled() is not True:
        raise ExperimentalNotEnabledError(
            f"{name} is experimental: call megatron.core.config.set_experimental_flag(True)"
        )


def experimental_cls(introduced_with_version: str) -> Callable[[type], type]:
    """Class decorator: the class and its instances work only while experimental features are on.

    Creating an instance, or reading any attribute of the class or of an instance, raises
    ``ExperimentalNotEnabledError`` while they are off; ``is_experimental`` always answers with
    the switch. ``introduced_with_version`` is recorded (we have no end-of-life check).
    """

    def decorate(cls: type) -> type:
        def guard(attr: str, read: Callable[[], object]) -> object:
            from megatron.core import config

            if attr == "is_experimental":
                return config.is_experimental_enabled()
            _require_experimental(cls.__name__)
            return read()

        class Gate(type(cls)):
            def __call__(self, *args, **kwargs):
                _require_experimental(cls.__name__)
                return super().__call__(*args, **kwargs)

            def __getattribute__(self, attr: str) -> object:
                return guard(attr, lambda: super(Gate, self).__getattribute__(attr))

        def instance_getattribute(self, attr: str) -> object:
            return guard(attr, lambda: super(gated, self).__getattribute__(attr))

        namespace = {"__getattribute__": instance_getattribute, "__doc__": cls.__doc__, "__module__": cls.__module__}
        namespace.update(__qualname__=cls.__qualname__, introduced_with_version=introduced_with_version)
        gated = Gate(cls.__name__, (cls,), namespace)
        return gated

    return decorate


def get_tensor_model_parallel_group_if_none(
    tp_group: Optional[dist.ProcessGroup], is_expert: bool = False, check_initialized: bool = True
) -> Optional[dist.ProcessGroup]:
    """``tp_group``, or the default (expert-)TP group with a DeprecationWarning (Megatron-core's rules).

    None without torch.distributed; ``tp_group`` as given while no default groups exist.
    """
    from megatron.core import process_groups

    del check_initialized  # without default groups the argument passes through, as upstream
    if not dist.is_initialized():
        return None
    if tp_group is not None or not process_groups.has_default_process_groups():
        return tp_group
    if dist.get_rank() == 0:
        warnings.warn("tp_group is None: using the default TP group; pass tp_group", DeprecationWarning, stacklevel=2)
    return process_groups.get_tensor_model_parallel_group_if_none(None, is_expert)


def dtensor_rows(param: torch.Tensor) -> Tuple[int, int]:
    """(first row, rows) of this rank's dim-0 shard of ``param``, a DTensor sharded over one mesh dim as FSDP2
    shards parameters (torch.chunk's pieces: ceil(rows / size) each, the last ones shorter or empty)."""
    rows = param.shape[0] if param.dim() else 1
    mesh = param.device_mesh
    size, rank = mesh.size(), mesh.get_local_rank()
    chunk = -(-rows // size)
    start = min(rank * chunk, rows)
    return start, min(chunk, rows - start)
