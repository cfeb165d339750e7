"""DistributedOptimizer: fp32 main params and optimizer state sharded over data parallelism (ZeRO-1).

The model chunks must be wrapped in ``DistributedDataParallel`` with
``use_distributed_optimizer=True``: their gradient buffers are reduce-scattered, so DP
rank r holds the summed gradients of the r-th slice of every bucket (an expert buffer is
sharded over ``expt_dp``, the ranks holding the same experts). This optimizer
keeps, for each parameter, only the part of its flattened elements that falls inside
that slice: an fp32 main tensor (a view of the parameter itself when it is fp32, an fp32
copy otherwise) and the Adam moments of the same size, i.e. 1/d of the state per rank.
After the step the updated slices are written into the parameter buffer and all-gathered
bucket by bucket. With ``overlap_param_gather`` the all-gathers are left running and the
next forward (or ``state_dict``) of each DDP chunk waits for them; code that reads the
parameters otherwise calls ``chunk.finish_param_sync()`` first.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer import MainLink, MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.utils import all_gather_into_tensor


class DistributedOptimizer(MegatronOptimizer):
    """Each DP rank updates its shard of every bucket; parameters are then all-gathered."""

    def __init__(self, config: OptimizerConfig, param_groups: List[Dict[str, Any]], tp_rank: int,
                 stat_groups: Sequence[dist.ProcessGroup], grad_scaler: Optional[MegatronGradScaler],
                 model_chunks: Sequence[torch.nn.Module], dp_group: dist.ProcessGroup,
                 expert_stat_groups: Optional[Sequence[dist.ProcessGroup]] = None) -> None:
        self.model_chunks = list(model_chunks)
        self.dp_group = dp_group
        self.buffers = []
        for chunk in self.model_chunks:
            if not getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer", False):
                raise ValueError("use_distributed_optimizer=True needs every model chunk wrapped in "
                                 "DistributedDataParallel with ddp_config.use_distributed_optimizer=True")
            self.buffers.extend(chunk.buffers)
        self._buffer_of = {id(p): b for b in self.buffers for p in b.params}
        self._gather_handles: List[dist.Work] = []
        super().__init__(config, param_groups, tp_rank, stat_groups, grad_scaler, expert_stat_groups)
        for chunk in self.model_chunks:
            chunk.register_param_sync_waiter(self.finish_param_sync)

    def _links_for(self, param: torch.nn.Parameter) -> List[MainLink]:
        buffer = self._buffer_of.get(id(param))
        if buffer is None:
            raise ValueError(f"parameter of shape {tuple(param.shape)} is not in any DDP buffer")
        flat_range = buffer.local_range(param)
        if flat_range is None:
            return []  # none of this parameter lies in this rank's shard
        piece = param.detach().view(-1)[flat_range[0]:flat_range[1]]
        if param.dtype == torch.float32:
            return [MainLink(main=torch.nn.Parameter(piece), model=param, flat_range=flat_range)]
        return [MainLink(main=torch.nn.Parameter(piece.clone().float()), model=param, flat_range=flat_range,
                         is_copy=True)]

    def _after_step(self) -> None:
        super()._after_step()  # our slices into the parameter buffer
        self.start_param_sync()
        if not self.config.overlap_param_gather:
            self.finish_param_sync()

    def start_param_sync(self) -> None:
        """All-gather every bucket's updated parameters from the DP shards (asynchronously)."""
        for buffer in self.buffers:
            if buffer.dp_size == 1:
                continue
            for bucket in buffer.buckets:
                shard = bucket.shard(bucket.param_data, buffer.dp_rank, buffer.dp_size)
                self._gather_handles.append(
                    all_gather_into_tensor(bucket.param_data, shard, group=buffer.dp_group, async_op=True))

    def finish_param_sync(self) -> None:
        """Wait for outstanding parameter all-gathers (no-op when none is running)."""
        for handle in self._gather_handles:
            handle.wait()
        self._gather_handles = []

    def _state_keys(self) -> List[str]:
        if self.config.optimizer == "adam":
            return ["exp_avg", "exp_avg_sq"]
        return ["momentum_buffer"] if self.config.sgd_momentum > 0 else []

    def _full_param_states(self) -> Dict[int, Dict[str, torch.Tensor]]:
        """Gather every DP rank's slices back into whole (local TP shape) tensors, bucket by bucket."""
        self.finish_param_sync()
        has_state = len(self.optimizer.state) > 0
        keys = (self._state_keys() if has_state else []) + ["main_param"]
        links_of = {}
        for link in self.links:
            links_of.setdefault(id(link.model), link)
        out: Dict[int, Dict[str, torch.Tensor]] = {}
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                for key in keys:
                    full = self._gather_bucket(buffer, bucket, key, links_of)
                    for param in bucket.params:
                        if key == "main_param" and param.dtype == torch.float32:
                            continue  # the main param is the parameter itself
                        start, end = buffer.param_range[id(param)]
                        piece = full[start - bucket.offset:end - bucket.offset].view(param.shape).clone()
                        out.setdefault(id(param), {})[key] = piece
        if not has_state:
            return {}
        return out

    def _gather_bucket(self, buffer, bucket, key: str, links_of: Dict[int, MainLink]) -> torch.Tensor:
        """The fp32 ``key`` tensor over a whole bucket, from every DP rank's shard."""
        size = bucket.grad_data.numel() // buffer.dp_size
        shard = torch.zeros(size, dtype=torch.float32)
        shard_start = bucket.offset + buffer.dp_rank * size
        for param in bucket.params:
            link = links_of.get(id(param))
            if link is None:
                continue
            value = link.main if key == "main_param" else self.optimizer.state.get(link.main, {}).get(key)
            if value is None:
                continue
            start = buffer.param_range[id(param)][0] + link.flat_range[0] - shard_start
            shard[start:start + value.numel()] = value.detach().view(-1)
        full = torch.empty(size * buffer.dp_size, dtype=torch.float32)
        if buffer.dp_size == 1:
            return shard
        all_gather_into_tensor(full, shard, group=buffer.dp_group)
        return full
