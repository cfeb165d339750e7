"""Optimizers for Megatron models: param groups, mixed precision, the distributed optimizer.

Entry point: ``get_megatron_optimizer(config, model_chunks, pg_collection=groups)``. See
``optimizer.py`` for the step and the by-name checkpoint contract.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor

from megatron.core.distributed.param_and_grad_buffer import KEEP_WHOLE_ATTR
from megatron.core.optimizer.chained_optimizer import ChainedOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.fsdp2_optimizer import FullyShardedOptimizer
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from megatron.core.optimizer.muon import qkv_splits, split_muon_groups
from megatron.core.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
)
from megatron.core.optimizer.optimizer_config import AdamOptimizerConfig, OptimizerConfig, SGDOptimizerConfig
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.utils import unwrap_model

ParamCond = Callable[[str, torch.nn.Parameter], bool]

__all__ = [
    "AdamOptimizerConfig",
    "OptimizerConfig",
    "SGDOptimizerConfig",
    "MegatronOptimizer",
    "ChainedOptimizer",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "DistributedOptimizer",
    "FullyShardedOptimizer",
    "ConstantGradScaler",
    "DynamicGradScaler",
    "get_megatron_optimizer",
    "get_param_groups",
    "keep_muon_matrices_whole",
    "muon_matrices",
]


def _default_no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    # Biases and norm weights (all 1-D) are not decayed.
    return name.endswith(".bias") or param.dim() == 1


def _embedding_or_output_params(chunk: torch.nn.Module) -> set:
    """Ids of the word-embedding and output-layer weights (``decoupled_lr`` applies to them)."""
    ids = {id(p) for p in chunk.parameters() if getattr(p, "is_embedding_or_output_parameter", False)}
    model = unwrap_model(chunk)
    embedding = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    output = getattr(model, "output_layer", None)
    for module in (embedding, output):
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter):
            ids.add(id(weight))
    return ids


def muon_matrices(model_chunks: Sequence[torch.nn.Module]) -> List[torch.nn.Parameter]:
    """The parameters ``optimizer="muon"`` orthogonalises: trainable 2-D weights other than the word
    embedding and the output layer (those, norms and biases take AdamW)."""
    excluded = set().union(*(_embedding_or_output_params(chunk) for chunk in model_chunks))
    params = [p for chunk in model_chunks for p in unwrap_model(chunk).parameters()]
    return [p for p in params if p.requires_grad and p.dim() == 2 and id(p) not in excluded]


def keep_muon_matrices_whole(model_chunks: Sequence[torch.nn.Module]) -> None:
    """Mark the Muon matrices so that ``DistributedDataParallel`` with the distributed optimizer lays each
    one out whole inside one DP rank's slice (call before wrapping; Muon orthogonalises whole matrices)."""
    for param in muon_matrices(model_chunks):
        setattr(param, KEEP_WHOLE_ATTR, True)


def get_param_groups(
    model_chunks: Sequence[torch.nn.Module],
    config: OptimizerConfig,
    no_weight_decay_cond: Optional[ParamCond] = None,
    scale_lr_cond: Optional[ParamCond] = None,
    lr_mult: float = 1.0,
) -> List[Dict[str, Any]]:
    """Group trainable params by (wd_mult, lr_mult, is_decoupled_lr), with the scheduler's keys.

    Each group carries ``wd_mult``, ``lr_mult``, ``is_expert_parallel``, ``is_decoupled_lr``,
    ``max_lr``, ``min_lr`` (read by ``OptimizerParamScheduler``) and a starting ``lr`` /
    ``weight_decay`` so that the optimizer also works without a scheduler.
    """
    no_wd = no_weight_decay_cond or _default_no_weight_decay
    buckets: Dict[Tuple[float, float, bool], List[torch.nn.Parameter]] = {}
    seen = set()
    for chunk in model_chunks:
        decoupled_ids = _embedding_or_output_params(chunk) if config.decoupled_lr is not None else set()
        for name, param in unwrap_model(chunk).named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            wd_mult = 0.0 if no_wd(name, param) else 1.0
            group_lr_mult = lr_mult if scale_lr_cond is not None and scale_lr_cond(name, param) else 1.0
            key = (wd_mult, group_lr_mult, id(param) in decoupled_ids)
            buckets.setdefault(key, []).append(param)
    groups = []
    for (wd_mult, group_lr_mult, decoupled), params in buckets.items():
        max_lr = config.decoupled_lr if decoupled else config.lr
        min_lr = config.decoupled_min_lr if decoupled and config.decoupled_min_lr is not None else config.min_lr
        groups.append(
            {
                "params": params,
                "wd_mult": wd_mult,
                "lr_mult": group_lr_mult,
                "is_expert_parallel": False,
                "is_decoupled_lr": decoupled,
                "default_config": not decoupled and group_lr_mult == 1.0,  # follows the base LR schedule
                "max_lr": max_lr,
                "min_lr": min_lr,
                "lr": (max_lr or 0.0) * group_lr_mult,
                "weight_decay": config.weight_decay * wd_mult,
            }
        )
    return groups


def _grad_scaler(config: OptimizerConfig) -> Optional[MegatronGradScaler]:
    if not config.fp16:
        return None  # bf16 has fp32's range: no loss scaling (Megatron's choice)
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    return DynamicGradScaler(
        initial_scale=config.initial_loss_scale,
        min_scale=config.min_loss_scale,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=int(config.loss_scale_window),
        hysteresis=config.hysteresis,
    )


def _optimizer_instances(model_chunks: Sequence[torch.nn.Module]) -> int:
    """The distributed-optimizer instances the chunks' DDP wrappers reduce over (1 without a wrapper)."""
    counts = {getattr(getattr(c, "ddp_config", None), "num_distributed_optimizer_instances", 1) for c in model_chunks}
    if len(counts) > 1:
        raise ValueError(f"model chunks disagree on num_distributed_optimizer_instances: {sorted(counts)}")
    return counts.pop() if counts else 1


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: Sequence[torch.nn.Module],
    config_overrides: Optional[Dict[Any, Any]] = None,
    use_gloo_process_groups: bool = True,
    pg_collection: Optional[ProcessGroupCollection] = None,
    dump_param_to_param_group_map: Optional[str] = None,
    *,
    no_weight_decay_cond: Optional[ParamCond] = None,
    scale_lr_cond: Optional[ParamCond] = None,
    lr_mult: float = 1.0,
) -> MegatronOptimizer:
    """Build the optimizer for ``model_chunks`` (DDP-wrapped chunks for the distributed optimizer).

    Megatron-core 0.16's signature; ``pg_collection`` None means the groups of
    ``initialize_model_parallel``. ``use_gloo_process_groups`` only selects extra gloo groups for
    upstream's CPU-side checkpoint gathers: no effect (ours gather on each group's device).
    Per-parameter ``config_overrides`` and ``dump_param_to_param_group_map`` are not supported yet
    (``NotImplementedError``); the keyword-only ``no_weight_decay_cond`` / ``scale_lr_cond`` /
    ``lr_mult`` are Megatron's earlier way to vary weight decay and learning rate per parameter.

    ``optimizer="muon"`` splits each group into its 2-D weights (``muon_matrices``: Muon) and the rest
    (AdamW), one torch optimizer (``muon.MuonWithAdamW``) for both; with the distributed optimizer each
    matrix lies whole in one DP rank's slice (the chunks were marked by ``keep_muon_matrices_whole`` before
    wrapping), which alone orthogonalises it, and the parameter all-gather hands the result to the others.
    fp32 -> ``FP32Optimizer``; bf16/fp16 -> ``Float16OptimizerWithFloat16Params`` (fp16 with a
    loss scaler); ``use_distributed_optimizer`` -> ``DistributedOptimizer`` (any precision). With
    ``optimizer_cpu_offload`` each of them steps its fp32 main parameters through a
    ``HybridDeviceOptimizer``: the first ``optimizer_offload_fraction`` of their elements (this
    rank's shard with the distributed optimizer) and their Adam moments live on the host.
    Gradient statistics are summed over the model-parallel group (plus DP for the distributed
    optimizer, whose ranks hold different slices); those of expert parameters over
    ``tp_ep_pp`` (plus ``expt_dp``), since each expert-parallel rank holds other experts. With several
    distributed-optimizer instances (the chunks' ``ddp_config.num_distributed_optimizer_instances``)
    the optimizer shards, and sums statistics, over its instance's part of DP (``intra_dp_cp`` /
    ``intra_expt_dp``): every instance holds the whole all-reduced gradient.
    Chunks wrapped in FSDP2 (DTensor parameters) get ``FullyShardedOptimizer`` over their shards.
    """
    if config_overrides or dump_param_to_param_group_map is not None:
        raise NotImplementedError(
            "get_megatron_optimizer: config_overrides / dump_param_to_param_group_map not supported yet "
            "(use no_weight_decay_cond, scale_lr_cond and lr_mult)"
        )
    groups = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
    param_groups = get_param_groups(model_chunks, config, no_weight_decay_cond, scale_lr_cond, lr_mult)
    if config.optimizer == "muon":  # Muon for 2-D linear weights; embeddings and the output layer take AdamW
        splits = {}
        if config.muon_split_qkv:
            for chunk in model_chunks:
                splits.update(qkv_splits(unwrap_model(chunk)))
        param_groups = split_muon_groups(param_groups, {id(p) for p in muon_matrices(model_chunks)}, splits)
    tp_rank = groups.rank_in("tp")
    scaler = _grad_scaler(config)
    if _fully_sharded(model_chunks):
        return _fully_sharded_optimizer(config, param_groups, tp_rank, scaler, groups)
    if config.use_distributed_optimizer:
        # Several instances: each holds the whole reduced gradient, so statistics are summed within one.
        hybrid = _optimizer_instances(model_chunks) > 1
        dp_cp, expt_dp = (groups.intra_dp_cp, groups.intra_expt_dp) if hybrid else (groups.dp_cp, groups.expt_dp)
        return DistributedOptimizer(
            config,
            param_groups,
            tp_rank,
            [dp_cp, groups.mp],
            scaler,
            model_chunks=model_chunks,
            dp_group=dp_cp,
            expert_stat_groups=[expt_dp, groups.tp_ep_pp],
            instance_id=groups.rank_in("inter_dist_opt") if hybrid else 0,
            tp_groups=(groups.tp, groups.expt_tp),
        )
    expert_groups = [groups.tp_ep_pp]
    if config.fp16 or config.bf16:
        return Float16OptimizerWithFloat16Params(
            config, param_groups, tp_rank, [groups.mp], scaler, expert_groups, tp_groups=(groups.tp, groups.expt_tp)
        )
    return FP32Optimizer(
        config, param_groups, tp_rank, [groups.mp], None, expert_groups, tp_groups=(groups.tp, groups.expt_tp)
    )


def _fully_sharded(model_chunks: Sequence[torch.nn.Module]) -> bool:
    """The chunks' parameters are FSDP2's DTensor shards."""
    return any(isinstance(p, DTensor) for chunk in model_chunks for p in chunk.parameters())


def _fully_sharded_optimizer(
    config: OptimizerConfig,
    param_groups: List[Dict[str, Any]],
    tp_rank: int,
    scaler: Optional[MegatronGradScaler],
    groups: ProcessGroupCollection,
) -> FullyShardedOptimizer:
    """The optimizer over FSDP2 shards; statistics summed like the distributed optimizer's."""
    refused = [f"{name}={getattr(config, name)!r}" for name in ("use_distributed_optimizer",) if getattr(config, name)]
    if config.optimizer == "muon":
        refused.append("optimizer='muon'")
    if refused:
        raise ValueError(
            f"{', '.join(refused)}: FSDP2-wrapped chunks shard the optimizer state themselves "
            "(Muon would need whole matrices; not supported yet)"
        )
    return FullyShardedOptimizer(
        config,
        param_groups,
        tp_rank,
        [groups.dp_cp, groups.mp],
        scaler,
        expert_stat_groups=[groups.expt_dp, groups.tp_ep_pp],
    )
