"""Megatron's module-level parallel state, as a facade over one ``ProcessGroupCollection``.

``initialize_model_parallel`` builds a collection (``megatron.core.process_groups``), keeps it as
the process-wide default and exposes it through Megatron's getters, so code written against Megatron
Core keeps working. Core modules never look the default up on their own: internal modules require
their groups, and public functions whose Megatron signature keeps ``pg_collection=None`` /
``tp_group=None`` resolve it through ``ProcessGroupCollection.use_mpu_process_groups()`` or
``get_tensor_model_parallel_group_if_none()`` (both raise if nothing was built).

As in Megatron, the ``set_*`` functions override what the matching size/rank getters return
(a layer run "as if" on a given TP rank without groups); ``destroy_model_parallel`` clears them.
This module holds the start-up, the tear-down and the group getters; the sizes, ranks, overrides and
pipeline-stage predicates live in ``megatron.core.parallel_ranks`` and are re-exported here.
"""

from __future__ import annotations

import warnings
from dataclasses import fields
from datetime import timedelta
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

from megatron.core import parallel_ranks
from megatron.core.memory_buffer import destroy_global_memory_buffer, get_global_memory_buffer
from megatron.core.parallel_ranks import (  # noqa: F401 - Megatron's sizes, ranks and stage predicates, re-exported
    _data_name,
    _reset_rank_state,
    get_all_ranks,
    get_context_parallel_rank,
    get_context_parallel_world_size,
    get_data_parallel_rank,
    get_data_parallel_src_rank,
    get_data_parallel_world_size,
    get_expert_data_parallel_rank,
    get_expert_data_parallel_world_size,
    get_expert_model_parallel_rank,
    get_expert_model_parallel_src_rank,
    get_expert_model_parallel_world_size,
    get_expert_tensor_and_model_parallel_rank,
    get_expert_tensor_and_model_parallel_world_size,
    get_expert_tensor_parallel_rank,
    get_expert_tensor_parallel_world_size,
    get_model_parallel_src_rank,
    get_pipeline_model_parallel_first_rank,
    get_pipeline_model_parallel_last_rank,
    get_pipeline_model_parallel_next_rank,
    get_pipeline_model_parallel_prev_rank,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_tensor_and_context_parallel_rank,
    get_tensor_and_context_parallel_world_size,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
    get_virtual_pipeline_model_parallel_rank,
    get_virtual_pipeline_model_parallel_world_size,
    is_pipeline_first_stage,
    is_pipeline_last_stage,
    is_rank_in_embedding_group,
    is_rank_in_position_embedding_group,
    set_data_parallel_rank,
    set_expert_model_parallel_rank,
    set_expert_model_parallel_world_size,
    set_expert_tensor_parallel_rank,
    set_expert_tensor_parallel_world_size,
    set_pipeline_model_parallel_rank,
    set_pipeline_model_parallel_world_size,
    set_tensor_model_parallel_rank,
    set_tensor_model_parallel_world_size,
    set_virtual_pipeline_model_parallel_rank,
    set_virtual_pipeline_model_parallel_world_size,
)
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
    global _GLOO_GROUPS
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
    set_virtual_pipeline_model_parallel_rank(0 if virtual_pipeline_model_parallel_size is not None else None)
    set_virtual_pipeline_model_parallel_world_size(virtual_pipeline_model_parallel_size)
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
    global _GLOO_GROUPS
    set_default_process_groups(None)
    destroy_groups(_BUILT)
    _BUILT.clear()
    destroy_global_memory_buffer()
    _reset_rank_state()
    _GLOO_GROUPS = None


# ----------------------------------------------------------------------------------
# Groups. ``check_initialized=False`` returns None instead of raising when nothing was built.
# ----------------------------------------------------------------------------------
def _group(name: str, check_initialized: bool = True) -> Optional[ProcessGroup]:
    if not check_initialized and not has_default_process_groups():
        return None
    return getattr(default_process_groups(), name)


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


__all__ += parallel_ranks.__all__
__all__ += [
    n for n, o in list(globals().items()) if callable(o) and getattr(o, "__module__", "") == __name__ and n[0] != "_"
]
