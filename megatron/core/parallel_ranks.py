"""The sizes, ranks and pipeline-stage half of ``parallel_state``'s facade (Megatron's getters and setters).

Each getter reads the process-wide default ``ProcessGroupCollection`` (``megatron.core.process_groups``)
unless a ``set_*`` override holds a value for it, as in Megatron. ``parallel_state`` re-exports every
public name here, and ``initialize_model_parallel`` / ``destroy_model_parallel`` set and clear this state.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch.distributed as dist

from megatron.core.process_groups import default_process_groups, has_default_process_groups

# Overrides set by the set_* functions: key -> value (absent: read the groups).
_OVERRIDES: Dict[str, int] = {}
_VIRTUAL_PIPELINE_RANK: Optional[int] = None
_VIRTUAL_PIPELINE_WORLD_SIZE: Optional[int] = None


def _reset_rank_state() -> None:
    """Forget every override and the virtual-pipeline size and rank (``destroy_model_parallel``)."""
    global _VIRTUAL_PIPELINE_RANK, _VIRTUAL_PIPELINE_WORLD_SIZE
    _OVERRIDES.clear()
    _VIRTUAL_PIPELINE_RANK = _VIRTUAL_PIPELINE_WORLD_SIZE = None


def _data_name(with_context_parallel: bool, partial_data_parallel: bool) -> str:
    if partial_data_parallel and not with_context_parallel:
        raise AssertionError("partial_data_parallel=True needs with_context_parallel=True (as in Megatron)")
    return ("intra_dp_cp" if partial_data_parallel else "dp_cp") if with_context_parallel else "dp"


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


__all__ = [
    n for n, o in list(globals().items()) if callable(o) and getattr(o, "__module__", "") == __name__ and n[0] != "_"
]
