"""TorchFullyShardedDataParallel: PyTorch FSDP2 (``fully_shard``) applied to a model chunk from outside.

Each transformer layer (``is_fsdp_unit``), the embedding and the output layer become FSDP2 modules of
their own, the rest (final norm) belongs to the root; expert modules (every parameter ``allreduce =
False``) are sharded first, over the expert-data-parallel ranks (``expt_dp``), the others over data x
context parallelism (``dp_cp``). A parameter becomes a ``DTensor`` sharded along dim 0 (torch.chunk's
rows) of its tensor-parallel piece, which it stays: FSDP shards the TP shard further. The parameters'
own attributes (``tensor_model_parallel``, ``sequence_parallel``, ``allreduce``, ...) are put back on
the DTensors (``fully_shard`` makes new ``Parameter`` objects).

Precision: fp32 runs keep fp32 shards and reduce in fp32. bf16 runs keep the *fp32* master values in
the shards and gather them as bf16 for compute (``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``): the bf16 gradients are reduced in fp32 and stay fp32, as the distributed
optimizer's fp32 gradient buffer does. Megatron itself passes no policy (bf16 shards, bf16 reduction,
fp32 copies in the optimizer); the bytes per parameter are the same 16/d.

Reductions: sum then divide by the data-parallel size, like the distributed optimizer's pre-scale (the
expert modules too: their sum over ``expt_dp`` already holds every EP rank's tokens); with
``calculate_per_token_loss`` no division. Earlier microbatches accumulate unsharded gradients
(``no_sync``). Prefetch is explicit: layer i's forward issues layer i+1's all-gather before it runs,
its backward layer i-1's; ``events`` (a list) records ``("gather", unit)`` when an all-gather is
issued and ``("forward_end", unit)`` (unit: the layer's number, ``-1`` embedding, ``-2`` output).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fsdp_units import fsdp_unit_modules
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import is_expert_param
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import dtensor_rows

EMBEDDING, OUTPUT = -1, -2  # unit numbers of the embedding and the output layer in ``events``


@dataclass
class TorchFullyShardedDataParallelConfig(DistributedDataParallelConfig):
    """Megatron's config for FSDP2: ``reshard_after_forward`` (``--torch-fsdp2-no-reshard-after-forward``
    sets it False: gathered parameters stay from forward to backward)."""

    reshard_after_forward: Union[bool, int] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        on = [name for name in ("use_distributed_optimizer", "use_megatron_fsdp") if getattr(self, name)]
        if on:
            raise ValueError(
                f"{', '.join(f'{n}=True' for n in on)}: FSDP2 shards parameters, gradients and optimizer state "
                "itself (Megatron refuses the pairing too)"
            )


def flat_range_of(param: DTensor) -> Tuple[int, int]:
    """This rank's shard of ``param`` as a range of the flattened (TP-local) tensor: dim-0 rows are contiguous."""
    start, rows = dtensor_rows(param)
    row = param.numel() // max(param.shape[0], 1) if param.dim() else 1
    return start * row, (start + rows) * row


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for ``param`` (its local rows for a DTensor; itself otherwise)."""
    return param._local_tensor if isinstance(param, DTensor) else param


def _attributes(module: torch.nn.Module) -> Dict[str, Dict[str, Any]]:
    return {name: dict(vars(p)) for name, p in module.named_parameters()}


def _restore_attributes(module: torch.nn.Module, saved: Dict[str, Dict[str, Any]]) -> None:
    for name, param in module.named_parameters():
        for key, value in saved.get(name, {}).items():
            setattr(param, key, value)


def _expert_modules(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The outermost modules whose parameters are all expert parameters (the experts of each MoE layer)."""
    found: List[torch.nn.Module] = []
    inside: set = set()
    for sub in module.modules():
        if id(sub) in inside:
            continue
        params = list(sub.parameters())
        if sub is not module and params and all(is_expert_param(p) for p in params):
            found.append(sub)
            inside.update(id(m) for m in sub.modules())
    return found


class TorchFullyShardedDataParallel(torch.nn.Module):
    """Wraps ``module`` (module docstring); ``forward`` and ``state_dict`` delegate to it.

    Args:
        config: the model's TransformerConfig (``bf16``, ``calculate_per_token_loss``).
        ddp_config: ``reshard_after_forward``; the distributed optimizer and Megatron-FSDP are refused.
        module: the model chunk (not yet sharded; fp32 or bf16 parameters).
        disable_bucketing: accepted for DistributedDataParallel's signature (FSDP2 has no buckets).
        pg_collection: ``dp_cp`` and ``expt_dp`` groups.
        events: when a list, the all-gathers and layer ends in issue order (the structural tests read it).
    """

    is_ddp_wrapper = True  # unwrap_model looks through it

    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: TorchFullyShardedDataParallelConfig,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
        pg_collection: Optional[ProcessGroupCollection] = None,
        events: Optional[List[Tuple[str, int]]] = None,
    ) -> None:
        super().__init__()
        if config.fp16:
            raise ValueError("fp16=True: FSDP2 runs fp32 or bf16 (Megatron refuses fp16 with it too)")
        if getattr(module, "share_embeddings_and_output_weights", False):
            raise ValueError(
                "share_embeddings_and_output_weights=True: under FSDP2 the output layer would read the embedding's "
                "weight outside the embedding's gather (Megatron needs untied embeddings with FSDP2 too)"
            )
        self.config, self.ddp_config, self.module = config, ddp_config, module
        groups = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
        self.pg_collection = groups
        self.events = events
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.dp_size = dist.get_world_size(groups.dp_cp)
        _broadcast(module, groups)
        attributes = _attributes(module)
        if config.bf16:
            for param in module.parameters():  # the fp32 master values live in the shards
                param.data = param.data.float()
        meshes = {
            False: DeviceMesh.from_group(groups.dp_cp, device),
            True: DeviceMesh.from_group(groups.expt_dp, device),
        }
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if config.bf16 else None, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
        self.units = self._shard(module, meshes, policy)
        _restore_attributes(module, attributes)
        if config.bf16:
            for param in module.parameters():
                param.checkpoint_dtype = torch.bfloat16  # what a bf16 model's checkpoint holds
        self.is_last_microbatch = True

    def _shard(self, module: torch.nn.Module, meshes: Dict[bool, DeviceMesh], policy: MixedPrecisionPolicy):
        """fully_shard experts, layers, embedding and output layer, then the root; set prefetch and reductions."""
        divide = 1.0 if self.config.calculate_per_token_loss else float(self.dp_size)
        kwargs = {"mp_policy": policy, "reshard_after_forward": self.ddp_config.reshard_after_forward}
        layers = fsdp_unit_modules(module)
        named: List[Tuple[int, torch.nn.Module]] = []
        embedding, output = getattr(module, "embedding", None), getattr(module, "output_layer", None)
        if embedding is not None and any(True for _ in embedding.parameters()):
            named.append((EMBEDDING, embedding))
        named += list(enumerate(layers))
        if output is not None and any(True for _ in output.parameters()):
            named.append((OUTPUT, output))
        experts = _expert_modules(module)
        for sub in experts:
            fully_shard(sub, mesh=meshes[True], **kwargs)
        for _, sub in named:
            fully_shard(sub, mesh=meshes[False], **kwargs)
        fully_shard(module, mesh=meshes[False], **kwargs)
        for sub in [*experts, *(s for _, s in named), module]:
            sub.set_force_sum_reduction_for_comms(True)  # gloo has no averaging reduction; divide after the sum
            sub.set_gradient_divide_factor(divide)
        order = [s for _, s in named]
        for i, sub in enumerate(order):
            sub.set_modules_to_forward_prefetch(_with_experts(order[i + 1 : i + 2], experts))
            sub.set_modules_to_backward_prefetch(_with_experts(order[max(i - 1, 0) : i], experts))
        if self.events is not None:
            for k, sub in named:
                sub.register_forward_hook(self._forward_end(k))
                _record_gathers(sub, k, self.events)
        return named

    def _forward_end(self, k: int):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            self.events.append(("forward_end", k))

        return hook

    # --- DistributedDataParallel's interface ------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients without reducing them (earlier microbatches of a step)."""
        self.is_last_microbatch = False
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)
            self.is_last_microbatch = True

    def start_grad_sync(self, *unused: Any) -> None:
        """FSDP2 reduce-scatters in its post-backward hooks: nothing to start."""

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False) -> None:
        """FSDP2's backward ends once its reduce-scatters are done; ``force_all_reduce`` is refused."""
        if force_all_reduce:
            raise NotImplementedError("finish_grad_sync(force_all_reduce=True) under FSDP2: gradients are sharded")

    def zero_grad_buffer(self) -> None:
        """Drop every gradient (call at the start of each iteration)."""
        for param in self.module.parameters():
            param.grad = None

    def scale_gradients(self, scaling_factor: Union[float, torch.Tensor]) -> None:
        """Multiply every local gradient shard by ``scaling_factor``."""
        for param in self.module.parameters():
            if param.grad is not None:
                local_shard(param.grad).mul_(scaling_factor)

    def broadcast_params(self) -> None:
        """Nothing: the constructor broadcast DP rank 0's values before sharding them."""

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Nothing: FSDP2 gathers each layer's parameters before its forward."""

    def finish_param_sync(self) -> None:
        """Nothing pending: readers outside forward read the DTensors (checkpoints gather them)."""

    def enable_forward_pre_hook(self) -> None:
        """Nothing: FSDP2's own pre-forward hooks gather."""

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Nothing: FSDP2's own pre-forward hooks gather."""

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Dict[str, Any]:
        """The wrapped module's state dict (sharded parameters as DTensors)."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> Dict[str, Any]:
        """Megatron-core's name for ``state_dict`` at save time."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict)


def _with_experts(modules: List[torch.nn.Module], experts: List[torch.nn.Module]) -> List[FSDPModule]:
    """``modules`` and the expert modules inside them (separate FSDP2 modules, gathered with their layer)."""
    inside = [e for e in experts for m in modules if any(e is s for s in m.modules())]
    return [*modules, *inside]


def _record_gathers(module: FSDPModule, k: int, events: List[Tuple[str, int]]) -> None:
    """Record ``("gather", k)`` when ``module``'s parameter all-gather is issued (its param group's ``unshard``
    with nothing gathered or in flight)."""
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:
        return
    unshard = group.unshard

    def recording(*args: Any, **kwargs: Any) -> Any:
        if group._all_gather_result is None and not group.is_unsharded:
            events.append(("gather", k))
        return unshard(*args, **kwargs)

    group.unshard = recording


def _broadcast(module: torch.nn.Module, groups: ProcessGroupCollection) -> None:
    """DP rank 0's parameters on every DP rank (experts: expert-DP rank 0's), before they are sharded."""
    for param in module.parameters():
        name = "expt_dp" if is_expert_param(param) else "dp_cp"
        dist.broadcast(param.data, src=groups.ranks[name][0], group=getattr(groups, name))
