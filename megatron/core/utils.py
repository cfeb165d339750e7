"""Small helpers shared across the core library."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist

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
