"""Model chunks, data-parallel wrapping, optimizer and LR schedule from the flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, List

import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.distributed.torch_fully_sharded_data_parallel import (
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
)
from megatron.core.extensions.transformer_engine import te_import_error
from megatron.core.optimizer import get_megatron_optimizer, keep_muon_matrices_whole
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.pipeline_parallel.microbatch import get_model_config
from megatron.core.pipeline_parallel.tied_embeddings import sync_tied_embeddings
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import (
    data_parallel_config_from_args,
    optimizer_config_from_args,
    optimizer_param_scheduler_kwargs,
)
from megatron.training.utils import call_provider


@dataclass
class ModelAndOptimizer:
    """The model chunks (DDP-wrapped), their optimizer and its LR/WD schedule."""

    model: List[DistributedDataParallel]
    optimizer: Any
    scheduler: OptimizerParamScheduler


def build_model_chunks(
    model_provider: Callable,
    model_type: ModelType,
    args: argparse.Namespace,
    config: TransformerConfig,
    groups: ProcessGroupCollection,
) -> List[torch.nn.Module]:
    """One model per virtual pipeline chunk held by this rank (one chunk without interleaving)."""
    report_transformer_impl(config)
    vp = args.virtual_pipeline_model_parallel_size
    pp_rank, pp_size = groups.rank_in("pp"), groups.size_of("pp")
    chunks = []
    for stage in range(vp or 1):
        # Megatron-LM passes vp_stage only to providers that declare it; here it is required under
        # virtual pipelining (without it every chunk would build the first chunk's layers).
        virtual = {"vp_stage": stage} if vp else {}
        model = call_provider(
            model_provider,
            pre_process=pp_rank == 0 and stage == 0,
            post_process=pp_rank == pp_size - 1 and stage == (vp or 1) - 1,
            **virtual,
            offered={"config": config, "args": args, "pg_collection": groups, "vp_stage": None},
        )
        model.model_type = model_type
        if torch.cuda.is_available():
            # Parameters not created by the TP layers (norms, position embeddings, rotary
            # buffers) start on the host; the whole chunk lives on this rank's GPU.
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def report_transformer_impl(config: TransformerConfig) -> None:
    """One line on global rank 0 when ``--transformer-impl transformer_engine`` falls back to the local layers."""
    impl = getattr(config, "transformer_impl", None)  # None: a provider that builds its own config
    if impl != "transformer_engine" or (dist.is_initialized() and dist.get_rank() != 0):
        return
    reason = te_import_error()
    if reason is not None:
        print(
            f" > --transformer-impl transformer_engine: Transformer Engine does not import here ({reason}); "
            "running the local layers (same parameters; FP8/FP4 through megatron.core.quantization)",
            flush=True,
        )


def _report_parameters(chunks: List[torch.nn.Module], groups: ProcessGroupCollection) -> None:
    if groups.rank_in("dp") == 0:
        count = sum(p.numel() for c in chunks for p in c.parameters())
        print(
            f" > number of parameters on (tensor, pipeline) model parallel rank "
            f"({groups.rank_in('tp')}, {groups.rank_in('pp')}): {count}",
            flush=True,
        )


def _wrap(
    chunks: List[torch.nn.Module], args: argparse.Namespace, config: TransformerConfig, groups: ProcessGroupCollection
) -> List[torch.nn.Module]:
    """Each chunk in DistributedDataParallel, or in FSDP2 with ``--use-torch-fsdp2``; with ``--optimizer muon``
    and the distributed optimizer each Muon matrix is laid out whole in one DP rank's slice."""
    ddp_config = data_parallel_config_from_args(args)
    if isinstance(ddp_config, TorchFullyShardedDataParallelConfig):
        return [TorchFullyShardedDataParallel(config, ddp_config, chunk, pg_collection=groups) for chunk in chunks]
    if args.optimizer == "muon" and ddp_config.use_distributed_optimizer:
        keep_muon_matrices_whole(chunks)
    return [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0, pg_collection=groups)
        for i, chunk in enumerate(chunks)
    ]


def setup_model_and_optimizer(
    model_provider: Callable,
    model_type: ModelType,
    args: argparse.Namespace,
    config: TransformerConfig,
    groups: ProcessGroupCollection,
) -> ModelAndOptimizer:
    """Build, tie, wrap and hand over the model chunks with an optimizer and a schedule.

    The chunks' config gets the hooks the pipeline schedule calls: loss scaling, no-sync
    for all but the last micro batch, and ``finalize_model_grads`` after the last backward.
    """
    chunks = build_model_chunks(model_provider, model_type, args, config, groups)
    _report_parameters(chunks, groups)
    sync_tied_embeddings(chunks, groups)
    wrapped = _wrap(chunks, args, config, groups)
    for chunk in wrapped:
        chunk.broadcast_params()
    optimizer = get_megatron_optimizer(optimizer_config_from_args(args), wrapped, pg_collection=groups)
    scheduler = OptimizerParamScheduler(optimizer, **optimizer_param_scheduler_kwargs(args))
    # The schedule reads the chunks' own config, which a provider may have derived from ``config``
    # (T5 builds encoder and decoder copies): both get the hooks.
    for target in {id(c): c for c in (config, get_model_config(wrapped))}.values():
        target.grad_scale_func = optimizer.scale_loss
        target.finalize_model_grads_func = lambda model_chunks, num_tokens=None: finalize_model_grads(
            model_chunks, num_tokens, pg_collection=groups
        )
        target.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    dist.barrier()
    return ModelAndOptimizer(wrapped, optimizer, scheduler)
