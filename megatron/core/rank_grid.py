"""Pure rank-grid arithmetic: which global ranks form each parallel group.

Nothing here touches ``torch.distributed``; the grid is data that can be printed
and tested without processes. ``parallel_state`` turns it into process groups.

Ranks are laid out on a multi-dimensional grid whose dimensions follow ``order``
(Megatron's default ``tp-cp-ep-dp-pp``): the first dimension varies fastest, so
tensor-parallel ranks are adjacent and pipeline stages are furthest apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Dict, List, Sequence

import numpy as np

DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")


def parse_order(order: str) -> List[str]:
    """Split an order string such as ``"tp-cp-ep-dp-pp"`` and check it."""
    dims = order.split("-")
    if sorted(dims) != sorted(DIMENSIONS):
        raise ValueError(f"order={order!r}: must name each of {'-'.join(DIMENSIONS)} exactly once")
    return dims


@dataclass(frozen=True)
class RankGrid:
    """A grid of ``world_size`` ranks with one size per parallel dimension.

    Args:
        sizes: size of each dimension in ``DIMENSIONS``; their product is the
            number of ranks the grid covers.
        order: dimension order, fastest varying first.
    """

    sizes: Dict[str, int]
    order: str = "tp-cp-ep-dp-pp"

    def __post_init__(self) -> None:
        parse_order(self.order)
        for dim in DIMENSIONS:
            size = self.sizes.get(dim, 1)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{dim} size={size!r}: must be a positive integer")

    @property
    def world_size(self) -> int:
        return prod(self.sizes.get(d, 1) for d in DIMENSIONS)

    def _array(self) -> np.ndarray:
        """Ranks as an array indexed ``[slowest, ..., fastest]`` (reversed order)."""
        dims = parse_order(self.order)
        shape = [self.sizes.get(d, 1) for d in reversed(dims)]
        return np.arange(self.world_size).reshape(shape)

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
        axes_names = list(reversed(parse_order(self.order)))
        keep = [i for i, d in enumerate(axes_names) if d not in wanted]
        span = [i for i, d in enumerate(axes_names) if d in wanted]
        arr = self._array().transpose(keep + span)
        group_size = prod(arr.shape[len(keep) :])
        return arr.reshape(-1, group_size).tolist()

    def coordinate(self, rank: int, dim: str) -> int:
        """This rank's index along ``dim``."""
        axes_names = list(reversed(parse_order(self.order)))
        coords = np.unravel_index(rank, self._array().shape)
        return int(coords[axes_names.index(dim)])


def embedding_ranks(pp_group: Sequence[int]) -> List[int]:
    """Ranks holding a copy of the word embeddings: first and last stage."""
    if len(pp_group) == 1:
        return [pp_group[0]]
    return [pp_group[0], pp_group[-1]]


def position_embedding_ranks(pp_group: Sequence[int]) -> List[int]:
    """Ranks holding learned position embeddings: the first stage only."""
    return [pp_group[0]]
