"""The optimizer over FSDP2's sharded (DTensor) parameters.

Each main parameter is this rank's fp32 shard itself (the DTensor's local rows, updated in place, so the
next all-gather reads the update); its gradient is the local shard of the DTensor gradient, already
reduced over data parallelism. The torch optimizer therefore steps plain tensors, as for the
distributed optimizer's slices. A shard is a contiguous range of the flattened (TP-local) parameter
(``flat_range``), which is what the by-name checkpoint contract slices saved tensors by.

Gradient statistics (norm, zeros, inf/NaN under a loss scaler) sum the shards over data x context
parallelism and the model-parallel group, experts over expert-DP and ``tp_ep_pp``, exactly as the
distributed optimizer's. Checkpoints gather each state tensor over the shard's group to the
parameter's whole TP-local shape, so FSDP2 writes what every other layout writes. bf16 runs keep
the fp32 master values in the shards: a checkpoint's ``main_param`` is the shard itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import torch
from torch.distributed.tensor import DTensor, Shard

from megatron.core.distributed.torch_fully_sharded_data_parallel import flat_range_of, local_shard
from megatron.core.optimizer.optimizer import MainLink, MegatronOptimizer, _piece_of


@dataclass
class ShardLink(MainLink):
    """``main`` is the local shard of the DTensor parameter ``model``; ``master``: it is a bf16 model's
    fp32 master value (a checkpoint's ``main_param``)."""

    master: bool = False

    def model_grad(self) -> torch.Tensor:
        grad = self.model.grad
        return None if grad is None else local_shard(grad)

    def model_data(self) -> torch.Tensor:
        return self.main


class FullyShardedOptimizer(MegatronOptimizer):
    """``MegatronOptimizer`` over FSDP2 shards (module docstring); same arguments."""

    def _links_for(self, param: torch.nn.Parameter) -> List[MainLink]:
        if not isinstance(param, DTensor) or param.dtype != torch.float32:
            raise ValueError(
                f"FullyShardedOptimizer: parameter of type {type(param).__name__}, dtype {param.dtype}: "
                "needs FSDP2's fp32 DTensor shards"
            )
        master = getattr(param, "checkpoint_dtype", torch.float32) != torch.float32
        return [ShardLink(main=local_shard(param), model=param, flat_range=flat_range_of(param), master=master)]

    def _param_state(self, link: MainLink) -> Dict[str, torch.Tensor]:
        state = super()._param_state(link)
        if state and link.master:
            state["main_param"] = link.main
        return state

    def _full_param_states(self, all_ranks: bool) -> Dict[int, Dict[str, torch.Tensor]]:
        """Every state tensor gathered over its shard group to the parameter's TP-local shape (collective)."""
        out: Dict[int, Dict[str, torch.Tensor]] = {}
        for link in self.links:
            param = link.model
            out[id(param)] = {
                key: DTensor.from_local(value, param.device_mesh, [Shard(0)], shape=param.shape, stride=param.stride())
                .full_tensor()
                .to("cpu", copy=True)
                for key, value in self._param_state(link).items()
            }
        return out

    def _load_link(self, link: MainLink, saved: Dict[str, Any], step: int) -> None:
        super()._load_link(link, saved, step)
        if link.master and saved.get("main_param") is not None:
            link.main.copy_(_piece_of(link, saved["main_param"], int(saved.get("flat_start", 0))))
