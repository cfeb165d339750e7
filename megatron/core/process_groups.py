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
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from math import prod
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch.distributed as dist

from megatron.core.rank_grid import (
    RankGrid,
    embedding_ranks,
    hierarchical_rank_groups,
    partial_groups,
    position_embedding_ranks,
)

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


def check_hierarchical_cp_sizes(sizes: Optional[Sequence[int]], context_parallel_size: int) -> Optional[List[int]]:
    """``hierarchical_context_parallel_sizes`` as a list (None stays None); raises ``LayoutError`` (a
    ValueError) unless they are positive integers whose product is ``context_parallel_size``."""
    if sizes is None:
        return None
    sizes = list(sizes)
    if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes) or prod(sizes) != context_parallel_size:
        raise LayoutError(
            f"hierarchical_context_parallel_sizes={sizes}: must be positive integers whose product is "
            f"context_parallel_size={context_parallel_size}"
        )
    return sizes


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
    hierarchical_context_parallel_sizes: Optional[Tuple[int, ...]] = None  # [a2a, p2p] of cp_comm_type a2a+p2p

    def __post_init__(self) -> None:
        _check_positive(self)
        sizes = check_hierarchical_cp_sizes(self.hierarchical_context_parallel_sizes, self.context_parallel_size)
        object.__setattr__(self, "hierarchical_context_parallel_sizes", tuple(sizes) if sizes else None)
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
                    f"{name} ({size}) is not divisible by num_distributed_optimizer_instances={instances} "
                    "(each instance shards over an equal part of the data-parallel ranks)"
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
    ``hcp``: with ``layout.hierarchical_context_parallel_sizes``, this rank's sub-group of ``cp`` at each
    level (level 0: consecutive CP ranks, the ``a2a`` groups of ``a2a+p2p``; level 1: the ``p2p`` rings
    across them), else None; their ranks are ``ranks["hcp0"]``, ``ranks["hcp1"]``, ...
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
    hcp: Optional[List[ProcessGroup]] = None
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


_CREATED: List[Optional[ProcessGroup]] = [None]  # groups this rank belongs to (None: the world), for timeouts


def create_group(
    ranks: Optional[Sequence[int]] = None,
    timeout: Optional[timedelta] = None,
    backend: Optional[str] = None,
    pg_options: Optional[object] = None,
    use_local_synchronization: bool = False,
    group_desc: Optional[str] = None,
) -> ProcessGroup:
    """``torch.distributed.new_group`` (Megatron's wrapper), remembering the groups this rank is in."""
    group = dist.new_group(
        list(ranks) if ranks is not None else None,
        timeout=timeout,
        backend=backend,
        pg_options=pg_options,
        use_local_synchronization=use_local_synchronization,
        group_desc=group_desc,
    )
    if ranks is None or dist.get_rank() in ranks:
        _CREATED.append(group)
    return group


def destroy_groups(groups: Iterable[Optional[ProcessGroup]]) -> None:
    """Destroy each distinct group of ``groups`` (None and the world skipped); a local call on each rank.

    Frees each group's communicator threads; the groups must not be used afterwards.
    """
    seen: Dict[int, ProcessGroup] = {}
    for group in groups:
        if isinstance(group, ProcessGroup) and group is not dist.GroupMember.WORLD:
            seen.setdefault(id(group), group)
    for group in seen.values():
        dist.destroy_process_group(group)
    _CREATED[:] = [group for group in _CREATED if group is None or id(group) not in seen]


def update_pg_timeout(timeout: timedelta, pg: Optional[ProcessGroup] = None) -> None:
    """Set the collective timeout of ``pg``, or of the world and every group ``create_group`` made.

    A collective call over ``pg`` (the world when None): the ranks first meet at a barrier.
    """
    dist.barrier(group=pg)
    for group in [pg] if pg is not None else _CREATED:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def create_hierarchical_groups(
    rank: int,
    ranks: Sequence[int],
    hierarchical_group_sizes: Sequence[int],
    create_gloo_process_groups: bool = False,
    pg_options: Optional[object] = None,
    timeout: Optional[timedelta] = None,
    group_desc: Optional[str] = None,
) -> Tuple[List[ProcessGroup], List[Optional[ProcessGroup]]]:
    """Create the nested sub-groups of ``ranks`` (``rank_grid.hierarchical_rank_groups``), level by level.

    Returns this rank's group at each level, and its gloo twin (None unless requested).
    """
    options = pg_options if isinstance(pg_options, list) else [pg_options] * len(hierarchical_group_sizes)
    mine: List[ProcessGroup] = []
    mine_gloo: List[Optional[ProcessGroup]] = []
    for level, groups in enumerate(hierarchical_rank_groups(ranks, hierarchical_group_sizes)):
        for sub in groups:
            desc = f"HIERARCHICAL_{group_desc}_L{level}" if group_desc else None
            group = create_group(sub, timeout=timeout, pg_options=options[level], group_desc=desc)
            gloo = create_group(sub, timeout=timeout, backend="gloo") if create_gloo_process_groups else None
            if rank in sub:
                mine.append(group)
                mine_gloo.append(gloo)
    return mine, mine_gloo


def get_nccl_options(pg_name: str, nccl_comm_cfgs: Dict[str, Dict[str, object]]) -> Optional[object]:
    """NCCL options for group ``pg_name`` from a communicator config, or None when it has no entry."""
    if pg_name not in nccl_comm_cfgs:
        return None
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise ValueError(f"NCCL communicator options for {pg_name!r} need a PyTorch build with NCCL")
    config = nccl_comm_cfgs[pg_name]
    options = nccl.Options(is_high_priority_stream=bool(config.get("is_high_priority_stream", False)))
    for key in ("cga_cluster_size", "max_ctas", "min_ctas", "net_name"):
        if key in config:
            setattr(options.config, key, config[key])
    return options


def overwrite_nccl_comm_cfgs(nccl_comm_cfgs: Dict[str, Dict[str, object]], pg_name: str, key_value_pair: tuple) -> None:
    """Set one option of group ``pg_name`` in a communicator config."""
    key, value = key_value_pair
    nccl_comm_cfgs.setdefault(pg_name, {})[key] = value


def refuse_unsupported_options(**settings: object) -> None:
    """Raise for ``initialize_model_parallel`` arguments whose non-default value we cannot honour yet."""
    active = sorted(name for name, value in settings.items() if value not in (None, False, [], ()))
    if active:
        raise ValueError(f"initialize_model_parallel: not supported yet: {active} (NCCL/SHARP/hybrid-CP features)")


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
                self._cache[key] = create_group(list(key), timeout=self._timeout, backend=self._backend)
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


# The groups Megatron hands out gloo copies of (``get_data_parallel_group_gloo``,
# ``get_expert_data_parallel_group_gloo``): CPU-side collectives of the data-parallel ranks. No other
# group gets a gloo copy.
GLOO_GROUP_NAMES = ("dp", "dp_cp", "expt_dp", "intra_dp_cp", "intra_expt_dp")


def build_gloo_data_parallel_groups(
    layout: ParallelLayout, timeout: Optional[timedelta] = None
) -> Dict[str, Optional[ProcessGroup]]:
    """Gloo copies of this rank's ``GLOO_GROUP_NAMES`` groups, each distinct rank list created once;
    a collective call on every rank of the world."""
    instances = _instance_rank_lists(layout)
    lists = {
        "dp": layout.dense_grid().groups("dp"),
        "dp_cp": layout.dense_grid().groups("dp-cp"),
        "expt_dp": layout.expert_grid().groups("dp"),
        "intra_dp_cp": instances["intra_dp_cp"],
        "intra_expt_dp": instances["intra_expt_dp"],
    }
    factory, rank = GroupFactory(timeout, "gloo"), dist.get_rank()
    return {name: factory.mine(lists[name], rank)[0] for name in GLOO_GROUP_NAMES}


def build_process_groups(
    layout: ParallelLayout,
    timeout: Optional[timedelta] = None,
    backend: Optional[str] = None,
    get_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
    get_position_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
) -> ProcessGroupCollection:
    """Create all groups of ``layout``; a collective call on every rank of the world.

    ``get_embedding_ranks`` / ``get_position_embedding_ranks`` pick, from a pipeline group's
    ranks, those holding the word / position embeddings (default: first and last / first stage).

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
    embd, pos_embd = get_embedding_ranks or embedding_ranks, get_position_embedding_ranks or position_embedding_ranks
    groups["embd"], ranks["embd"] = factory.mine([embd(p) for p in pp_lists], rank)
    groups["pos_embd"], ranks["pos_embd"] = factory.mine([pos_embd(p) for p in pp_lists], rank)
    for name, lists in _instance_rank_lists(layout).items():
        groups[name], ranks[name] = factory.mine(lists, rank)
    hcp = _hierarchical_cp_groups(layout, factory, rank, ranks)
    return ProcessGroupCollection(layout=layout, ranks=ranks, hcp=hcp, **groups)


def _hierarchical_cp_groups(
    layout: ParallelLayout, factory: GroupFactory, rank: int, ranks: Dict[str, List[int]]
) -> Optional[List[ProcessGroup]]:
    """This rank's group at each level of ``hierarchical_context_parallel_sizes`` inside its CP group
    (``rank_grid.hierarchical_rank_groups``); records their ranks as ``hcp0``, ``hcp1``, ..."""
    sizes = layout.hierarchical_context_parallel_sizes
    if sizes is None:
        return None
    per_cp_group = [hierarchical_rank_groups(cp, sizes) for cp in layout.dense_grid().groups("cp")]
    mine = []
    for level in range(len(sizes)):
        group, ranks[f"hcp{level}"] = factory.mine([sub for levels in per_cp_group for sub in levels[level]], rank)
        mine.append(group)
    return mine


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


def get_tensor_model_parallel_group_if_none(tp_group: Optional[ProcessGroup], is_expert: bool = False) -> ProcessGroup:
    """``tp_group`` itself, or the default (expert-)TP group for a public API called without one."""
    if tp_group is not None:
        return tp_group
    groups = default_process_groups()
    return groups.expt_tp if is_expert else groups.tp


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


def warn_sequence_parallel_without_tp(tensor_model_parallel_size: int, sequence_parallel: bool) -> bool:
    """Megatron's rule: sequence parallelism is meaningless with TP=1; warn and disable."""
    if sequence_parallel and tensor_model_parallel_size == 1:
        warnings.warn(
            "sequence_parallel=True with tensor_model_parallel_size=1: disabling sequence parallelism", stacklevel=2
        )
        return False
    return sequence_parallel
