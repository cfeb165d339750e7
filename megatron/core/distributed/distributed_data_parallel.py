"""DistributedDataParallel: a model chunk whose gradients live in bucketed flat buffers.

Backward accumulates each ``param.grad`` into ``param.main_grad`` (a view of the flat
buffer) and frees ``param.grad``; a tensor-parallel linear with ``gradient_accumulation_fusion``
writes its weight gradient into ``main_grad`` itself and flags ``grad_added_to_main_grad`` (the
hook then drops the dummy ``param.grad``). Gradients are averaged over the data-parallel group
(``dp_cp``: context-parallel ranks hold the same parameters too):

* without ``overlap_grad_reduce`` everything is reduced in ``finish_grad_sync()``;
* with it, a bucket's collective starts (asynchronously) as soon as the last of its
  gradients is accumulated during the last microbatch's backward, and
  ``finish_grad_sync()`` waits for the handles. Buckets are always dispatched in index
  order so that every rank issues the same sequence of collectives.

Expert parameters (``allreduce = False``: each expert-parallel rank holds different experts)
get buffers of their own, reduced over ``expt_dp`` (the data-parallel ranks holding the same
experts) with the same scale as the dense ones: the MoE layer's all-gather over EP already
summed the EP ranks' tokens into each expert's gradient, so the sum over ``expt_dp`` is the sum
over all data-parallel ranks, and 1/dp makes it the dense average.

Earlier microbatches run inside ``no_sync()``. With ``use_distributed_optimizer`` the
buffers are reduce-scattered (each DP rank gets its slice summed) instead of all-reduced,
and parameters live in a flat buffer that the optimizer all-gathers after its step; with
``overlap_param_gather`` those gathers run into the next forward, where a pre-hook on each module
waits for the buckets of the parameters it reads: its own, all below it for a module that reads its
submodules' weights itself (``reads_submodule_parameters``), and any passed to it as arguments
(``finish_param_sync`` waits for all).
Megatron-FSDP (``ddp_config.use_megatron_fsdp``): ``optim`` is the distributed optimizer;
``optim_grads`` keeps only each buffer's reduced slice once the optimizer takes the gradients
(``ParamAndGradBuffer.release_grads``; ``zero_grad_buffer`` gives the full buffer back for the next
backward); ``optim_grads_params`` stores the parameters sharded and gathers them layer by layer
(``fsdp_units.ShardedParamUnits``); ``finish_param_sync`` then gathers them all for readers outside
forward (norms, checkpoints).
Hybrid sharding (``ddp_config.num_distributed_optimizer_instances`` = N > 1): the buffers are
sharded over one instance's part of the data-parallel ranks (``intra_dp_cp`` / ``intra_expt_dp``, dp / N
ranks), so the reduce-scatter sums within the instance; once a bucket's reduce-scatter is done,
``finish_grad_sync`` all-reduces its reduced slice over ``inter_dist_opt`` (the ranks holding the same
slice in the other instances), before the optimizer reads it. ``comm_events`` (a list, when set)
records ``(what, buffer, bucket)`` for ``"reduce_scatter"``, ``"reduce_scatter_done"``,
``"all_reduce_instances"`` and ``"all_reduce_instances_done"`` in order (structural tests).
Averaging: gradients are scaled by 1/dp, except with ``calculate_per_token_loss`` (the
loss is a sum; ``finalize_model_grads`` divides by the global token count).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

import torch
import torch.distributed as dist

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fsdp_units import ROOT, ShardedParamUnits, fsdp_unit_modules, unit_of_params, unit_starts
from megatron.core.distributed.param_and_grad_buffer import KEEP_WHOLE_ATTR, Bucket, BucketGroup, ParamAndGradBuffer
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.quantization.fp8_params import is_fp8_param
from megatron.core.tensor_parallel.layers import is_expert_param
from megatron.core.transformer.fp8_utils import check_fp8_param_gather, convert_weights_to_fp8
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import reduce_scatter_tensor


def default_bucket_size(ddp_config: DistributedDataParallelConfig, dp_size: int) -> Optional[int]:
    """Elements per bucket (None: one bucket); the theoretical memory accounting lays buffers out with it too."""
    if not ddp_config.overlap_grad_reduce:
        return None  # one bucket: nothing to overlap with
    return ddp_config.bucket_size or max(40_000_000, 1_000_000 * dp_size)


class NonFiniteGradientError(RuntimeError):
    """A NaN gradient found by ``check_for_nan_in_grad``; the training loop adds the iteration."""


class DistributedDataParallel(torch.nn.Module):
    """Wraps ``module``; ``forward`` and ``state_dict`` delegate to it.

    Args:
        config: the model's TransformerConfig (``calculate_per_token_loss`` is read).
        ddp_config: buffer and reduction settings.
        module: the model chunk.
        disable_bucketing: one bucket whatever ``bucket_size`` says (so do pipeline stages after the
            first, as upstream: only the first stage's backward ends the step, the others have nothing
            to overlap with).
        pg_collection: groups; gradients are reduced over ``pg_collection.dp_cp`` (experts: ``expt_dp``).

    Megatron-core's attributes: ``buffers`` (dense) and ``expert_parallel_buffers``, the matching
    ``bucket_groups`` / ``expert_parallel_bucket_groups`` (one bucket each), ``param_to_bucket_group``,
    ``params_with_grad`` and ``bucket_size`` (the size in use; ``ddp_config`` is not modified).
    """

    is_ddp_wrapper = True

    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__()
        self.config, self.ddp_config, self.module = config, ddp_config, module
        self.pg_collection = (
            pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
        )
        self.dp_group = self.pg_collection.dp_cp
        self.dp_size = dist.get_world_size(self.dp_group)
        self.inter_instance_group = _inter_instance_group(self.pg_collection, ddp_config)
        self.comm_events: Optional[List[tuple]] = None
        if ddp_config.fp8_param_gather:
            check_fp8_param_gather(config, ddp_config)
            convert_weights_to_fp8(module)
        first_stage = self.pg_collection.rank_in("pp") == 0
        bucket_size = default_bucket_size(ddp_config, self.dp_size) if first_stage and not disable_bucketing else None
        self.bucket_size = bucket_size
        # Pre-scale by 1/dp unless the loss is a token sum or the division happens after the sum.
        self.pre_scale = (
            1.0 if config.calculate_per_token_loss or ddp_config.average_in_collective else 1.0 / self.dp_size
        )
        self.post_scale = (
            1.0 / self.dp_size if ddp_config.average_in_collective and not config.calculate_per_token_loss else 1.0
        )
        units = fsdp_unit_modules(module) if ddp_config.shard_params else []
        buffers = self._build_buffers(bucket_size, unit_of_params(units))
        self.buffers = [b for b in buffers if not b.is_expert]
        self.expert_parallel_buffers = [b for b in buffers if b.is_expert]
        self.bucket_groups = [BucketGroup([bucket]) for b in self.buffers for bucket in b.buckets]
        self.expert_parallel_bucket_groups = [
            BucketGroup([bucket]) for b in self.expert_parallel_buffers for bucket in b.buckets
        ]
        self.param_to_bucket_group = {
            p: group for group in self.bucket_groups + self.expert_parallel_bucket_groups for p in group.params
        }
        self.params_with_grad = [p for p in self.module.parameters() if p.requires_grad]
        self._buffer_of: Dict[int, ParamAndGradBuffer] = {id(p): b for b in self.all_buffers for p in b.params}
        self.is_last_microbatch = True
        self._zeroed: set = set()  # ids of params whose main_grad is known to be all zeros
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._accumulate_hook) for b in self.all_buffers for p in b.params
        ]
        self._param_gather_hooks: List[Any] = []
        # optim_grads_params: the units' own hooks gather the parameters (not the optimizer's step).
        self.fsdp_units = ShardedParamUnits(units, self.all_buffers) if ddp_config.shard_params else None
        if ddp_config.use_distributed_optimizer and self.fsdp_units is None:
            self.enable_forward_pre_hook()

    @property
    def all_buffers(self) -> List[ParamAndGradBuffer]:
        """Dense buffers, then expert-parallel ones: the order every rank reduces them in."""
        return self.buffers + self.expert_parallel_buffers

    def _build_buffers(self, bucket_size: Optional[int], unit_of: Dict[int, int]) -> List[ParamAndGradBuffer]:
        """One buffer per (param dtype, grad dtype, expert or not, kept whole or not); dense buffers first.

        Parameters marked ``KEEP_WHOLE_ATTR`` (Muon's matrices, by ``muon.keep_muon_params_whole``) get
        buffers of their own under the distributed optimizer, each lying whole in one DP rank's slice.

        ``unit_of`` (parameter id -> Megatron-FSDP unit, ``optim_grads_params``): no bucket spans two units.
        """
        params = [p for p in self.module.parameters() if p.requires_grad]
        shared = self._shared_embedding_ids()
        by_kind: Dict[tuple, List[torch.nn.Parameter]] = {}
        for param in reversed(params):
            # An FP8 weight's gradient has the dtype the weight had before it was stored in FP8.
            hp_dtype = param.fp8_meta.hp_dtype if is_fp8_param(param) else param.dtype
            grad_dtype = torch.float32 if self.ddp_config.grad_reduce_in_fp32 else hp_dtype
            whole = self.ddp_config.use_distributed_optimizer and getattr(param, KEEP_WHOLE_ATTR, False)
            by_kind.setdefault((is_expert_param(param), param.dtype, grad_dtype, whole), []).append(param)
        buffers = []
        for (expert, _, grad_dtype, whole), group in sorted(by_kind.items(), key=lambda item: item[0][0]):
            own = {i for i, p in enumerate(group) if id(p) in shared}
            buffers.append(
                ParamAndGradBuffer(
                    group,
                    grad_dtype,
                    bucket_size,
                    self._shard_group(expert),
                    with_param_data=self.ddp_config.use_distributed_optimizer,
                    own_bucket=own,
                    is_expert=expert,
                    starts=unit_starts(group, unit_of) if unit_of else frozenset(),
                    shard_grads=self.ddp_config.shard_grads,
                    shard_params=self.ddp_config.shard_params,
                    whole=whole,
                )
            )
        return buffers

    def _shard_group(self, expert: bool) -> dist.ProcessGroup:
        """The group a buffer is reduced (and sharded) over: all its data-parallel ranks, or this rank's
        distributed-optimizer instance's part of them."""
        if self.inter_instance_group is None:
            return self.pg_collection.expt_dp if expert else self.dp_group
        return self.pg_collection.intra_expt_dp if expert else self.pg_collection.intra_dp_cp

    def _param_gather_waits(self) -> List[Any]:
        """A forward pre-hook per module: wait for the all-gathers of the parameters its forward reads.

        Those are its direct parameters, every parameter below it when it reads its submodules'
        weights itself (``reads_submodule_parameters``: the grouped-GEMM experts), and parameters
        handed to it as arguments (the output layer's tied embedding weight). Buckets are in backward
        order, so the first module of the forward waits for the last bucket and the gathers of
        lower-indexed buckets keep running under its compute.
        """
        hooks = []
        for module in self.module.modules():
            buckets = self._buckets_of(self._params_read_by(module))
            hook = functools.partial(_wait_param_gathers, buckets, self._buckets_of)
            hooks.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        return hooks

    @staticmethod
    def _params_read_by(module: torch.nn.Module) -> Iterator[torch.nn.Parameter]:
        """The parameters ``module``'s own forward reads (besides those passed to it)."""
        return module.parameters(recurse=getattr(module, "reads_submodule_parameters", False))

    def _buckets_of(self, params: Iterable[Any]) -> List[Bucket]:
        """The buckets holding those of ``params`` that live in this wrapper's buffers, each once."""
        found: Dict[tuple, Bucket] = {}
        for param in params:
            buffer = self._buffer_of.get(id(param)) if isinstance(param, torch.nn.Parameter) else None
            if buffer is not None:
                bucket = buffer.bucket_of[id(param)]
                found[(id(buffer), bucket.index)] = bucket
        return list(found.values())

    def _shared_embedding_ids(self) -> set:
        # Under the distributed optimizer the tied embedding (and MTP's embedding copy) is summed across
        # pipeline stages after the reduce-scatter; alone in its bucket, its DP shard ranges agree on both stages.
        if not self.ddp_config.use_distributed_optimizer or self.pg_collection.size_of("pp") == 1:
            return set()
        getter = getattr(self.module, "cross_stage_embedding_weights", None)
        return {id(weight) for weight in getter()} if getter is not None else set()

    # --- backward hook ----------------------------------------------------------------
    def _accumulate_hook(self, param: torch.nn.Parameter) -> None:
        # A fused linear (gradient_accumulation_fusion) already added its weight gradient to
        # main_grad and handed autograd a dummy: add param.grad only when it is real (zero_out_wgrad:
        # the dummy was zeros, summed with the gradient of the weight's other user).
        # A main_grad still all zeros since zero_grad_buffer takes the gradient by copy: 0 + g is g,
        # and the copy does not read the zeros (one pass over the buffer fewer per step).
        fresh = id(param) in self._zeroed
        self._zeroed.discard(id(param))
        fused = getattr(param, "grad_added_to_main_grad", False)
        if param.grad is not None:
            if fresh and not fused:
                param.main_grad.copy_(param.grad)
            elif not fused or getattr(param, "zero_out_wgrad", False):
                param.main_grad.add_(param.grad)
            param.grad = None
        if fused:
            param.grad_added_to_main_grad = False
        if self.ddp_config.overlap_grad_reduce and self.is_last_microbatch:
            buffer = self._buffer_of[id(param)]
            bucket = buffer.bucket_of[id(param)]
            bucket.pending.discard(id(param))
            self._dispatch_ready(buffer)
        if self.fsdp_units is not None:
            self.fsdp_units.grad_ready(param)

    def _dispatch_ready(self, buffer: ParamAndGradBuffer) -> None:
        """Start, in index order, every bucket whose gradients are all accumulated."""
        for bucket in buffer.buckets:
            if bucket.dispatched:
                continue
            if bucket.pending:
                return
            self._start_bucket(buffer, bucket, async_op=True)

    # --- communication ----------------------------------------------------------------
    def _check_not_nan(self, bucket: Bucket) -> None:
        # NaN only: an inf under fp16 loss scaling is the scaler's business (the step is skipped).
        norm = bucket.grad_data.float().norm()
        if torch.isnan(norm):
            raise NonFiniteGradientError(
                f"rank {dist.get_rank()}: found NaN in the local gradient norm of bucket {bucket.index} "
                "before the data-parallel reduction (check_for_nan_in_grad)"
            )

    def _start_bucket(self, buffer: ParamAndGradBuffer, bucket: Bucket, async_op: bool) -> None:
        if self.ddp_config.check_for_nan_in_grad:
            self._check_not_nan(bucket)
        if self.pre_scale != 1.0:
            bucket.grad_data.mul_(self.pre_scale)
        bucket.dispatched = True
        if buffer.dp_size == 1:
            return
        if self.ddp_config.use_distributed_optimizer:
            shard = bucket.shard(bucket.grad_data, buffer.dp_rank, buffer.dp_size)
            bucket.handle = reduce_scatter_tensor(shard, bucket.grad_data, group=buffer.dp_group, async_op=async_op)
            self._record("reduce_scatter", buffer, bucket)
        else:
            bucket.handle = dist.all_reduce(bucket.grad_data, group=buffer.dp_group, async_op=async_op)

    def start_grad_sync(self, *unused: Any) -> None:
        """Dispatch every bucket not yet dispatched (asynchronously); arguments are ignored (hook use)."""
        for buffer in self.all_buffers:
            for bucket in buffer.buckets:
                if not bucket.dispatched:
                    self._start_bucket(buffer, bucket, async_op=True)

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False) -> None:
        """Complete the data-parallel reduction of every bucket (blocking).

        ``force_all_reduce`` (all-reduce instead of the distributed optimizer's reduce-scatter) is
        not supported yet; without the distributed optimizer it is what happens anyway.
        """
        if force_all_reduce and self.ddp_config.use_distributed_optimizer:
            raise NotImplementedError("finish_grad_sync(force_all_reduce=True) with the distributed optimizer")
        for buffer in self.all_buffers:
            across = []  # the reduced slices' all-reduces over the instances, running
            for bucket in buffer.buckets:
                if not bucket.dispatched:
                    # Without overlap, or a bucket with a parameter that got no gradient.
                    self._start_bucket(buffer, bucket, async_op=False)
                if bucket.handle is not None:
                    bucket.handle.wait()
                    bucket.handle = None
                    self._record("reduce_scatter_done", buffer, bucket)
                if self.inter_instance_group is not None:
                    across.append((bucket, self._all_reduce_across_instances(buffer, bucket)))
            for bucket, handle in across:
                handle.wait()
                self._record("all_reduce_instances_done", buffer, bucket)
            if self.post_scale != 1.0:
                buffer.scale_gradients(self.post_scale)
            buffer.reset()
        if self.fsdp_units is not None:
            self.fsdp_units.free_all()  # backward is over: only the shards stay

    def _all_reduce_across_instances(self, buffer: ParamAndGradBuffer, bucket: Bucket) -> dist.Work:
        """Start summing this rank's reduced slice of ``bucket`` with the same slice of the other
        distributed-optimizer instances (after the slice's reduce-scatter within the instance is done)."""
        shard = bucket.shard(bucket.grad_data, buffer.dp_rank, buffer.dp_size)  # [bucket numel / (dp / N)]
        self._record("all_reduce_instances", buffer, bucket)
        return dist.all_reduce(shard, group=self.inter_instance_group, async_op=True)

    def _record(self, what: str, buffer: ParamAndGradBuffer, bucket: Bucket) -> None:
        if self.comm_events is not None:
            self.comm_events.append((what, self.all_buffers.index(buffer), bucket.index))

    # --- public API -------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (earlier microbatches of a step)."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def zero_grad_buffer(self) -> None:
        """Zero all main grads and reset bucket state; call at the start of each iteration."""
        for param in self.module.parameters():
            param.grad = None
            # Created on every parameter, as Transformer Engine's fused weight-gradient accumulation expects
            # (it sets the flag when it wrote into main_grad); also clears one left set by a backward that raised.
            param.grad_added_to_main_grad = False
        for buffer in self.all_buffers:
            buffer.zero_grads()
            buffer.reset()
        self._zeroed = {id(p) for buffer in self.all_buffers for p in buffer.params}

    def scale_gradients(self, scaling_factor: Union[float, torch.Tensor]) -> None:
        """Multiply every main grad by ``scaling_factor`` (a 0-dim tensor: no host read)."""
        for buffer in self.all_buffers:
            buffer.scale_gradients(scaling_factor)

    def broadcast_params(self) -> None:
        """Make every DP rank's parameters equal to DP rank 0's (experts: expert-DP rank 0's)."""
        groups = self.pg_collection
        self.finish_param_sync()
        for param in self.module.parameters():
            name = "expt_dp" if is_expert_param(param) else "dp_cp"
            data = param.data.view(torch.uint8) if is_fp8_param(param) else param.data  # FP8 bytes
            dist.broadcast(data, src=groups.ranks[name][0], group=getattr(groups, name))
        for buffer in self.all_buffers:
            buffer.refresh_param_shards()  # optim_grads_params: the shards of the broadcast values

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """All-gather the distributed optimizer's updated parameters (asynchronously, last bucket first).

        ``force_sync`` waits for them; ``force_dispatch`` (upstream: dispatch even while the
        pre-hooks would) changes nothing here, where every gather is dispatched at once.
        """
        for buffer in self.all_buffers:
            buffer.start_param_gather()
        if force_sync:
            self.finish_param_sync()

    def enable_forward_pre_hook(self) -> None:
        """Make each module's forward wait for the all-gather of its own parameters (distributed optimizer)."""
        if not self.ddp_config.use_distributed_optimizer:
            raise ValueError("forward pre-hooks wait for parameter gathers: needs use_distributed_optimizer=True")
        if not self._param_gather_hooks:
            self._param_gather_hooks = self._param_gather_waits()

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Remove those pre-hooks; with ``param_sync`` gather and wait for every parameter now."""
        for hook in self._param_gather_hooks:
            hook.remove()
        self._param_gather_hooks = []
        if param_sync:
            self.start_param_sync(force_sync=True)

    def finish_param_sync(self) -> None:
        """Wait for every pending parameter all-gather (distributed optimizer with
        ``overlap_param_gather``; ``optim_grads_params``: gather every parameter); call before reading
        the parameters outside forward."""
        if self.fsdp_units is not None:
            self.fsdp_units.gather_all()
        for buffer in self.all_buffers:
            for bucket in buffer.buckets:
                bucket.finish_param_gather()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.fsdp_units is not None:  # optim_grads_params: the root's parameters, then the first layer's
            self.fsdp_units.gather(ROOT, wait=True)
            self.fsdp_units.gather(0, wait=False)
        return self.module(*args, **kwargs)  # each module's pre-hook waits for its parameters

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Dict[str, Any]:
        """The wrapped module's state dict, once pending parameter gathers have finished."""
        self.finish_param_sync()
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> Dict[str, Any]:
        """Megatron-core's name for ``state_dict`` at save time."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.finish_param_sync()
        return self.module.sharded_state_dict(*args, **kwargs)


def _inter_instance_group(
    groups: ProcessGroupCollection, ddp_config: DistributedDataParallelConfig
) -> Optional[dist.ProcessGroup]:
    """The group joining this rank's distributed-optimizer instance to the others (None with one instance).

    Raises:
        ValueError: the groups were built for another number of instances, or join ranks that are not this
            rank's dense and expert data-parallel peers.
    """
    instances = ddp_config.num_distributed_optimizer_instances
    if instances == 1:
        return None
    built = groups.layout.num_distributed_optimizer_instances
    if built != instances or groups.inter_dist_opt is None:
        raise ValueError(
            f"DistributedDataParallelConfig.num_distributed_optimizer_instances={instances}, but the process "
            f"groups were built for {built} instance(s) (ParallelLayout.num_distributed_optimizer_instances)"
        )
    across, dense, expert = (set(groups.ranks[name]) for name in ("inter_dist_opt", "dp_cp", "expt_dp"))
    if not across <= dense & expert:
        raise ValueError(f"inter_dist_opt ranks {sorted(across)} are not data-parallel peers of this rank")
    return groups.inter_dist_opt


def _wait_param_gathers(
    buckets: List[Bucket], buckets_of: Callable, module: torch.nn.Module, args: tuple, kwargs: dict
) -> None:
    """Forward pre-hook: the parameters ``module`` reads, and those passed to it, are current once
    their buckets are gathered."""
    for bucket in buckets + buckets_of([*args, *kwargs.values()]):
        bucket.finish_param_gather()
