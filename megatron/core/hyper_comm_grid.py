"""Megatron-core's ``HyperCommGrid``: named parallel dimensions over a block of ranks, groups made on request.

``HyperCommGrid([2, 3, 4], ["tp", "cp", "dp"])`` lays ``2*3*4`` ranks (from ``rank_offset``) out with the
first name varying fastest, as ``initialize_model_parallel``'s ``order`` does (``RankGrid``'s rule).
``create_pg(dims)`` builds the groups of ranks that differ only along ``dims`` (each group's ranks
ascending, groups by their first rank) and returns this rank's; ``get_pg`` returns it again and
``get_rank_enum`` lists the groups without creating any. A combination is created once: its key
orders the names as the grid does, slowest first (``["tp", "dp"]`` and ``["dp", "tp"]`` are ``"dp-tp"``).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch.distributed as dist


class HyperCommGrid:
    """See the module docstring. ``backend`` is passed to every group created (None: the default)."""

    def __init__(
        self, shape: List[int], dim_names: List[str], rank_offset: int = 0, backend: Optional[str] = None
    ) -> None:
        if len(shape) != len(dim_names):
            raise ValueError(f"len(shape) {shape} != len(dim_names) {dim_names}")
        if len(set(dim_names)) != len(dim_names):
            raise ValueError(f"dim_names {dim_names} repeat a name")
        if rank_offset < 0:
            raise ValueError(f"rank_offset must be non-negative, got {rank_offset}")
        if "WORLD_SIZE" in os.environ:  # lets a grid be described before torch.distributed starts
            world_size = int(os.environ["WORLD_SIZE"])
        elif dist.is_initialized():
            world_size = dist.get_world_size()
        else:
            raise RuntimeError("HyperCommGrid: set WORLD_SIZE or initialize torch.distributed first")
        self.size = int(np.prod(shape))
        if self.size > world_size - rank_offset:
            raise RuntimeError(
                f"Grid shape {shape} needs {self.size} ranks; world size {world_size} from rank offset {rank_offset}"
            )
        self.shape, self.dim_names = list(shape), list(dim_names)
        self.rank_offset, self.backend = rank_offset, backend
        self._pgs: Dict[str, dist.ProcessGroup] = {}

    def _order_dims(self, dims: Union[str, List[str]]) -> Tuple[List[str], str]:
        """``dims`` in the grid's slowest-first order, and the key naming that combination."""
        names = [dims] if isinstance(dims, str) else list(dims)
        unknown = [d for d in names if d not in self.dim_names]
        if unknown:
            raise ValueError(f"dims {unknown} are not among the grid's {self.dim_names}")
        ordered = sorted(names, key=self.dim_names.index, reverse=True)
        return ordered, "-".join(ordered)

    def get_rank_enum(self, dims: Union[str, List[str]]) -> List[List[int]]:
        """The rank lists of the groups ``create_pg(dims)`` builds."""
        ordered, _ = self._order_dims(dims)
        slowest_first = self.dim_names[::-1]
        ranks = np.arange(self.rank_offset, self.rank_offset + self.size).reshape(
            self.shape[::-1]
        )  # axes slowest first
        group_axes = [slowest_first.index(d) for d in ordered]
        other_axes = [i for i in range(len(slowest_first)) if i not in group_axes]
        per_group = int(np.prod([self.shape[self.dim_names.index(d)] for d in ordered]))
        return ranks.transpose(other_axes + group_axes).reshape(-1, per_group).tolist()

    def create_pg(self, dims: Union[str, List[str]], **kwargs: Any) -> Optional[dist.ProcessGroup]:
        """Build the groups along ``dims`` (``kwargs`` go to ``new_subgroups_by_enumeration``: timeout,
        pg_options, group_desc) and return this rank's; KeyError if that combination exists already."""
        _, key = self._order_dims(dims)
        if key in self._pgs:
            raise KeyError(f"process group {key} was already created (options cannot be compared: create it once)")
        group, _ = dist.new_subgroups_by_enumeration(self.get_rank_enum(dims), backend=self.backend, **kwargs)
        self._pgs[key] = group
        return group

    def get_pg(self, dims: Union[str, List[str]]) -> dist.ProcessGroup:
        """The group ``create_pg(dims)`` returned; KeyError if it was not created."""
        _, key = self._order_dims(dims)
        if key not in self._pgs:
            raise KeyError(f"process group {key} has not been created: call create_pg first")
        return self._pgs[key]
