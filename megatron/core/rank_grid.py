"""Pure rank-grid arithmetic: which global ranks form each parallel group.

Nothing here touches ``torch.distributed``; the grid is data that can be printed
and tested without processes. ``parallel_state`` turns it into process groups.

Ranks are laid out on a multi-dimensional grid whose dimensions follow ``order``
(Megatron's default ``tp-cp-ep-dp-pp``): the first dimension varies fastest, so
tensor-parallel ranks are adjacent and pipeline stages are furthest apart. As in
Megatron, an order may leave out dimensions of size 1 (``"tp-pp-dp"``); they are
appended as the slowest dimensions, where a size of 1 changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")


class OrderError(ValueError, RuntimeError):
    """An order string that leaves out a dimension of size > 1.

    A ``RuntimeError`` as Megatron raises it, and a ``ValueError`` (a bad argument).
    """


def parse_order(order: str, sizes: Optional[Mapping[str, int]] = None) -> List[str]:
    """The dimensions of ``order`` (lower-cased), fastest first, completed with the omitted ones.

    Raises:
        OrderError: a dimension whose size in ``sizes`` is not 1 is missing from ``order``.
        ValueError: an unknown or repeated dimension.
    """
    dims = order.lower().split("-")
    unknown = [d for d in dims if d not in DIMENSIONS]
    if unknown or len(set(dims)) != len(dims):
        raise ValueError(f"order={order!r}: dimensions are {'-'.join(DIMENSIONS)}, each at most once")
    sizes = sizes or {}
    missing = [d for d in ("tp", "pp", "dp", "ep", "cp") if d not in dims]  # Megatron appends in this order
    needed = [d for d in missing if sizes.get(d, 1) != 1]
    if needed:
        raise OrderError(
            f"order={order!r} leaves out {needed} of sizes {[sizes[d] for d in needed]}; "
            "only dimensions of size 1 may be left out"
        )
    return dims + missing


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: Sequence[int], mask: Sequence[bool]
) -> List[List[int]]:
    """Rank lists of the groups spanning the dimensions where ``mask`` is True.

    Args:
        world_size: number of ranks; the product of ``parallel_size``.
        parallel_size: size of each dimension, the fastest varying first.
        mask: which dimensions a group spans.

    Groups are listed with the other dimensions' coordinates varying fastest-first;
    inside a group, ranks follow the spanned dimensions fastest-first.
    """
    if prod(parallel_size) != world_size:
        raise ValueError(f"parallel sizes {list(parallel_size)} do not multiply to world size {world_size}")
    # Axis i of ``grid`` is dimension n-1-i: row-major order makes the first dimension fastest.
    grid = np.arange(world_size).reshape(list(reversed(parallel_size)))
    dims_of_axes = list(reversed(range(len(parallel_size))))
    keep = [axis for axis, d in enumerate(dims_of_axes) if not mask[d]]
    span = [axis for axis, d in enumerate(dims_of_axes) if mask[d]]
    group_size = prod(s for s, m in zip(parallel_size, mask) if m)
    return grid.transpose(keep + span).reshape(-1, group_size).tolist()


@dataclass(frozen=True)
class RankGrid:
    """A grid of ``world_size`` ranks with one size per parallel dimension.

    Args:
        sizes: size of each dimension in ``DIMENSIONS`` (missing ones are 1); their
            product is the number of ranks the grid covers.
        order: dimension order, fastest varying first; size-1 dimensions may be left out.
    """

    sizes: Dict[str, int]
    order: str = "tp-cp-ep-dp-pp"

    def __post_init__(self) -> None:
        for dim in DIMENSIONS:
            size = self.sizes.get(dim, 1)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{dim} size={size!r}: must be a positive integer")
        parse_order(self.order, self.sizes)

    @property
    def dims(self) -> List[str]:
        """All dimensions, fastest varying first."""
        return parse_order(self.order, self.sizes)

    @property
    def world_size(self) -> int:
        return prod(self.sizes.get(d, 1) for d in DIMENSIONS)

    def groups(self, token: str) -> List[List[int]]:
        """Rank lists of every group spanning the dimensions in ``token``.

        ``token`` is a ``-``-joined subset of dimensions (``"tp"``, ``"tp-pp"``,
        ``"dp-cp"``). Ranks inside a group are sorted by grid position, the
        fastest-varying dimension changing first.
        """
        wanted = set(token.split("-"))
        unknown = wanted - set(DIMENSIONS)
        if unknown:
            raise ValueError(f"group token {token!r}: unknown dimension(s) {sorted(unknown)}")
        dims = self.dims
        sizes = [self.sizes.get(d, 1) for d in dims]
        return generate_masked_orthogonal_rank_groups(self.world_size, sizes, [d in wanted for d in dims])

    def coordinate(self, rank: int, dim: str) -> int:
        """This rank's index along ``dim``."""
        dims = self.dims
        position = dims.index(dim)
        stride = prod(self.sizes.get(d, 1) for d in dims[:position])
        return rank // stride % self.sizes.get(dim, 1)


class RankGenerator:
    """Megatron's rank-group generator over one grid (``RankGrid`` under its upstream interface).

    Args:
        tp, ep, dp, pp, cp: dimension sizes; ``ep`` and ``cp`` cannot both exceed 1.
        order: dimension order, fastest first; dimensions of size 1 may be left out.
        rank_offset: added to every rank (a grid that starts at a later global rank).
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0) -> None:
        if ep != 1 and cp != 1:
            raise AssertionError(f"ep={ep} and cp={cp}: one rank generator cannot hold both EP and CP > 1")
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * dp * pp * cp * ep
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        self._grid = RankGrid(dict(self.name_to_size), order)
        self.order = "-".join(self._grid.dims)
        self.ordered_size = [self.name_to_size[d] for d in self._grid.dims]

    @staticmethod
    def get_mask(order: str, token: str) -> List[bool]:
        """Per dimension of ``order``, whether ``token`` (``"tp-dp"``) names it."""
        dims = order.split("-")
        mask = [False] * len(dims)
        for name in token.split("-"):
            mask[dims.index(name)] = True
        return mask

    def get_ranks(self, token: str) -> List[List[int]]:
        """Global rank lists of the groups spanning ``token``'s dimensions."""
        return [[r + self.rank_offset for r in group] for group in self._grid.groups(token)]


def embedding_ranks(pp_ranks: Sequence[int]) -> List[int]:
    """Ranks holding a copy of the word embeddings: first and last stage."""
    if len(pp_ranks) == 1:
        return [pp_ranks[0]]
    return [pp_ranks[0], pp_ranks[-1]]


def position_embedding_ranks(pp_ranks: Sequence[int]) -> List[int]:
    """Ranks holding learned position embeddings: the first stage only."""
    return [pp_ranks[0]]


def partial_groups(rank_lists: Sequence[Sequence[int]], instances: int) -> tuple:
    """Split each group into ``instances`` consecutive parts (intra) and the strided sets across them (inter).

    With distributed-optimizer instances, each instance shards over one consecutive part of
    the data-parallel group, and the instances all-reduce across parts.
    """
    intra: List[List[int]] = []
    inter: List[List[int]] = []
    for ranks in rank_lists:
        part = len(ranks) // instances
        intra += [list(ranks[i * part : (i + 1) * part]) for i in range(instances)]
        inter += [list(ranks[j::part]) for j in range(part)]
    return intra, inter


def hierarchical_rank_groups(ranks: Sequence[int], sizes: Sequence[int]) -> List[List[List[int]]]:
    """Per level, the sub-groups of ``ranks`` for nested group sizes (``prod(sizes) == len(ranks)``).

    Level ``i`` groups ``sizes[i]`` ranks that are ``prod(sizes[:i])`` apart: level 0 is
    consecutive ranks, the last level strides over all lower levels.
    """
    if prod(sizes) != len(ranks):
        raise ValueError(f"hierarchical group sizes {list(sizes)} do not multiply to {len(ranks)} ranks")
    levels = []
    for level, size in enumerate(sizes):
        inner, outer = prod(sizes[:level]), prod(sizes[level + 1 :])
        grid = np.asarray(ranks).reshape(outer, size, inner).transpose(0, 2, 1)
        levels.append(grid.reshape(-1, size).tolist())
    return levels
