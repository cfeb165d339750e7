"""Process groups of the parallel layout, as values and as Megatron's module facade.

``build_process_groups`` turns a layout into a ``ProcessGroupCollection`` that core
modules receive explicitly. ``initialize_model_parallel`` builds one such
collection, keeps it as the process-wide default and exposes it through Megatron's
getter functions (``get_tensor_model_parallel_group()`` ...), so code written
against Megatron keeps working. Core modules never look the default up on their
own: internal modules require their groups, and the public constructors and
functions whose Megatron signature keeps ``pg_collection=None`` / ``tp_group=None``
resolve it through ``ProcessGroupCollection.use_mpu_process_groups()`` or
``get_tensor_model_parallel_group_if_none()``, the only two ways in from outside this
module (both raise if nothing was built). ``forbid_default_process_groups()`` makes
every read of the default raise, to prove a code path passes its groups.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch.distributed as dist

from megatron.core.rank_grid import RankGrid, embedding_ranks, position_embedding_ranks

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of every parallel dimension; validated against the world size."""

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None
    order: str = "tp-cp-ep-dp-pp"

    def __post_init__(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        if self.expert_tensor_parallel_size is None:
            object.__setattr__(self, "expert_tensor_parallel_size", self.tensor_model_parallel_size)
        vp = self.virtual_pipeline_model_parallel_size
        if vp is not None and (vp < 1 or self.pipeline_model_parallel_size == 1 and vp > 1):
            raise ValueError(
                f"virtual_pipeline_model_parallel_size={vp}: needs a positive value and "
                f"pipeline_model_parallel_size > 1 (got {self.pipeline_model_parallel_size})"
            )
        dense = self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        if self.world_size % dense:
            raise ValueError(
                f"world size {self.world_size} is not divisible by tensor_model_parallel_size "
                f"({self.tensor_model_parallel_size}) x pipeline_model_parallel_size "
                f"({self.pipeline_model_parallel_size}) x context_parallel_size "
                f"({self.context_parallel_size}) = {dense}"
            )
        expert = self.expert_tensor_parallel_size * self.expert_model_parallel_size * self.pipeline_model_parallel_size
        if self.world_size % expert:
            raise ValueError(
                f"world size {self.world_size} is not divisible by expert_tensor_parallel_size "
                f"({self.expert_tensor_parallel_size}) x expert_model_parallel_size "
                f"({self.expert_model_parallel_size}) x pipeline_model_parallel_size "
                f"({self.pipeline_model_parallel_size}) = {expert}"
            )

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )

    @property
    def expert_data_parallel_size(self) -> int:
        return self.world_size // (
            self.expert_tensor_parallel_size * self.expert_model_parallel_size * self.pipeline_model_parallel_size
        )

    def dense_grid(self) -> RankGrid:
        """Grid for attention/dense layers (the expert dimension is folded into dp)."""
        return RankGrid(
            {
                "tp": self.tensor_model_parallel_size,
                "cp": self.context_parallel_size,
                "ep": 1,
                "dp": self.data_parallel_size,
                "pp": self.pipeline_model_parallel_size,
            },
            self.order,
        )

    def expert_grid(self) -> RankGrid:
        """Grid for expert layers: expert-tp x ep x expert-dp x pp."""
        return RankGrid(
            {
                "tp": self.expert_tensor_parallel_size,
                "cp": 1,
                "ep": self.expert_model_parallel_size,
                "dp": self.expert_data_parallel_size,
                "pp": self.pipeline_model_parallel_size,
            },
            self.order,
        )


# Which groups a collection holds: field name -> (grid, token).
_DENSE_GROUPS = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "dp_cp": "dp-cp",
    "cp": "cp",
    "mp": "tp-pp",
    "tp_cp": "tp-cp",
    "tp_dp_cp": "tp-dp-cp",
}
_EXPERT_GROUPS = {"ep": "ep", "expt_tp": "tp", "tp_ep": "tp-ep", "tp_ep_pp": "tp-ep-pp", "expt_dp": "dp"}


@dataclass
class ProcessGroupCollection:
    """The process groups one rank communicates over, passed to core modules.

    Attributes are ``torch.distributed`` groups that contain this rank; ``ranks``
    maps each attribute name to the global ranks of that group, in group order.
    """

    layout: ParallelLayout
    tp: ProcessGroup
    pp: ProcessGroup
    dp: ProcessGroup
    dp_cp: ProcessGroup
    cp: ProcessGroup
    mp: ProcessGroup
    tp_cp: ProcessGroup
    tp_dp_cp: ProcessGroup
    embd: Optional[ProcessGroup]
    pos_embd: Optional[ProcessGroup]
    ep: ProcessGroup
    expt_tp: ProcessGroup
    tp_ep: ProcessGroup
    tp_ep_pp: ProcessGroup
    expt_dp: ProcessGroup
    ranks: Dict[str, List[int]] = field(default_factory=dict)

    def rank_in(self, name: str) -> int:
        """This process's rank inside group ``name``."""
        return self.ranks[name].index(dist.get_rank())

    def size_of(self, name: str) -> int:
        """Number of ranks in group ``name``."""
        return len(self.ranks[name])

    @classmethod
    def use_mpu_process_groups(cls) -> ProcessGroupCollection:
        """The collection built by ``initialize_model_parallel`` (Megatron's name for this look-up).

        For library users calling a public API without groups; code inside ``megatron/core`` and
        ``megatron/training`` passes its collection instead. Raises if nothing was built.
        """
        return default_process_groups()


class _GroupFactory:
    """Creates each distinct rank list's group once (every rank calls in the same order)."""

    def __init__(self, timeout: Optional[timedelta], backend: Optional[str]) -> None:
        self._timeout = timeout
        self._backend = backend
        self._cache: Dict[Tuple[int, ...], ProcessGroup] = {}

    def mine(self, rank_lists: Sequence[Sequence[int]], rank: int) -> Tuple[Optional[ProcessGroup], List[int]]:
        """Create every group in ``rank_lists``; return the one containing ``rank``."""
        found: Tuple[Optional[ProcessGroup], List[int]] = (None, [])
        for ranks in rank_lists:
            key = tuple(ranks)
            if key not in self._cache:
                self._cache[key] = dist.new_group(list(key), timeout=self._timeout, backend=self._backend)
            if rank in key:
                found = (self._cache[key], list(key))
        return found


def build_process_groups(
    layout: ParallelLayout, timeout: Optional[timedelta] = None, backend: Optional[str] = None
) -> ProcessGroupCollection:
    """Create all groups of ``layout``; a collective call on every rank of the world.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: the layout does not fit the world size.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if layout.world_size != world:
        raise ValueError(f"layout is for world size {layout.world_size}, but torch.distributed has {world} ranks")
    factory = _GroupFactory(timeout, backend)
    groups: Dict[str, Optional[ProcessGroup]] = {}
    ranks: Dict[str, List[int]] = {}
    for grid, table in ((layout.dense_grid(), _DENSE_GROUPS), (layout.expert_grid(), _EXPERT_GROUPS)):
        for name, token in table.items():
            groups[name], ranks[name] = factory.mine(grid.groups(token), rank)
    pp_lists = layout.dense_grid().groups("pp")
    groups["embd"], ranks["embd"] = factory.mine([embedding_ranks(p) for p in pp_lists], rank)
    groups["pos_embd"], ranks["pos_embd"] = factory.mine([position_embedding_ranks(p) for p in pp_lists], rank)
    return ProcessGroupCollection(layout=layout, ranks=ranks, **groups)


# ----------------------------------------------------------------------------------
# Megatron-compatible facade over one default collection.
# ----------------------------------------------------------------------------------
_DEFAULT: Optional[ProcessGroupCollection] = None
_VIRTUAL_PIPELINE_RANK: Optional[int] = None
_FORBIDDEN: Optional[str] = None  # why reading the default raises now (see forbid_default_process_groups)


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_split_rank: Optional[int] = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    order: str = "tp-cp-ep-dp-pp",
    distributed_timeout_minutes: int = 30,
    **unsupported: object,
) -> ProcessGroupCollection:
    """Build Megatron's rank grid and groups and make them the process default.

    Returns the collection, which core modules should receive explicitly.
    """
    global _DEFAULT, _VIRTUAL_PIPELINE_RANK
    if pipeline_model_parallel_split_rank is not None:
        raise ValueError("pipeline_model_parallel_split_rank is not supported yet (encoder-decoder pipelines)")
    active = {k: v for k, v in unsupported.items() if v not in (None, False, 1, [], ())}
    if active:
        raise ValueError(f"initialize_model_parallel: not supported yet: {sorted(active)}")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    if _DEFAULT is not None:
        raise RuntimeError("model parallel groups are already initialized; call destroy_model_parallel() first")
    layout = ParallelLayout(
        world_size=dist.get_world_size(),
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        order=order,
    )
    _DEFAULT = build_process_groups(layout, timeout=timedelta(minutes=distributed_timeout_minutes))
    _VIRTUAL_PIPELINE_RANK = 0 if virtual_pipeline_model_parallel_size is not None else None
    return _DEFAULT


def model_parallel_is_initialized() -> bool:
    """Whether ``initialize_model_parallel`` has built the default groups."""
    return _DEFAULT is not None


def default_process_groups() -> ProcessGroupCollection:
    """The collection built by ``initialize_model_parallel``; raises if there is none.

    Every facade getter reads the default through here.
    """
    if _FORBIDDEN is not None:
        raise RuntimeError(f"the default process groups were read while forbidden: {_FORBIDDEN}")
    if _DEFAULT is None:
        raise RuntimeError(
            "model parallel groups are not initialized: call "
            "megatron.core.parallel_state.initialize_model_parallel(...) or pass process groups explicitly"
        )
    return _DEFAULT


@contextlib.contextmanager
def forbid_default_process_groups(reason: str = "this code must receive its groups") -> Iterator[None]:
    """Within the block, reading the default collection (any facade getter) raises ``RuntimeError``.

    Building the default (``initialize_model_parallel``) stays allowed. Used by tests to prove
    that a code path (the training loop, a model) uses only the groups it was given.
    """
    global _FORBIDDEN
    previous, _FORBIDDEN = _FORBIDDEN, reason
    try:
        yield
    finally:
        _FORBIDDEN = previous


def get_tensor_model_parallel_group_if_none(tp_group: Optional[ProcessGroup], is_expert: bool = False) -> ProcessGroup:
    """``tp_group`` itself, or the default (expert-)TP group for a public API called without one."""
    if tp_group is not None:
        return tp_group
    groups = default_process_groups()
    return groups.expt_tp if is_expert else groups.tp


def destroy_model_parallel() -> None:
    """Forget the default groups (the groups themselves are left to torch)."""
    global _DEFAULT, _VIRTUAL_PIPELINE_RANK
    _DEFAULT = None
    _VIRTUAL_PIPELINE_RANK = None


def _group(name: str) -> ProcessGroup:
    return getattr(default_process_groups(), name)


def _size(name: str) -> int:
    return default_process_groups().size_of(name)


def _rank(name: str) -> int:
    return default_process_groups().rank_in(name)


def get_tensor_model_parallel_group(check_initialized: bool = True) -> Optional[ProcessGroup]:
    """The TP group; without ``check_initialized``, None when no groups were built (Megatron's rule)."""
    if not check_initialized and _DEFAULT is None:
        return None
    return _group("tp")


def get_pipeline_model_parallel_group() -> ProcessGroup:
    return _group("pp")


def get_data_parallel_group(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> ProcessGroup:
    return _group("dp_cp" if with_context_parallel else "dp")


def get_context_parallel_group() -> ProcessGroup:
    return _group("cp")


def get_model_parallel_group() -> ProcessGroup:
    return _group("mp")


def get_tensor_and_context_parallel_group() -> ProcessGroup:
    return _group("tp_cp")


def get_embedding_group() -> Optional[ProcessGroup]:
    return _group("embd")


def get_position_embedding_group() -> Optional[ProcessGroup]:
    return _group("pos_embd")


def get_expert_model_parallel_group() -> ProcessGroup:
    return _group("ep")


def get_expert_tensor_parallel_group() -> ProcessGroup:
    return _group("expt_tp")


def get_expert_tensor_and_model_parallel_group() -> ProcessGroup:
    return _group("tp_ep")


def get_expert_data_parallel_group() -> ProcessGroup:
    return _group("expt_dp")


def get_tensor_model_parallel_world_size() -> int:
    return _size("tp")


def get_tensor_model_parallel_rank() -> int:
    return _rank("tp")


def get_pipeline_model_parallel_world_size() -> int:
    return _size("pp")


def get_pipeline_model_parallel_rank() -> int:
    return _rank("pp")


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _size("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _rank("dp_cp" if with_context_parallel else "dp")


def get_context_parallel_world_size() -> int:
    return _size("cp")


def get_context_parallel_rank() -> int:
    return _rank("cp")


def get_expert_model_parallel_world_size() -> int:
    return _size("ep")


def get_expert_model_parallel_rank() -> int:
    return _rank("ep")


def get_expert_tensor_parallel_world_size() -> int:
    return _size("expt_tp")


def get_expert_tensor_parallel_rank() -> int:
    return _rank("expt_tp")


def get_expert_data_parallel_world_size() -> int:
    return _size("expt_dp")


def get_expert_data_parallel_rank() -> int:
    return _rank("expt_dp")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group."""
    return default_process_groups().ranks["tp"][0]


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of DP rank 0 in this rank's DP group."""
    return default_process_groups().ranks["dp_cp" if with_context_parallel else "dp"][0]


def get_pipeline_model_parallel_first_rank() -> int:
    return default_process_groups().ranks["pp"][0]


def get_pipeline_model_parallel_last_rank() -> int:
    return default_process_groups().ranks["pp"][-1]


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = default_process_groups().ranks["pp"]
    return ranks[(ranks.index(dist.get_rank()) + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = default_process_groups().ranks["pp"]
    return ranks[(ranks.index(dist.get_rank()) - 1) % len(ranks)]


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return default_process_groups().layout.virtual_pipeline_model_parallel_size


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    return _VIRTUAL_PIPELINE_RANK


def set_virtual_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    global _VIRTUAL_PIPELINE_RANK
    _VIRTUAL_PIPELINE_RANK = rank


def _virtual_position(ignore_virtual: bool, vp_stage: Optional[int]) -> Tuple[Optional[int], Optional[int]]:
    """(vp stage, vp size) to judge first/last stage with, or (None, None)."""
    vp_size = get_virtual_pipeline_model_parallel_world_size()
    if ignore_virtual or vp_size is None:
        return None, None
    return (vp_stage if vp_stage is not None else _VIRTUAL_PIPELINE_RANK), vp_size


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """True on the first pipeline stage (and, unless ignored, the first virtual chunk)."""
    stage, _ = _virtual_position(ignore_virtual, vp_stage)
    if stage is not None and stage != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """True on the last pipeline stage (and, unless ignored, the last virtual chunk)."""
    stage, size = _virtual_position(ignore_virtual, vp_stage)
    if stage is not None and stage != size - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """Whether this rank holds a copy of the word embeddings (for the given chunk)."""
    if dist.get_rank() not in default_process_groups().ranks["embd"]:
        return False
    if ignore_virtual:
        return True
    return is_pipeline_first_stage(False, vp_stage) or is_pipeline_last_stage(False, vp_stage)


def warn_sequence_parallel_without_tp(tensor_model_parallel_size: int, sequence_parallel: bool) -> bool:
    """Megatron's rule: sequence parallelism is meaningless with TP=1; warn and disable."""
    if sequence_parallel and tensor_model_parallel_size == 1:
        warnings.warn(
            "sequence_parallel=True with tensor_model_parallel_size=1: disabling sequence parallelism", stacklevel=2
        )
        return False
    return sequence_parallel
