"""torch.distributed.checkpoint planners driven by ShardedTensor geometry.

DCP's default planners describe a plain tensor as a whole tensor at offset 0.
These planners instead take each rank's piece, global shape and offset from our
ShardedTensors: saving writes one chunk per piece whose ``replica_id`` is 0, and
loading asks DCP's resharding helper which saved chunks overlap the piece this
rank needs, then copies straight into it (in place, so into the parameters).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor


def _chunk(spec: ShardedTensor) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(spec.global_offset), sizes=torch.Size(spec.local_shape))


def write_item(spec: ShardedTensor) -> WriteItem:
    """The DCP write request for ``spec``'s piece."""
    return WriteItem(
        index=MetadataIndex(spec.key, torch.Size(spec.global_offset)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=_chunk(spec),
            properties=TensorProperties.create_from_tensor(spec.data),
            size=torch.Size(spec.global_shape),
        ),
    )


class ShardedSavePlanner(DefaultSavePlanner):
    """Writes the pieces with ``replica_id == 0``; DCP's global step checks they tile each tensor.

    A rank may write several pieces of one key (the distributed optimizer's slices): the dict's keys
    then differ, and each piece is found by its checkpoint key and offset.
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._pieces: Dict[Tuple[str, Tuple[int, ...]], ShardedTensor] = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self._pieces = {(spec.key, spec.global_offset): spec for spec in state_dict.values() if spec.replica_id == 0}
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([write_item(spec) for spec in self._pieces.values()])
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        # Contiguous CPU copy: the writer serializes the storage it is given.
        index = write_item.index
        return self._pieces[(index.fqn, tuple(index.offset))].data.detach().cpu().contiguous()


class ShardedLoadPlanner(DefaultLoadPlanner):
    """Reads, for every ShardedTensor, the saved chunks overlapping its piece, into ``data``.

    Key and shape checks happen before (``serialization.check_against_metadata``),
    so that every rank agrees on failure before any collective.
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._pieces: Dict[str, ShardedTensor] = {}

    def set_up_planner(
        self, state_dict: ShardedStateDict, metadata: Metadata = None, is_coordinator: bool = False
    ) -> None:
        self._pieces = dict(state_dict)
        self._by_offset = {(spec.key, spec.global_offset): spec for spec in self._pieces.values()}
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        requests: List[ReadItem] = []
        for spec in self._pieces.values():
            saved = self.metadata.state_dict_metadata[spec.key]
            if not isinstance(saved, TensorStorageMetadata):
                raise ValueError(f"checkpoint entry {spec.key!r} is not a tensor")
            requests += create_read_items_for_chunk_list(spec.key, saved, [_chunk(spec)])
        self.plan = LoadPlan(requests)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._by_offset[(index.fqn, tuple(index.offset))].data
