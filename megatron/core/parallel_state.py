"""Megatron's module-level parallel state, as a facade over one ``ProcessGroupCollection``.

``initialize_model_parallel`` builds a collection (``megatron.core.process_groups``), keeps it as
the process-wide default and exposes it through Megatron's getters, so code written against Megatron
Core keeps working. Core modules never look the default up on their own: internal modules require
their groups, and public functions whose Megatron signature keeps ``pg_collection=None`` /
``tp_group=None`` resolve it through ``ProcessGroupCollection.use_mpu_process_groups()`` or
``get_tensor_model_parallel_group_if_none()`` (both raise if nothing was built).

As in Megatron, the ``set_*`` functions override what the matching size/rank getters return
(a layer run "as if" on a given TP rank without groups); ``destroy_model_parallel`` clears them.
"""

from __future__ import annotations

import warnings
from dataclasses import fields
from datetime import timedelta
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

from megatron.core.memory_buffer import destroy_global_memory_buffer, get_global_memory_buffer
from megatron.core.process_groups import (
    GLOO_GROUP_NAMES,
    LayoutError,
    ParallelLayout,
    ParallelStateError,
    ProcessGroup,
    ProcessGroupCollection,
    build_gloo_data_parallel_groups,
    build_process_groups,
    create_group,
    create_hierarchical_groups,
    default_process_groups,
    destroy_groups,
    forbid_default_process_groups,
    get_nccl_options,
    get_tensor_model_parallel_group_if_none,
    has_default_process_groups,
    overwrite_nccl_comm_cfgs,
    refuse_unsupported_options,
    set_default_process_groups,
    update_pg_timeout,
    warn_sequence_parallel_without_tp,
)
from megatron.core.rank_grid import RankGenerator, generate_masked_orthogonal_rank_groups
from megatron.core.rank_grid import embedding_ranks as default_embedding_ranks
from megatron.core.rank_grid import position_embedding_ranks as default_position_embedding_ranks

__all__ = [  # the re-exports; the facade functions are added at the end
    "LayoutError",
    "ParallelLayout",
    "ParallelStateError",
    "ProcessGroupCollection",
    "RankGenerator",
    "build_process_groups",
    "create_group",
    "create_hierarchical_groups",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    "default_process_groups",
    "destroy_global_memory_buffer",
    "get_global_memory_buffer",
    "forbid_default_process_groups",
    "generate_masked_orthogonal_rank_groups",
    "get_nccl_options",
    "get_tensor_model_parallel_group_if_none",
    "overwrite_nccl_comm_cfgs",
    "update_pg_timeout",
    "warn_sequence_parallel_without_tp",
]


# Overrides set by the set_* functions: key -> value (absent: read the groups).
_OVERRIDES: Dict[str, int] = {}
_VIRTUAL_PIPELINE_RANK: Optional[int] = None
_VIRTUAL_PIPELINE_WORLD_SIZE: Optional[int] = None
_GLOO_GROUPS: Optional[Dict[str, ProcessGroup]] = None  # data-parallel groups over gloo
_BUILT: List[Optional[ProcessGroup]] = []  # the groups initialize_model_parallel created (gloo copies too)


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_comm_backend: Optional[str] = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[List[int]] = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    nccl_communicator_config_path: Optional[str] = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
    get_position_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: Optional[List[str]] = None,
    sharp_enabled_group: Optional[str] = None,
    create_all_gather_group: Optional[bool] = False,
) -> ProcessGroupCollection:
    """Build Megatron's rank grid and groups and make them the process default (Megatron's signature).

    Returns the collection (Megatron returns None), which core modules should receive explicitly.

    Raises:
        AssertionError: torch.distributed is not initialized, or groups already exist.
        LayoutError: (a ``RuntimeError`` and ``ValueError``) the sizes do not fit the world.
        ValueError: an argument we do not support yet has a non-default value.
    """
    global _VIRTUAL_PIPELINE_RANK, _VIRTUAL_PIPELINE_WORLD_SIZE, _GLOO_GROUPS
    refuse_unsupported_options(
        pipeline_model_parallel_comm_backend=pipeline_model_parallel_comm_backend,
        use_sharp=use_sharp,
        hybrid_context_parallel=hybrid_context_parallel,
        nccl_communicator_config_path=nccl_communicator_config_path,
        high_priority_stream_groups=high_priority_stream_groups,
        sharp_enabled_group=sharp_enabled_group,
        create_all_gather_group=create_all_gather_group,
    )
    if not dist.is_initialized():
        raise ParallelStateError("torch.distributed is not initialized: call torch.distributed.init_process_group")
    if has_default_process_groups():
        raise ParallelStateError("model parallel groups are already initialized; call destroy_model_parallel() first")
    layout = ParallelLayout(
        world_size=dist.get_world_size(),
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        order=order,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes or None,
    )
    timeout = timedelta(minutes=distributed_timeout_minutes)
    groups = build_process_groups(layout, timeout, None, get_embedding_ranks, get_position_embedding_ranks)
    _GLOO_GROUPS = None
    if create_gloo_process_groups:  # gloo copies of the data-parallel groups only, and only over NCCL
        if dist.get_backend() == "nccl":
            _GLOO_GROUPS = build_gloo_data_parallel_groups(layout, timeout)
            _BUILT.extend(_GLOO_GROUPS.values())
        else:  # the groups are gloo (or CPU-capable) already
            _GLOO_GROUPS = {name: getattr(groups, name) for name in GLOO_GROUP_NAMES}
    _BUILT.extend(getattr(groups, item.name) for item in fields(groups))
    _BUILT.extend(groups.hcp or ())
    # Every rank has finished creating every group once it leaves this barrier, so a peer's
    # destroy_model_parallel never closes a group another rank is still connecting.
    dist.barrier()
    set_default_process_groups(groups)
    _VIRTUAL_PIPELINE_RANK = 0 if virtual_pipeline_model_parallel_size is not None else None
    _VIRTUAL_PIPELINE_WORLD_SIZE = virtual_pipeline_model_parallel_size
    return groups


def is_initialized() -> bool:
    """Whether the default groups exist (Megatron: the data-parallel group)."""
    return has_default_process_groups()


def is_unitialized() -> bool:
    """Deprecated upstream spelling of ``not is_initialized()``."""
    warnings.warn("is_unitialized is deprecated, use is_initialized instead", DeprecationWarning, stacklevel=2)
    return not is_initialized()


def model_parallel_is_initialized() -> bool:
    """Whether ``initialize_model_parallel`` has built the default groups."""
    return has_default_process_groups()


def destroy_model_parallel() -> None:
    """Destroy the groups ``initialize_model_parallel`` built (gloo twins too); forget every override.

    Groups installed or created otherwise are left alone; a collection returned by
    ``initialize_model_parallel`` must not be used after this call.
    """
    global _VIRTUAL_PIPELINE_RANK, _VIRTUAL_PIPELINE_WORLD_SIZE, _GLOO_GROUPS
    set_default_process_groups(None)
    destroy_groups(_BUILT)
    _BUILT.clear()
    destroy_global_memory_buffer()
    _OVERRIDES.clear()
    _VIRTUAL_PIPELINE_RANK = _VIRTUAL_PIPELINE_WORLD_SIZE = _GLOO_GROUPS = None


# ----------------------------------------------------------------------------------
# Groups. ``check_initialized=False`` returns None instead of raising when nothing was built.
# ----------------------------------------------------------------------------------
def _group(name: str, check_initialized: bool = True) -> Optional[ProcessGroup]:
    if not check_initialized and not has_default_process_groups():
        return None
    return getattr(default_process_groups(), name)


def _data_name(with_context_parallel: bool, partial_data_parallel: bool) -> str:
    if partial_data_parallel and not with_context_parallel:
        raise AssertionError("partial_data_parallel=True needs with_context_parallel=True (as in Megatron)")
    return ("intra_dp_cp" if partial_data_parallel else "dp_cp") if with_context_parallel else "dp"


def get_model_parallel_group(check_initialized: bool = True) -> Optional[ProcessGroup]:
    """Tensor x pipeline model-parallel group."""
    return _group("mp", check_initialized)


def get_tensor_model_parallel_group(check_initialized: bool = True) -> Optional[ProcessGroup]:
    """The TP group; without ``check_initialized``, None when no groups were built (Megatron's rule)."""
    return _group("tp", check_initialized)


def get_pipeline_model_parallel_group(check_initialized: bool = True) -> Optional[ProcessGroup]:
    return _group("pp", check_initialized)


def get_data_parallel_group(
    with_context_parallel: bool = False, partial_data_parallel: bool = False, independent_all_gather: bool = False
) -> ProcessGroup:
    """The DP group (x CP with ``with_context_parallel``; one optimizer instance's part with ``partial``)."""
    if independent_all_gather:
        raise ValueError("independent_all_gather: not supported yet (create_all_gather_group is refused)")
    return _group(_data_name(with_context_parallel, partial_data_parallel))


def has_separate_all_gather_group() -> bool:
    """Always False: ``create_all_gather_group`` is not supported yet."""
    return False


def _gloo(name: str) -> ProcessGroup:
    default_process_groups()
    if _GLOO_GROUPS is None:
        raise AssertionError("gloo process groups were not created (create_gloo_process_groups=False)")
    return _GLOO_GROUPS[name]


def get_data_parallel_group_gloo(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> ProcessGroup:
    """The data-parallel group over gloo (for CPU tensors)."""
    return _gloo(_data_name(with_context_parallel, partial_data_parallel))


def get_context_parallel_group(check_initialized: bool = True) -> Optional[ProcessGroup]:
    return _group("cp", check_initialized)


def get_context_parallel_global_ranks(check_initialized: bool = True) -> Optional[List[int]]:
    """Global ranks of this rank's CP group."""
    if not check_initialized and not has_default_process_groups():
        return None
    return list(default_process_groups().ranks["cp"])


def get_hierarchical_context_parallel_groups(check_initialized: bool = True) -> Optional[List[ProcessGroup]]:
    """This rank's CP sub-group at each level of ``hierarchical_context_parallel_sizes`` (a2a, then p2p).

    Raises when none were built (no groups, or no hierarchical sizes) unless ``check_initialized`` is
    False, which returns None then (Megatron's rule)."""
    hcp = _group("hcp", check_initialized)
    if hcp is None and check_initialized:
        raise ParallelStateError(
            "hierarchical context parallel groups were not built: pass hierarchical_context_parallel_sizes "
            "to initialize_model_parallel"
        )
    return hcp


def get_hybrid_data_context_parallel_groups(check_initialized: bool = True, group_size: Optional[int] = None):
    """The DP x CP group when ``group_size`` is its size; other sizes need hybrid CP (not supported yet)."""
    if group_size == get_data_parallel_world_size(with_context_parallel=True):
        return _group("dp_cp", check_initialized)
    raise ValueError(f"hybrid context parallel groups of size {group_size}: not supported yet")


def get_embedding_group(check_initialized: bool = True) -> Optional[ProcessGroup]:
    return _group("embd", check_initialized)


def get_position_embedding_group(check_initialized: bool = True) -> Optional[ProcessGroup]:
    return _group("pos_embd", check_initialized)


def get_amax_reduction_group(with_context_parallel: bool = False, tp_only_amax_red: bool = False) -> ProcessGroup:
    """The group FP8 scaling factors are reduced over (Megatron's choice of TP, TP x CP, TP x DP (x CP))."""
    if tp_only_amax_red:
        return _group("tp_cp" if with_context_parallel else "tp")
    return _group("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_tensor_and_data_parallel_group(
    check_initialized: bool = True, with_context_parallel: bool = False
) -> Optional[ProcessGroup]:
    return _group("tp_dp_cp" if with_context_parallel else "tp_dp", check_initialized)


def get_tensor_and_context_parallel_group(check_initialized: bool = True) -> Optional[ProcessGroup]:
    return _group("tp_cp", check_initialized)


def get_expert_model_parallel_group(check_initialized: bool = True) -> Optional[ProcessGroup]:
    return _group("ep", check_initialized)


def get_expert_tensor_parallel_group(check_initialized: bool = True) -> Optional[ProcessGroup]:
    return _group("expt_tp", check_initialized)


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True) -> Optional[ProcessGroup]:
    return _group("tp_ep", check_initialized)


def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool = True) -> Optional[ProcessGroup]:
    return _group("tp_ep_pp", check_initialized)


def get_expert_data_parallel_group(
    check_initialized: bool = True, partial_expert_data_parallel: bool = False
) -> Optional[ProcessGroup]:
    return _group("intra_expt_dp" if partial_expert_data_parallel else "expt_dp", check_initialized)


def get_data_modulo_expert_parallel_group(partial_expert_data_parallel: bool = False) -> ProcessGroup:
    """Deprecated upstream name of ``get_expert_data_parallel_group``."""
    warnings.warn("use get_expert_data_parallel_group", DeprecationWarning, stacklevel=2)
    return get_expert_data_parallel_group(partial_expert_data_parallel=partial_expert_data_parallel)


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel: bool = False) -> ProcessGroup:
    return _gloo("intra_expt_dp" if partial_expert_data_parallel else "expt_dp")


def get_intra_distributed_optimizer_instance_group(check_initialized: bool = True) -> Optional[ProcessGroup]:
    """All ranks of this rank's distributed-optimizer instance."""
    return _group("intra_dist_opt", check_initialized)


def get_inter_distributed_optimizer_instance_group(check_initialized: bool = True) -> Optional[ProcessGroup]:
    """The group joining the distributed-optimizer instances (exists with more than one instance)."""
    group = _group("inter_dist_opt", check_initialized)
    if group is None and check_initialized:
        raise ParallelStateError(
            "inter distributed optimizer instance group needs num_distributed_optimizer_instances > 1"
        )
    return group


# ----------------------------------------------------------------------------------
# Sizes and ranks. A value given to a set_* function wins over the groups, as in Megatron.
# ----------------------------------------------------------------------------------
def _size(name: str, override: Optional[str] = None, zero_without_dist: bool = False) -> int:
    if override in _OVERRIDES:
        return _OVERRIDES[override]
    if zero_without_dist and not dist.is_initialized():
        return 0  # Megatron's answer when torch.distributed is not running
    return default_process_groups().size_of(name)


def _rank(name: str, override: Optional[str] = None, zero_without_dist: bool = False) -> int:
    if override in _OVERRIDES:
        return _OVERRIDES[override]
    if zero_without_dist and not dist.is_initialized():
        return 0
    return default_process_groups().rank_in(name)


def _override(key: str, value: Optional[int]) -> None:
    if value is None:
        _OVERRIDES.pop(key, None)
    else:
        _OVERRIDES[key] = value


def set_tensor_model_parallel_world_size(world_size: Optional[int]) -> None:
    """Make ``get_tensor_model_parallel_world_size()`` return ``world_size`` (None: read the group)."""
    _override("tp_size", world_size)


def set_tensor_model_parallel_rank(rank: Optional[int]) -> None:
    """Make ``get_tensor_model_parallel_rank()`` return ``rank`` (None: read the group)."""
    _override("tp_rank", rank)


def set_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    """Make ``get_pipeline_model_parallel_world_size()`` return ``world_size`` (None: read the group)."""
    _override("pp_size", world_size)


def set_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    """Make ``get_pipeline_model_parallel_rank()`` return ``rank`` (None: read the group)."""
    _override("pp_rank", rank)


def set_data_parallel_rank(rank: Optional[int]) -> None:
    """Make ``get_data_parallel_rank()`` return ``rank`` (None: read the group)."""
    _override("dp_rank", rank)


def set_expert_model_parallel_world_size(world_size: Optional[int]) -> None:
    _override("ep_size", world_size)


def set_expert_model_parallel_rank(rank: Optional[int]) -> None:
    _override("ep_rank", rank)


def set_expert_tensor_parallel_world_size(world_size: Optional[int]) -> None:
    _override("etp_size", world_size)


def set_expert_tensor_parallel_rank(rank: Optional[int]) -> None:
    _override("etp_rank", rank)


def get_tensor_model_parallel_world_size() -> int:
    return _size("tp", "tp_size")


def get_tensor_model_parallel_rank() -> int:
    return _rank("tp", "tp_rank")


def get_pipeline_model_parallel_world_size() -> int:
    return _size("pp", "pp_size")


def get_pipeline_model_parallel_rank() -> int:
    return _rank("pp", "pp_rank")


def get_data_parallel_world_size(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    return _size(_data_name(with_context_parallel, partial_data_parallel), zero_without_dist=True)


def get_data_parallel_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    return _rank(_data_name(with_context_parallel, partial_data_parallel), "dp_rank", zero_without_dist=True)


def get_context_parallel_world_size() -> int:
    return _size("cp", zero_without_dist=True)


def get_context_parallel_rank() -> int:
    return _rank("cp", zero_without_dist=True)


def get_tensor_and_context_parallel_world_size() -> int:
    return _size("tp_cp", zero_without_dist=True)


def get_tensor_and_context_parallel_rank() -> int:
    return _rank("tp_cp", zero_without_dist=True)


def get_expert_model_parallel_world_size() -> int:
    return _size("ep", "ep_size", zero_without_dist=True)


def get_expert_model_parallel_rank() -> int:
    return _rank("ep", "ep_rank", zero_without_dist=True)


def get_expert_tensor_parallel_world_size() -> int:
    """Expert-TP size; without groups, the TP size override (Megatron's fallback)."""
    if "etp_size" not in _OVERRIDES and not has_default_process_groups() and "tp_size" in _OVERRIDES:
        return _OVERRIDES["tp_size"]
    return _size("expt_tp", "etp_size")


def get_expert_tensor_parallel_rank() -> int:
    """Expert-TP rank; without groups, the TP rank override (Megatron's fallback)."""
    if "etp_rank" not in _OVERRIDES and not has_default_process_groups() and "tp_rank" in _OVERRIDES:
        return _OVERRIDES["tp_rank"]
    return _rank("expt_tp", "etp_rank")


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return _size("tp_ep", zero_without_dist=True)


def get_expert_tensor_and_model_parallel_rank() -> int:
    return _rank("tp_ep", zero_without_dist=True)


def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
    return _size("intra_expt_dp" if partial_expert_data_parallel else "expt_dp", zero_without_dist=True)


def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
    return _rank("intra_expt_dp" if partial_expert_data_parallel else "expt_dp", zero_without_dist=True)


def _first_rank_of(name: str) -> int:
    return default_process_groups().ranks[name][0]


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group."""
    return _first_rank_of("tp")


def get_model_parallel_src_rank() -> int:
    """Global rank of the first rank of this rank's model-parallel group."""
    return _first_rank_of("mp")


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of DP rank 0 in this rank's DP group."""
    return _first_rank_of("dp_cp" if with_context_parallel else "dp")


def get_expert_model_parallel_src_rank() -> int:
    return _first_rank_of("ep")


def get_pipeline_model_parallel_first_rank() -> int:
    return _first_rank_of("pp")


def get_pipeline_model_parallel_last_rank() -> int:
    return default_process_groups().ranks["pp"][get_pipeline_model_parallel_world_size() - 1]


def _pipeline_neighbour(step: int) -> int:
    ranks = default_process_groups().ranks["pp"]
    size = get_pipeline_model_parallel_world_size()
    return ranks[(get_pipeline_model_parallel_rank() + step) % size]


def get_pipeline_model_parallel_next_rank() -> int:
    return _pipeline_neighbour(1)


def get_pipeline_model_parallel_prev_rank() -> int:
    return _pipeline_neighbour(-1)


def get_all_ranks() -> str:
    """``"tp_dp_cp_pp_ep"`` ranks of this process, joined by underscores."""
    ranks = [
        get_tensor_model_parallel_rank(),
        get_data_parallel_rank(),
        get_context_parallel_rank(),
        get_pipeline_model_parallel_rank(),
        get_expert_model_parallel_rank(),
    ]
    return "_".join(str(r or 0) for r in ranks)


# ----------------------------------------------------------------------------------
# Virtual pipeline and stage predicates.
# ----------------------------------------------------------------------------------
def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return _VIRTUAL_PIPELINE_WORLD_SIZE


def set_virtual_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    global _VIRTUAL_PIPELINE_WORLD_SIZE
    _VIRTUAL_PIPELINE_WORLD_SIZE = world_size


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    return _VIRTUAL_PIPELINE_RANK


def set_virtual_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    """Deprecated upstream: pass ``vp_stage`` to the stage predicates instead."""
    global _VIRTUAL_PIPELINE_RANK
    _VIRTUAL_PIPELINE_RANK = rank


def _virtual_stage(ignore_virtual: bool, vp_stage: Optional[int]) -> Optional[int]:
    """The virtual stage to judge first/last with, or None to judge by the pipeline rank only."""
    if ignore_virtual or _VIRTUAL_PIPELINE_WORLD_SIZE is None:
        return None
    return vp_stage if vp_stage is not None else _VIRTUAL_PIPELINE_RANK


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """True on the first pipeline stage (and, unless ignored, the first virtual chunk)."""
    stage = _virtual_stage(ignore_virtual, vp_stage)
    if stage is not None and stage != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """True on the last pipeline stage (and, unless ignored, the last virtual chunk)."""
    stage = _virtual_stage(ignore_virtual, vp_stage)
    if stage is not None and stage != _VIRTUAL_PIPELINE_WORLD_SIZE - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """Whether this rank holds a copy of the word embeddings (for the given chunk)."""
    if not has_default_process_groups():
        return False
    ranks = default_process_groups().ranks["embd"]
    rank = dist.get_rank()
    if rank not in ranks or ignore_virtual:
        return rank in ranks
    if rank == ranks[0] and is_pipeline_first_stage(False, vp_stage):
        return True
    return rank == ranks[-1] and is_pipeline_last_stage(False, vp_stage)


def is_rank_in_position_embedding_group() -> bool:
    """Whether this rank holds the learned position embeddings."""
    return has_default_process_groups() and dist.get_rank() in default_process_groups().ranks["pos_embd"]


__all__ += [
    n for n, o in list(globals().items()) if callable(o) and getattr(o, "__module__", "") == __name__ and n[0] != "_"
]
