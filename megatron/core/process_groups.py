"""Process groups of a parallel layout, as values, and the one process-wide default.

``build_process_groups`` turns a validated ``ParallelLayout`` into a
``ProcessGroupCollection`` that core modules receive explicitly.
``megatron.core.parallel_state`` keeps one such collection as the default behind
Megatron's getter functions; it is installed and read only through
``set_default_process_groups`` / ``default_process_groups`` here, and
``forbid_default_process_groups()`` makes every read raise, to prove that a code
path passes its groups.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch.distributed as dist

from megatron.core.rank_grid import RankGrid, embedding_ranks, partial_groups, position_embedding_ranks

ProcessGroup = dist.ProcessGroup


class LayoutError(ValueError, RuntimeError):
    """A layout that does not fit the world (a ``RuntimeError`` as Megatron raises it)."""


class ParallelStateError(RuntimeError, AssertionError):
    """Groups read before being built, or built twice (Megatron asserts: an ``AssertionError`` too)."""


def _check_positive(layout: ParallelLayout) -> None:
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "num_distributed_optimizer_instances",
    ):
        value = getattr(layout, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive integer")


def _check_divisible(world: int, what: str, factors: Sequence[Tuple[str, int]]) -> None:
    total = 1
    for _, size in factors:
        total *= size
    if world % total:
        named = " x ".join(f"{name} ({size})" for name, size in factors)
        raise LayoutError(f"world size {world} is not divisible by {named} = {total} ({what})")


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
    num_distributed_optimizer_instances: int = 1

    def __post_init__(self) -> None:
        _check_positive(self)
        if self.expert_tensor_parallel_size is None:
            object.__setattr__(self, "expert_tensor_parallel_size", self.tensor_model_parallel_size)
        vp = self.virtual_pipeline_model_parallel_size
        if vp is not None and (vp < 1 or self.pipeline_model_parallel_size == 1 and vp > 1):
            raise LayoutError(
                f"virtual_pipeline_model_parallel_size={vp}: needs a positive value and "
                f"pipeline_model_parallel_size > 1 (got {self.pipeline_model_parallel_size})"
            )
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        dense = [("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)]
        _check_divisible(
            self.world_size, "dense layers", dense + [("context_parallel_size", self.context_parallel_size)]
        )
        expert = [
            ("expert_tensor_parallel_size", self.expert_tensor_parallel_size),
            ("expert_model_parallel_size", self.expert_model_parallel_size),
            ("pipeline_model_parallel_size", pp),
        ]
        _check_divisible(self.world_size, "expert layers", expert)
        instances = self.num_distributed_optimizer_instances
        for name, size in (
            ("data_parallel_size x context_parallel_size", self.data_parallel_size * self.context_parallel_size),
            ("expert data parallel size", self.expert_data_parallel_size),
        ):
            if size % instances:
                raise AssertionError(
                    f"{name} ({size}) is not divisible by num_distributed_optimizer_instances ({instances})"
                )
        # Refuse an order that leaves out a dimension of size > 1 in either grid.
        self.dense_grid(), self.expert_grid()

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
        sizes = {
            "tp": self.tensor_model_parallel_size,
            "cp": self.context_parallel_size,
            "ep": 1,
            "dp": self.data_parallel_size,
            "pp": self.pipeline_model_parallel_size,
        }
        return RankGrid(sizes, self.order)

    def expert_grid(self) -> RankGrid:
        """Grid for expert layers: expert-tp x ep x expert-dp x pp."""
        sizes = {
            "tp": self.expert_tensor_parallel_size,
            "cp": 1,
            "ep": self.expert_model_parallel_size,
            "dp": self.expert_data_parallel_size,
            "pp": self.pipeline_model_parallel_size,
        }
        return RankGrid(sizes, self.order)


# Which groups a collection holds: field name -> (grid, token).
_DENSE_GROUPS = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "dp_cp": "dp-cp",
    "cp": "cp",
    "mp": "tp-pp",
    "tp_cp": "tp-cp",
    "tp_dp": "tp-dp",
    "tp_dp_cp": "tp-dp-cp",
}
_EXPERT_GROUPS = {"ep": "ep", "expt_tp": "tp", "tp_ep": "tp-ep", "tp_ep_pp": "tp-ep-pp", "expt_dp": "dp"}


@dataclass
class ProcessGroupCollection:
    """The process groups one rank communicates over, passed to core modules.

    Attributes are ``torch.distributed`` groups that contain this rank; ``ranks``
    maps each attribute name to the global ranks of that group, in group order.
    ``intra_dp_cp`` / ``intra_expt_dp`` are the parts of ``dp_cp`` / ``expt_dp`` one
    distributed-optimizer instance shards over (the whole group with one instance);
    ``inter_dist_opt`` joins the instances (None with one instance);
    ``intra_dist_opt`` holds all ranks of one instance.
    """

    layout: ParallelLayout
    tp: ProcessGroup
    pp: ProcessGroup
    dp: ProcessGroup
    dp_cp: ProcessGroup
    cp: ProcessGroup
    mp: ProcessGroup
    tp_cp: ProcessGroup
    tp_dp: ProcessGroup
    tp_dp_cp: ProcessGroup
    embd: Optional[ProcessGroup]
    pos_embd: Optional[ProcessGroup]
    ep: ProcessGroup
    expt_tp: ProcessGroup
    tp_ep: ProcessGroup
    tp_ep_pp: ProcessGroup
    expt_dp: ProcessGroup
    intra_dp_cp: Optional[ProcessGroup] = None
    intra_expt_dp: Optional[ProcessGroup] = None
    inter_dist_opt: Optional[ProcessGroup] = None
    intra_dist_opt: Optional[ProcessGroup] = None
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


class GroupFactory:
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


def _instance_rank_lists(layout: ParallelLayout) -> Dict[str, List[List[int]]]:
    """Rank lists of the distributed-optimizer instance groups (see ``ProcessGroupCollection``)."""
    instances = layout.num_distributed_optimizer_instances
    intra_dp_cp, _ = partial_groups(layout.dense_grid().groups("dp-cp"), instances)
    intra_expt_dp, inter = partial_groups(layout.expert_grid().groups("dp"), instances)
    per_instance = layout.expert_data_parallel_size // instances
    model_groups = layout.expert_grid().groups("tp-ep-pp")
    intra_dist_opt = [
        [r for group in model_groups[i : i + per_instance] for r in group]
        for i in range(0, len(model_groups), per_instance)
    ]
    lists = {"intra_dp_cp": intra_dp_cp, "intra_expt_dp": intra_expt_dp, "intra_dist_opt": intra_dist_opt}
    if instances > 1:
        lists["inter_dist_opt"] = inter
    return lists


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
        raise LayoutError(f"layout is for world size {layout.world_size}, but torch.distributed has {world} ranks")
    factory = GroupFactory(timeout, backend)
    groups: Dict[str, Optional[ProcessGroup]] = {}
    ranks: Dict[str, List[int]] = {}
    for grid, table in ((layout.dense_grid(), _DENSE_GROUPS), (layout.expert_grid(), _EXPERT_GROUPS)):
        for name, token in table.items():
            groups[name], ranks[name] = factory.mine(grid.groups(token), rank)
    pp_lists = layout.dense_grid().groups("pp")
    groups["embd"], ranks["embd"] = factory.mine([embedding_ranks(p) for p in pp_lists], rank)
    groups["pos_embd"], ranks["pos_embd"] = factory.mine([position_embedding_ranks(p) for p in pp_lists], rank)
    for name, lists in _instance_rank_lists(layout).items():
        groups[name], ranks[name] = factory.mine(lists, rank)
    return ProcessGroupCollection(layout=layout, ranks=ranks, **groups)


# ----------------------------------------------------------------------------------
# The process-wide default collection (behind megatron.core.parallel_state's getters).
# ----------------------------------------------------------------------------------
_DEFAULT: Optional[ProcessGroupCollection] = None
_FORBIDDEN: Optional[str] = None  # why reading the default raises now (see forbid_default_process_groups)


def set_default_process_groups(groups: Optional[ProcessGroupCollection]) -> None:
    """Install ``groups`` as the default (None forgets it); only ``parallel_state`` calls this."""
    global _DEFAULT
    _DEFAULT = groups


def has_default_process_groups() -> bool:
    """Whether a default collection is installed (reading nothing from it)."""
    return _DEFAULT is not None


def default_process_groups() -> ProcessGroupCollection:
    """The collection built by ``initialize_model_parallel``; raises if there is none.

    Every facade getter reads the default through here.
    """
    if _FORBIDDEN is not None:
        raise RuntimeError(f"the default process groups were read while forbidden: {_FORBIDDEN}")
    if _DEFAULT is None:
        raise ParallelStateError(
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
