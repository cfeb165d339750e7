"""``pretrain()``: the one training loop every entry point shares.

Start up (flags, process groups, seeds), build the tokenizer and, once, the run's configs
(``RunConfigs``: training, checkpoint, logging, FLOPs), then the model chunks, optimizer, LR
schedule and data, optionally resume, then per iteration: one call of the pipeline schedule
returned by ``get_forward_backward_func`` (no pipelining when PP=1), one optimizer step, logging,
evaluation, checkpoints and exit checks. The loop always holds a list of model chunks, so pipeline
and virtual pipeline layouts change nothing here. Only start-up (``pretrain``, ``_build_loop``)
reads the parsed flags; the loop reads its configs (``tests/unit_tests/training/test_loop_configs.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.async_save import AsyncCallsQueue
from megatron.core.distributed import NonFiniteGradientError
from megatron.core.num_microbatches_calculator import NumMicroBatchesCalculator
from megatron.core.optimizer.clip_grads import counts_for_norm, get_grad_norm_fp32
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func, get_model_config
from megatron.core.quantization import fp8_params
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker, use_rng_tracker
from megatron.core.timers import Timers
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.moe.moe_utils import AuxLossTracker, aux_loss_pairs, use_aux_loss_tracker
from megatron.core.utils import comm_device
from megatron.training.arguments import (
    core_transformer_config_from_args,
    run_configs_from_args,
    straggler_config_from_args,
    vocabulary_check_from_args,
)
from megatron.training.checkpointing import (
    args_to_plain_data,
    collect_rng_state,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from megatron.training.data import DataIterators, build_data_iterators
from megatron.training.global_vars import set_global_variables
from megatron.training.initialize import RunState, initialize_run, shutdown_distributed
from megatron.training.model_setup import ModelAndOptimizer, setup_model_and_optimizer
from megatron.training.preflight import reported_once
from megatron.training.signal_handler import DistributedSignalHandler
from megatron.training.straggler import StragglerDetector
from megatron.training.tokenizer import build_tokenizer_from_args
from megatron.training.training_config import RunConfigs, TrainingConfig
from megatron.training.training_log import (
    IterationStats,
    TrainingLogger,
    num_floating_point_operations,
)
from megatron.training.utils import call_provider


@dataclass
class TrainState:
    """Progress that a checkpoint carries and a resumed run continues from."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    floating_point_operations_so_far: float = 0.0


def reduce_losses(per_microbatch: List[Dict[str, torch.Tensor]], groups: ProcessGroupCollection) -> Dict[str, float]:
    """Average each reported loss over micro batches and data-parallel ranks, per token.

    Entries are ``[sum, count]`` pairs (or already-averaged scalars, counted once); the
    sums and counts are added over micro batches and over DP before dividing, so the
    result equals the one-rank value for the same global batch.
    """
    if not per_microbatch:
        return {}
    totals: Dict[str, torch.Tensor] = {}
    for entry in per_microbatch:
        for key, value in entry.items():
            value = value.detach().float().view(-1)
            pair = value if value.numel() == 2 else torch.stack([value[0], torch.ones_like(value[0])])
            totals[key] = totals.get(key, torch.zeros(2, device=pair.device)) + pair
    keys = sorted(totals)
    stacked = torch.stack([totals[k] for k in keys])  # [keys, 2]
    dist.all_reduce(stacked, group=groups.dp_cp)
    return dict(zip(keys, (stacked[:, 0] / stacked[:, 1]).tolist()))  # one device-to-host copy for all keys


def params_l2_norm(model_chunks: List[torch.nn.Module], groups: ProcessGroupCollection) -> float:
    """L2 norm of all parameters of the model, each counted once across TP replicas and tied copies."""
    for chunk in model_chunks:
        if hasattr(chunk, "finish_param_sync"):
            chunk.finish_param_sync()  # an overlapped all-gather may still be filling them
    tp_rank = groups.rank_in("tp")
    params = [p for chunk in model_chunks for p in chunk.parameters() if counts_for_norm(p, tp_rank)]
    params = [fp8_params.dequantize(p) if fp8_params.is_fp8_param(p) else p for p in params]  # real values
    return get_grad_norm_fp32(params, [groups.mp])


@contextlib.contextmanager
def rng_untouched(tracker: CudaRNGStatesTracker) -> Iterator[None]:
    """Run a block that must not move any generator the training steps draw from.

    Building data iterators (a DataLoader draws its workers' base seed from the default
    generator, also when an evaluation iterator starts lazily), opening log writers,
    evaluating and saving happen at different points of a straight and a resumed run, so
    they leave python, NumPy, torch CPU/CUDA and the tracked model-parallel states as they
    found them: dropout then draws the same numbers whether or not a run was resumed.
    ``tracker`` is the run's model-parallel RNG tracker.
    """
    saved = collect_rng_state(tracker)
    try:
        yield
    finally:
        restore_rng_state(saved, tracker)


@dataclass
class Loop:
    """Everything one run's iterations need, bundled so helpers take one argument.

    ``configs`` are the run's settings, built once after start-up: the loop never reads the flags.
    ``run`` holds the run's own groups, microbatch calculator, aux-loss and RNG trackers
    (``initialize_run``): the loop passes them on and never reads Megatron's module-level accessors.
    """

    configs: RunConfigs
    run: RunState
    forward_step_func: Callable
    built: ModelAndOptimizer
    data: DataIterators
    state: TrainState
    logger: TrainingLogger
    timers: Timers
    process_non_loss_data_func: Optional[Callable] = None  # pretrain()'s: (collected, iteration, writer)
    async_queue: Optional[AsyncCallsQueue] = None  # --async-save: the background checkpoint writer
    straggler: Optional[StragglerDetector] = None  # --log-straggler

    @property
    def train_iters(self) -> int:
        """--train-iters, or what --train-samples takes (``TrainingConfig.train_iters``)."""
        return self.configs.training.train_iters

    @property
    def groups(self) -> ProcessGroupCollection:
        return self.run.groups

    @property
    def microbatches(self) -> NumMicroBatchesCalculator:
        return self.run.microbatches

    @property
    def aux_losses(self) -> AuxLossTracker:
        return self.run.aux_losses

    @property
    def rng_tracker(self) -> CudaRNGStatesTracker:
        return self.run.rng_tracker

    def schedule(
        self, data_iterator: List, forward_only: bool, collect_non_loss_data: bool = False
    ) -> List[Dict[str, torch.Tensor]]:
        chunks, cfg = self.built.model, self.configs.training
        schedule = get_forward_backward_func(
            self.groups.size_of("pp"), self.groups.layout.virtual_pipeline_model_parallel_size
        )
        return schedule(
            forward_step_func=self.forward_step_func,
            data_iterator=data_iterator if len(chunks) > 1 else data_iterator[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=self.microbatches.get(),
            seq_length=cfg.seq_length,
            micro_batch_size=cfg.micro_batch_size,
            decoder_seq_length=cfg.decoder_seq_length,
            forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data,
            pg_collection=self.groups,
        )


def train_step(loop: Loop) -> tuple:
    """One iteration: zero grads, forward/backward over all micro batches, optimizer step.

    The reported losses include the MoE aux losses (``load_balancing_loss``, ``z_loss``) as
    Megatron logs them: without their coefficient, averaged over MoE layers, microbatches
    and data-parallel ranks (``aux_loss_pairs``; reduced with the main losses in one all-reduce).
    """
    built, timers, barrier = loop.built, loop.timers, loop.configs.logging.barrier_with_L1_time
    for chunk in built.model:
        chunk.zero_grad_buffer()
    built.optimizer.zero_grad()
    loop.aux_losses.clear()
    timers("forward-backward", log_level=1).start(barrier=barrier)
    with loop.straggler.forward_backward() if loop.straggler is not None else contextlib.nullcontext():
        losses = loop.schedule(loop.data.train, forward_only=False)
    timers("forward-backward").stop()
    aux_losses = aux_loss_pairs(get_model_config(built.model), loop.groups, loop.microbatches.get(), loop.aux_losses)
    timers("optimizer", log_level=1).start(barrier=barrier)
    success, grad_norm, num_zeros = built.optimizer.step()
    timers("optimizer").stop()
    if success:
        built.scheduler.step(increment=loop.microbatches.get_current_global_batch_size())
    reported = losses + [aux_losses] if losses and aux_losses else losses  # last stage: add the aux pairs
    return reduce_losses(reported, loop.groups), (0 if success else 1), grad_norm, num_zeros


@contextlib.contextmanager
def _eval_mode(model_chunks: List[torch.nn.Module]) -> Iterator[None]:
    """The chunks in eval mode without autograd for the block, in training mode after it."""
    for chunk in model_chunks:
        chunk.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for chunk in model_chunks:
            chunk.train()


def evaluate(loop: Loop, iterators: List, num_iters: int) -> Dict[str, float]:
    """Forward-only passes over ``num_iters`` global batches; per-token averaged losses."""
    collected: List[Dict[str, torch.Tensor]] = []
    with _eval_mode(loop.built.model):
        for _ in range(num_iters):
            collected.extend(loop.schedule(iterators, forward_only=True))
    return reduce_losses(collected, loop.groups)


def collect_non_loss_data(loop: Loop, iterators: List) -> List[Any]:
    """One more forward-only global batch, as Megatron runs for ``process_non_loss_data_func``.

    Each microbatch's ``loss_func(output, non_loss_data=True)`` result, on the last pipeline stage
    (``[]`` elsewhere). Every rank runs the forward: the model's collectives need them all
    (Megatron runs it on the last rank alone, which only works without model parallelism).
    """
    with _eval_mode(loop.built.model):
        return loop.schedule(iterators, forward_only=True, collect_non_loss_data=True)


def _evaluate_and_log(loop: Loop, prefix: str, iterators: Optional[List], final: bool = False) -> None:
    eval_iters = loop.configs.training.eval_iters
    if iterators is None or eval_iters <= 0:
        return
    process = loop.process_non_loss_data_func
    with rng_untouched(loop.rng_tracker):
        losses = evaluate(loop, iterators, eval_iters)
        non_loss_data = collect_non_loss_data(loop, iterators) if process is not None else None
    if prefix == "validation":  # the extra batch too: a resumed run reads the samples the straight run reads
        batches = eval_iters + (non_loss_data is not None)
        loop.state.consumed_valid_samples += batches * loop.microbatches.get_current_global_batch_size()
    loop.logger.evaluation_log(loop.state.iteration, prefix, losses, final=final)
    if process is not None and dist.get_rank() == dist.get_world_size() - 1:
        process(non_loss_data, loop.state.iteration, loop.logger.writers.tensorboard)


def _save(loop: Loop, non_persistent: bool = False) -> None:
    built = loop.built
    with rng_untouched(loop.rng_tracker):
        save_checkpoint(
            loop.state.iteration,
            built.model,
            built.optimizer,
            built.scheduler,
            loop.configs.checkpoint,
            train_state=asdict(loop.state),
            args_dict=loop.configs.saved_args,
            pg_collection=loop.groups,
            rng_tracker=loop.rng_tracker,
            async_queue=loop.async_queue,
            non_persistent=non_persistent,
        )


def _should_exit(loop: Loop, start_time: float, handler: Optional[DistributedSignalHandler]) -> Optional[str]:
    """Why the run must stop after this iteration, agreed by all ranks (or None).

    A signal and the time limit may reach ranks at different steps: one MAX all-reduce
    per iteration makes every rank take the same decision.
    """
    cfg = loop.configs.training
    if handler is not None or cfg.exit_duration_in_mins:  # the same on every rank: all or none reduce
        reason = _agreed_stop(handler, cfg.exit_duration_in_mins, start_time)
        if reason is not None:
            return reason
    if cfg.exit_interval and loop.state.iteration % cfg.exit_interval == 0:
        return "interval"
    return None


def _agreed_stop(
    handler: Optional[DistributedSignalHandler], limit_mins: Optional[int], start_time: float
) -> Optional[str]:
    local = [
        handler is not None and handler.received,
        bool(limit_mins) and (time.time() - start_time) / 60.0 > limit_mins,
    ]
    flags = torch.tensor([int(f) for f in local], device=comm_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[0].item():
        return "signal"
    return "duration" if flags[1].item() else None


def _group_lr(optimizer: Any, decoupled: bool) -> Optional[float]:
    """Current LR of the first param group with (or without) ``--decoupled-lr``; None if there is none."""
    for group in optimizer.param_groups:
        if bool(group.get("is_decoupled_lr", False)) == decoupled:
            return group["lr"]
    return None


def _log_iteration(
    loop: Loop,
    losses: Dict[str, float],
    skipped: int,
    grad_norm: Optional[float],
    num_zeros: Optional[int],
    elapsed_ms: float,
) -> None:
    state, built, configs = loop.state, loop.built, loop.configs
    batch = loop.microbatches.get_current_global_batch_size()
    stats = IterationStats(
        iteration=state.iteration,
        train_iters=loop.train_iters,
        losses=losses,
        learning_rate=_group_lr(built.optimizer, decoupled=False),
        decoupled_lr=_group_lr(built.optimizer, True),
        loss_scale=float(built.optimizer.get_loss_scale()),
        grad_norm=grad_norm,
        params_norm=params_l2_norm(built.model, loop.groups) if configs.logging.log_params_norm else None,
        num_zeros=num_zeros,
        skipped=bool(skipped),
        consumed_samples=state.consumed_train_samples,
        global_batch_size=batch,
        elapsed_ms_per_iter=elapsed_ms,
        flops_per_iter=num_floating_point_operations(configs.flops, batch),
        seq_length=configs.training.seq_length,
    )
    loop.logger.training_log(stats, loop.timers)


def _saves_now(loop: Loop, non_persistent: bool = False) -> bool:
    """Whether this iteration is a multiple of --save-interval (or --non-persistent-save-interval), with --save."""
    ckpt = loop.configs.checkpoint
    interval = ckpt.non_persistent_save_interval if non_persistent else ckpt.save_interval
    return bool(ckpt.save and interval and loop.state.iteration % interval == 0)


def _signal_handler(cfg: TrainingConfig) -> Any:
    """The --exit-signal handler under --exit-signal-handler, else a context that does nothing."""
    return DistributedSignalHandler(cfg.exit_signal) if cfg.exit_signal_handler else contextlib.nullcontext()


def train(loop: Loop) -> Optional[str]:
    """Iterate until ``--train-iters``/``--train-samples`` or an exit condition; returns the exit reason."""
    cfg, state = loop.configs.training, loop.state
    start_time = time.time()
    with _signal_handler(cfg) as handler:
        while state.iteration < loop.train_iters:
            loop.microbatches.update(state.consumed_train_samples, consistency_check=True)
            t0 = time.time()
            timed = loop.straggler.step(state.iteration + 1) if loop.straggler is not None else contextlib.nullcontext()
            try:
                with timed:
                    losses, skipped, grad_norm, num_zeros = train_step(loop)
            except NonFiniteGradientError as err:
                raise NonFiniteGradientError(f"iteration {state.iteration + 1}: {err}") from err
            state.iteration += 1
            batch = loop.microbatches.get_current_global_batch_size()
            state.consumed_train_samples += batch
            state.floating_point_operations_so_far += num_floating_point_operations(loop.configs.flops, batch)
            _log_iteration(loop, losses, skipped, grad_norm, num_zeros, (time.time() - t0) * 1000.0)
            if loop.async_queue is not None:  # publish saves whose files every rank has written
                loop.async_queue.maybe_finalize_async_calls(blocking=False)
            if cfg.eval_interval and state.iteration % cfg.eval_interval == 0 and not cfg.skip_train:
                _evaluate_and_log(loop, "validation", loop.data.valid)
            saved = _saves_now(loop)
            if saved:
                _save(loop)
            elif _saves_now(loop, non_persistent=True) and state.iteration < loop.train_iters:  # the end saves anyway
                _save(loop, non_persistent=True)
            reason = _should_exit(loop, start_time, handler)
            if reason is not None:
                if loop.configs.checkpoint.save and not saved:
                    _save(loop)
                return reason
    return None


def pretrain(
    train_valid_test_dataset_provider: Callable,
    model_provider: Callable,
    model_type: ModelType,
    forward_step_func: Callable,
    process_non_loss_data_func: Optional[Callable] = None,
    extra_args_provider: Optional[Callable] = None,
    args_defaults: Optional[Dict[str, Any]] = None,
    argv: Optional[List[str]] = None,
    entry_point: str = "gpt",
) -> TrainState:
    """Parse flags, build everything, train, evaluate, save. Returns the final train state.

    ``process_non_loss_data_func(collected, iteration, tensorboard_writer)`` is called, as in
    Megatron, on the last rank after each evaluation (every ``--eval-interval`` iterations and at
    the end, validation and test) with what ``collect_non_loss_data`` gathered: the forward step's
    ``loss_func`` must then accept ``non_loss_data=True``. The writer is None without TensorBoard.
    """
    with reported_once():  # a mistake in the flags or inputs: one message on one rank, no traceback
        args, run = initialize_run(argv, extra_args_provider, args_defaults or {}, entry_point, training=True)
        tokenizer = build_tokenizer_from_args(args)  # pads the vocabulary the FLOPs config reads
        set_global_variables(args, tokenizer)
        configs = run_configs_from_args(args, saved_args=args_to_plain_data(args))  # once: the loop reads only these
        with use_rng_tracker(run.rng_tracker):  # the run's own streams behind get_cuda_rng_tracker()
            loop = _build_loop(
                args,
                configs,
                run,
                tokenizer,
                train_valid_test_dataset_provider,
                model_provider,
                model_type,
                forward_step_func,
            )
            loop.process_non_loss_data_func = process_non_loss_data_func
            _run_loop(loop)
    shutdown_distributed()  # on success only: after an error, peers may still hold in-flight work
    return loop.state


def _build_loop(
    args: argparse.Namespace,
    configs: RunConfigs,
    run: RunState,
    tokenizer: Any,
    train_valid_test_dataset_provider: Callable,
    model_provider: Callable,
    model_type: ModelType,
    forward_step_func: Callable,
) -> Loop:
    """Model and optimizer, the checkpoint to resume from, data iterators and log writers.

    ``args`` only reach the providers that declare them (Megatron's signatures) and the model's
    config; everything else reads ``configs``.
    """
    groups = run.groups
    config = core_transformer_config_from_args(args)
    timers = Timers(configs.logging.timing_log_level, configs.logging.timing_log_option)
    built = setup_model_and_optimizer(model_provider, model_type, args, config, groups)
    use_aux_loss_tracker(built.model, run.aux_losses)
    state = TrainState()
    if configs.checkpoint.load:
        iteration, saved_state = load_checkpoint(
            built.model,
            built.optimizer,
            built.scheduler,
            configs.checkpoint,
            pg_collection=groups,
            run_args=configs.saved_args,
            rng_tracker=run.rng_tracker,
        )
        state = TrainState(**{**asdict(TrainState()), **(saved_state or {}), "iteration": iteration})
    provider = lambda sizes: call_provider(  # noqa: E731 - adapts Megatron's provider signature
        train_valid_test_dataset_provider,
        sizes,
        offered={"args": args, "tokenizer": tokenizer, "pg_collection": groups},
    )
    with rng_untouched(run.rng_tracker):  # the state seeded at start-up, or restored, is what step 1 sees
        data = build_data_iterators(
            provider,
            configs.training,
            groups,
            len(built.model),
            state.consumed_train_samples,
            state.consumed_valid_samples,
            vocabulary_check_from_args(args),
        )
        logger = TrainingLogger(configs.logging, dist.get_rank(), dist.get_world_size())
    loop = Loop(configs, run, forward_step_func, built, data, state, logger, timers)
    if configs.checkpoint.save and configs.checkpoint.async_save:
        loop.async_queue = AsyncCallsQueue(persistent=configs.checkpoint.use_persistent_ckpt_worker)
    if args.log_straggler:
        loop.straggler = StragglerDetector(straggler_config_from_args(args))
        model_config = get_model_config(built.model)  # the schedule's: its gradient sync is timed apart
        model_config.finalize_model_grads_func = loop.straggler.wrap_gradient_sync(
            model_config.finalize_model_grads_func
        )
    return loop


def _run_loop(loop: Loop) -> None:
    """Train (saving at the end unless just saved), then evaluate on validation and test."""
    state = loop.state
    try:
        reason = None
        if not loop.configs.training.skip_train and loop.train_iters > state.iteration:
            reason = train(loop)
            if reason is None and loop.configs.checkpoint.save and not _saves_now(loop):
                _save(loop)
        if loop.async_queue is not None:  # exit waits for the running save and publishes it
            loop.async_queue.close()
        if reason is None:
            _evaluate_and_log(loop, "validation", loop.data.valid, final=True)
            _evaluate_and_log(loop, "test", loop.data.test, final=True)
    finally:
        loop.logger.close()
        if loop.straggler is not None:
            loop.straggler.close()
