"""DistributedOptimizer: fp32 main params and optimizer state sharded over data parallelism (ZeRO-1).

The model chunks must be wrapped in ``DistributedDataParallel`` with
``use_distributed_optimizer=True``: their gradient buffers are reduce-scattered, so DP
rank r holds the summed gradients of the r-th slice of every bucket (an expert buffer is
sharded over ``expt_dp``, the ranks holding the same experts). This optimizer
keeps, for each parameter, only the part of its flattened elements that falls inside
that slice: an fp32 main tensor (a view of the parameter itself when it is fp32, an fp32
copy otherwise) and the Adam moments of the same size, i.e. 1/d of the state per rank.
After the step the updated slices are written into the parameter buffer and all-gathered
bucket by bucket, in forward order (last bucket first). With ``overlap_param_gather`` the
all-gathers are left running: in the next forward each module waits only for the buckets of its
own parameters (a DDP forward pre-hook), so later buckets arrive while earlier layers compute;
``state_dict`` waits for all, and other code that reads the parameters calls
``chunk.finish_param_sync()`` first.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer import MainLink, MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.quantization.fp8_params import cast_shards, is_fp8_param
from megatron.core.tensor_parallel.layers import copy_tensor_model_parallel_attributes
from megatron.core.utils import all_gather_into_tensor, comm_device, named_model_params

# Elements per rank in one all-gather of a checkpoint save: bounds the device memory it takes
# (64 MiB per rank of fp32) whatever the bucket size (a single bucket holds the whole model).
_GATHER_ELEMENTS = 1 << 24


class DistributedOptimizer(MegatronOptimizer):
    """Each DP rank updates its shard of every bucket; parameters are then all-gathered.

    ``dp_group``: the ranks the state is sharded over (one instance's with several distributed-optimizer
    instances); ``instance_id``: this rank's instance (0 with one), whose copies of the state only
    instance 0 writes to a checkpoint. ``tp_groups``: Muon's TP gathers (``MegatronOptimizer``).

    Muon (groups with ``use_muon``): each matrix must lie whole in one DP rank's slice (the chunks were
    marked by ``keep_muon_matrices_whole`` before wrapping); the owning rank's main tensor is the whole
    matrix, shaped and TP-attributed like it, and the others hold nothing of it.
    """

    def __init__(
        self,
        config: OptimizerConfig,
        param_groups: List[Dict[str, Any]],
        tp_rank: int,
        stat_groups: Sequence[dist.ProcessGroup],
        grad_scaler: Optional[MegatronGradScaler],
        model_chunks: Sequence[torch.nn.Module],
        dp_group: dist.ProcessGroup,
        expert_stat_groups: Optional[Sequence[dist.ProcessGroup]] = None,
        instance_id: int = 0,
        tp_groups: Optional[Tuple[dist.ProcessGroup, ...]] = None,
    ) -> None:
        self.model_chunks = list(model_chunks)
        self.dp_group = dp_group
        self.instance_id = instance_id
        self.buffers = []
        for chunk in self.model_chunks:
            if not getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer", False):
                raise ValueError(
                    "use_distributed_optimizer=True needs every model chunk wrapped in "
                    "DistributedDataParallel with ddp_config.use_distributed_optimizer=True"
                )
            self.buffers.extend(chunk.all_buffers)
        self._buffer_of = {id(p): b for b in self.buffers for p in b.params}
        self._muon_ids = {id(p) for group in param_groups if group.get("use_muon") for p in group["params"]}
        super().__init__(config, param_groups, tp_rank, stat_groups, grad_scaler, expert_stat_groups, tp_groups)

    def _links_for(self, param: torch.nn.Parameter) -> List[MainLink]:
        buffer = self._buffer_of.get(id(param))
        if buffer is None:
            raise ValueError(f"parameter of shape {tuple(param.shape)} is not in any DDP buffer")
        flat_range = buffer.local_range(param)
        if flat_range is None:
            return []  # none of this parameter lies in this rank's shard
        whole = id(param) in self._muon_ids
        if whole and flat_range != (0, param.numel()):
            raise ValueError(
                f"optimizer='muon' with use_distributed_optimizer=True: a Muon matrix of shape {tuple(param.shape)} "
                f"is split over DP ranks (this rank holds its flat elements {flat_range}); mark the chunks with "
                "keep_muon_matrices_whole before wrapping them in DistributedDataParallel"
            )
        sources = self._shard_sources(buffer, param, flat_range)
        piece = sources.get("data_source", param.detach().view(-1)[flat_range[0] : flat_range[1]])
        shape = param.shape if whole else piece.shape  # a Muon matrix stays a matrix
        if param.dtype == torch.float32:
            link = MainLink(main=torch.nn.Parameter(piece.view(shape)), model=param, flat_range=flat_range, **sources)
        else:
            link = MainLink(main=None, model=param, flat_range=flat_range, is_copy=True, **sources)
            link.main = torch.nn.Parameter(link.model_values().clone().view(shape))  # an FP8 weight: dequantized
        if whole:  # Muon's TP gather reads partition_dim and expertness (its TP group)
            copy_tensor_model_parallel_attributes(link.main, param)
            link.main.allreduce = getattr(param, "allreduce", True)
        return [link]

    @staticmethod
    def _shard_sources(buffer, param: torch.nn.Parameter, flat_range: Tuple[int, int]) -> Dict[str, torch.Tensor]:
        """Megatron-FSDP: the views of the buffer's persistent shards a link reads instead of the model."""
        sources = {}
        if buffer.grad_shard is not None:
            sources["grad_source"] = buffer.shard_piece(buffer.grad_shard, param, flat_range)
        if buffer.param_shard is not None:
            sources["data_source"] = buffer.shard_piece(buffer.param_shard, param, flat_range)
        return sources

    def prepare_grads(self) -> bool:
        # Megatron-FSDP's sharded gradients: keep the reduced slices, free the full buffers.
        for buffer in self.buffers:
            buffer.release_grads()
        return super().prepare_grads()

    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        # A bucket no forward used may still be gathering into the buffer the update writes.
        self.finish_param_sync()
        return super().step()

    def _after_step(self) -> None:
        super()._after_step()  # our slices into the parameter buffer
        self._cast_fp8_weights(record=True)
        self.start_param_sync()
        if not self.config.overlap_param_gather:
            self.finish_param_sync()

    def _cast_fp8_weights(self, record: bool) -> None:
        """Cast this rank's shards of the fp32 main weights into the FP8 weights (``fp8_param_gather``),
        buffer by buffer, every FP8 weight of a buffer in its order on every rank (``fp8_params.cast_shards``)."""
        links = {id(link.model): link for link in self.links}
        for buffer in self.buffers:
            shards = []
            for param in buffer.params:
                if is_fp8_param(param):
                    link = links.get(id(param))
                    shards.append((param, None, None) if link is None else (param, link.main, link.flat_range))
            cast_shards(shards, buffer.dp_group, record)

    def _recast_fp8_weights(self) -> None:
        """After main weights were restored: the FP8 weights they were cast to, on every DP rank."""
        self.finish_param_sync()
        self._cast_fp8_weights(record=False)
        self.start_param_sync()
        self.finish_param_sync()

    def _refresh_param_shards(self) -> None:
        """optim_grads_params: a checkpoint load wrote the parameters whole; their shards (the fp32
        main weights themselves, for fp32 parameters) take the loaded values before the state does."""
        for buffer in self.buffers:
            buffer.refresh_param_shards()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._refresh_param_shards()
        super().load_state_dict(state_dict)
        self._recast_fp8_weights()

    def load_state_dict_by_param_name(self, model_chunks: Sequence[torch.nn.Module], state: Dict[str, Any]) -> None:
        self._refresh_param_shards()
        super().load_state_dict_by_param_name(model_chunks, state)
        self._recast_fp8_weights()

    def reload_model_params(self, state_dict: Optional[Dict[str, Any]] = None) -> None:
        self._refresh_param_shards()
        super().reload_model_params(state_dict)

    def start_param_sync(self) -> None:
        """All-gather every bucket's updated parameters from the DP shards (asynchronously).

        Buckets are laid out in backward order, so they are issued last first: the order in
        which the next forward needs them (the same on every rank).
        """
        for buffer in self.buffers:
            buffer.start_param_gather()

    def finish_param_sync(self) -> None:
        """Wait for every outstanding parameter all-gather (no-op when none is running)."""
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                bucket.finish_param_gather()

    def sharded_state_template(
        self,
        model_chunks: Sequence[torch.nn.Module],
        specs: Dict[str, ShardedTensor],
        saved: Dict[str, Dict[str, torch.dtype]],
    ) -> Tuple[Dict[str, ShardedTensor], Dict[str, Dict[str, Any]]]:
        """Checkpoint reads of only this rank's slices, for ``load_state_dict_by_param_name``.

        Args:
            specs: parameter name -> the parameter's ShardedTensor (``sharded_tensors_by_param_name``).
            saved: parameter checkpoint key -> {state name: dtype} of what the checkpoint holds.

        Returns:
            (sharded state dict to ``dist_checkpointing.load``, per-parameter entries to merge into the
            by-name state). A parameter with a slice here reads, per state, the smallest box of its
            (TP-local) view that holds the slice (at most two partial rows more); the entry's
            ``flat_start`` says where the box starts in the flattened parameter. Parameters without a
            slice here read nothing.
        """
        from megatron.core.dist_checkpointing.state_dict import optimizer_state_key

        links = {id(link.model): link for link in self.links}
        template: Dict[str, ShardedTensor] = {}
        per_param: Dict[str, Dict[str, Any]] = {}
        for name, param in named_model_params(model_chunks):
            link, spec = links.get(id(param)), specs.get(name)
            if link is None or spec is None or spec.key not in saved:
                continue
            offset, size, first = flat_range_box(spec.local_shape, *link.flat_range)
            entry: Dict[str, Any] = {"flat_start": first}
            for state, dtype in saved[spec.key].items():
                key = optimizer_state_key(spec.key, state)
                entry[state] = torch.empty(size, dtype=dtype, device=link.main.device)
                template[key] = ShardedTensor.from_global(
                    key,
                    entry[state],
                    spec.global_shape,
                    tuple(o + b for o, b in zip(spec.global_offset, offset)),
                    spec.replica_id,
                )
            per_param[name] = entry
        return template, per_param

    def sharded_state_to_save(
        self, model_chunks: Sequence[torch.nn.Module], specs: Dict[str, ShardedTensor]
    ) -> Tuple[Dict[str, ShardedTensor], Dict[str, Any]]:
        """This rank's own slices of the optimizer state as checkpoint pieces, and the scalars; no collective.

        Every DP rank writes what it holds (1/DP of the state), instead of DP rank 0 gathering it all.
        A slice is a flat range of its (TP-local) parameter: it is written as the few boxes that tile it
        (``flat_range_boxes``), views of the state itself (a caller that keeps them past the next step
        snapshots them). ``specs``: parameter name -> ShardedTensor as DP rank 0 describes it
        (``sharded_tensors_by_param_name(..., dp_replicas=False)``); with several distributed-optimizer
        instances the other instances' identical slices are replicas (``instance_id`` as replica id).
        Before the first step there is no state and nothing is written.
        """
        from megatron.core.dist_checkpointing.state_dict import optimizer_state_key

        self.finish_param_sync()
        links = {id(link.model): link for link in self.links}
        out: Dict[str, ShardedTensor] = {}
        for name, param in named_model_params(model_chunks):
            link, spec = links.get(id(param)), specs.get(name)
            if link is None or spec is None:
                continue
            for state, value in self._param_state(link).items():
                key = optimizer_state_key(spec.key, state)
                flat = value.detach().view(-1)  # [slice numel], flat elements link.flat_range of the parameter
                for offset, size, first in flat_range_boxes(spec.local_shape, *link.flat_range):
                    lo = first - link.flat_range[0]
                    data = flat[lo : lo + math.prod(size)].view(size)  # [box]
                    at = tuple(o + b for o, b in zip(spec.global_offset, offset))
                    replica = spec.replica_id if spec.replica_id or not self.instance_id else self.instance_id
                    out[f"{key}@{first}"] = ShardedTensor.from_global(key, data, spec.global_shape, at, replica)
        return out, self._scalars()

    def _state_keys(self, param: Optional[torch.nn.Parameter] = None) -> List[str]:
        """The state tensors of ``param`` (None: of any parameter) under ``config.optimizer``."""
        adam = ["exp_avg", "exp_avg_sq"]
        if self.config.optimizer == "muon":
            muon = ["momentum_buffer"]
            return adam + muon if param is None else (muon if id(param) in self._muon_ids else adam)
        if self.config.optimizer == "adam":
            return adam
        return ["momentum_buffer"] if self.config.sgd_momentum > 0 else []

    def _full_param_states(self, all_ranks: bool) -> Dict[int, Dict[str, torch.Tensor]]:
        """Every DP rank's slices gathered back into whole (local TP shape) CPU tensors, bucket by bucket.

        Collective over each buffer's DP group; only its DP rank 0 (the rank that writes the state to
        a checkpoint) keeps the result, unless ``all_ranks``. Empty before the first step.
        """
        self.finish_param_sync()
        links_of = {}
        for link in self.links:
            links_of.setdefault(id(link.model), link)
        out: Dict[int, Dict[str, torch.Tensor]] = {}
        for buffer in self.buffers:
            keys = self._state_keys() + (["main_param"] if buffer.param_dtype != torch.float32 else [])
            keep = all_ranks or buffer.dp_rank == 0
            for bucket in buffer.buckets:
                for key in keys:
                    full = self._gather_bucket(buffer, bucket, key, links_of, keep)  # [bucket numel] CPU
                    for param in bucket.params if keep else ():
                        if key == "main_param" or key in self._state_keys(param):
                            out.setdefault(id(param), {})[key] = _param_view(full, buffer, bucket, param)
        # The same collectives run before the first step (every rank gathers the same keys); a
        # rank holding no parameter's slice has no state of its own but still takes part.
        return out if self.optimizer.state else {}

    def _local_shard(self, buffer, bucket, key: str, links_of: Dict[int, MainLink]) -> torch.Tensor:
        """This rank's shard of the fp32 ``key`` tensor over ``bucket`` ``[bucket numel / dp]``, on the
        state's device (zeros where no parameter lies: padding)."""
        size = bucket.grad_data.numel() // buffer.dp_size
        shard = torch.zeros(size, dtype=torch.float32, device=self.device)
        shard_start = bucket.offset + buffer.dp_rank * size
        for param in bucket.params:
            link = links_of.get(id(param))
            if link is None:
                continue
            value = link.main if key == "main_param" else self.optimizer.state.get(link.main, {}).get(key)
            if value is None:
                continue
            start = buffer.param_range[id(param)][0] + link.flat_range[0] - shard_start
            shard[start : start + value.numel()] = value.detach().view(-1)
        return shard

    def _gather_bucket(
        self, buffer, bucket, key: str, links_of: Dict[int, MainLink], keep: bool
    ) -> Optional[torch.Tensor]:
        """The fp32 ``key`` tensor over a whole bucket ``[bucket numel]`` on the CPU (None unless ``keep``).

        The shards travel on the DP group's communication device (the GPU under NCCL), at most
        ``_GATHER_ELEMENTS`` per rank and collective, and come to the host in one copy per piece.
        """
        shard = self._local_shard(buffer, bucket, key, links_of)  # [size]
        if buffer.dp_size == 1:
            return shard.cpu()
        size, dp = shard.numel(), buffer.dp_size
        full = torch.empty(dp, size, dtype=torch.float32) if keep else None  # [dp, size] CPU
        device = comm_device(buffer.dp_group)
        for lo in range(0, size, _GATHER_ELEMENTS):
            hi = min(lo + _GATHER_ELEMENTS, size)
            gathered = torch.empty(dp, hi - lo, dtype=torch.float32, device=device)  # [dp, piece]
            all_gather_into_tensor(gathered.view(-1), shard[lo:hi].to(device), group=buffer.dp_group)
            if keep:
                full[:, lo:hi].copy_(gathered)
        return full.view(-1) if keep else None


def _param_view(full: torch.Tensor, buffer, bucket, param: torch.nn.Parameter) -> torch.Tensor:
    """``param``'s part of a tensor over the whole ``bucket``, shaped like the parameter."""
    start, end = buffer.param_range[id(param)]
    return full[start - bucket.offset : end - bucket.offset].view(param.shape)


def flat_range_box(shape: Sequence[int], start: int, end: int) -> Tuple[Tuple[int, ...], Tuple[int, ...], int]:
    """The smallest box of a row-major ``shape`` holding flat elements ``[start, end)``: (offset, size, first).

    Dimensions before the first one where ``start`` and ``end - 1`` differ are fixed, that one spans
    both, the later ones are whole; such a box is contiguous in flat order and starts at ``first``.
    """
    if end <= start:
        raise ValueError(f"flat range [{start}, {end}) is empty")
    lo, hi = _unravel(start, shape), _unravel(end - 1, shape)
    k = next((d for d in range(len(shape)) if lo[d] != hi[d]), len(shape) - 1)
    offset = tuple(lo[: k + 1]) + (0,) * (len(shape) - k - 1)
    size = (1,) * k + (hi[k] - lo[k] + 1,) + tuple(shape[k + 1 :])
    first = 0
    for index, extent in zip(offset, shape):
        first = first * extent + index
    return offset, size, first


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> List[Tuple[Tuple[int, ...], Tuple[int, ...], int]]:
    """Disjoint boxes of a row-major ``shape`` that together hold exactly flat elements ``[start, end)``.

    Each is (offset, size, first flat element), in flat order: a partial first row, the whole rows, a
    partial last row, each partial row split the same way one dimension down (at most 2 per dimension).
    """
    if end <= start:
        return []
    if len(shape) <= 1:
        return [((start,) * len(shape), (end - start,) * len(shape), start)]
    row = math.prod(shape[1:])
    first_row, last_row = start // row, (end - 1) // row
    if first_row == last_row:
        base = first_row * row
        inner = flat_range_boxes(shape[1:], start - base, end - base)
        return [((first_row,) + o, (1,) + z, base + f) for o, z, f in inner]
    full_lo, full_hi = -(-start // row), end // row  # whole rows [full_lo, full_hi)
    boxes = flat_range_boxes(shape, start, full_lo * row) if start % row else []
    if full_hi > full_lo:
        boxes.append(((full_lo,) + (0,) * (len(shape) - 1), (full_hi - full_lo,) + tuple(shape[1:]), full_lo * row))
    if end % row:
        boxes += flat_range_boxes(shape, full_hi * row, end)
    return boxes


def _unravel(index: int, shape: Sequence[int]) -> List[int]:
    coords = []
    for extent in reversed(shape):
        coords.append(index % extent)
        index //= extent
    return coords[::-1]
