"""ShardedTensor: one rank's piece of a checkpointed tensor, with the global geometry.

A sharded state dict maps checkpoint keys to ``ShardedTensor`` values. Each value
says the shape of the whole (global) tensor, where this rank's piece starts in it,
and whether this rank is the one that writes it (``replica_id == 0``) or holds a
copy that another rank writes (replicas over data parallelism, replicated
parameters over tensor parallelism, the tied output-layer copy). Because the
description is layout-free, a checkpoint written with one TP/PP/DP layout is read
back into any other by intersecting the pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch

from megatron.core.tensor_parallel.utils import divide


@dataclass
class ShardedTensor:
    """A local piece ``data`` of the global tensor ``key``, with megatron-core's fields in its order.

    Attributes:
        key: checkpoint key, identical on every rank that holds a piece of the tensor.
        data: this rank's piece. On load it is filled in place, so it may be a view of a parameter.
        dtype: ``data.dtype`` (checked).
        local_shape: ``data.shape`` (checked); after construction it has the global tensor's
            dimensions (see ``prepend_axis_num``).
        global_shape: shape of the whole tensor.
        global_offset: index of the piece's first element in the whole tensor.
        axis_fragmentations: pieces per axis; None derives ``global_shape[i] // local_shape[i]``,
            a given value must equal that.
        replica_id: 0 (or all zeros) for the copy this rank writes; any other value marks a copy
            that is only read (another rank writes the same piece).
        prepend_axis_num: leading axes the global tensor has and ``data`` lacks. Construction
            views ``data`` with them (size 1), keeps the caller's shape in ``data_shape`` (what
            ``load`` returns) and sets this to 0.
        allow_shape_mismatch: must be False (loading a stored tensor of another global shape,
            e.g. a padded vocabulary, is not supported yet).
        flattened_range: must be None (a flat slice of the piece is not supported yet).
        data_shape: shape of the tensor the caller described when ``data`` is a view of it with
            split axes (strided TP shards, prepended axes); ``load`` returns the tensor in that shape.

    ``ShardedTensor.from_global`` builds one from the data and its place (dtype and local shape
    read from the data).
    """

    key: str
    data: torch.Tensor = field(repr=False)
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: Union[int, Tuple[int, ...]] = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None
    data_shape: Optional[Tuple[int, ...]] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self._check_supported()
        self.replica_id = replica_number(self.replica_id)
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(o) for o in self.global_offset)
        self._prepend_axes()
        self._check_geometry()
        derived = tuple(full // local if local else 1 for full, local in zip(self.global_shape, self.local_shape))
        if self.axis_fragmentations is not None and tuple(self.axis_fragmentations) != derived:
            raise ValueError(
                f"ShardedTensor {self.key!r}: axis_fragmentations={tuple(self.axis_fragmentations)} does not match "
                f"global_shape={self.global_shape} over local_shape={self.local_shape} ({derived})"
            )
        self.axis_fragmentations = derived

    @classmethod
    def from_global(
        cls,
        key: str,
        data: torch.Tensor,
        global_shape: Tuple[int, ...],
        global_offset: Tuple[int, ...],
        replica_id: Union[int, Tuple[int, ...]] = 0,
        *,
        data_shape: Optional[Tuple[int, ...]] = None,
    ) -> ShardedTensor:
        """``data`` placed at ``global_offset`` of a tensor of ``global_shape`` (same number of dimensions)."""
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            global_shape,
            global_offset,
            None,
            replica_id,
            data_shape=data_shape,
        )

    def validate_metadata_integrity(self) -> None:
        """Re-check the fields against ``data`` and each other (construction already did)."""
        self._check_supported()
        self._check_geometry()

    @property
    def has_regular_grid(self) -> bool:
        """Always True here: every piece has derived ``axis_fragmentations``."""
        return self.axis_fragmentations is not None

    def global_slice(self) -> Tuple[slice, ...]:
        """The piece's region of the global tensor, one slice per axis (prepended axes included)."""
        return tuple(slice(o, o + n) for o, n in zip(self.global_offset, self.local_shape))

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        """The piece's index in the grid of equal pieces (each offset a multiple of the local size)."""
        for off, size in zip(self.global_offset, self.local_shape):
            if size and off % size:
                raise ValueError(f"ShardedTensor {self.key!r}: offset {off} is not a multiple of the piece size {size}")
        return tuple(off // size if size else 0 for off, size in zip(self.global_offset, self.local_shape))

    def max_allowed_chunks(self) -> Tuple[int, ...]:
        """Per axis, ``global_shape // axis_fragmentations`` (upstream's meaning: the size of one grid piece)."""
        return tuple(full // frag for full, frag in zip(self.global_shape, self.axis_fragmentations))

    def _check_supported(self) -> None:
        if self.data is None:
            raise ValueError(f"ShardedTensor {self.key!r}: data=None is not supported (a piece needs its tensor)")
        if self.allow_shape_mismatch:
            raise NotImplementedError(f"ShardedTensor {self.key!r}: allow_shape_mismatch=True not supported yet")
        if self.flattened_range is not None:
            raise NotImplementedError(
                f"ShardedTensor {self.key!r}: flattened_range={self.flattened_range} not supported yet"
            )
        if self.dtype != self.data.dtype or tuple(self.local_shape) != tuple(self.data.shape):
            raise ValueError(
                f"ShardedTensor {self.key!r}: dtype={self.dtype} and local_shape={tuple(self.local_shape)} must be "
                f"data's ({self.data.dtype}, {tuple(self.data.shape)})"
            )

    def _prepend_axes(self) -> None:
        """View ``data`` with the ``prepend_axis_num`` leading axes of size 1 the global tensor has."""
        if self.prepend_axis_num < 0:
            raise ValueError(f"ShardedTensor {self.key!r}: prepend_axis_num={self.prepend_axis_num} must be >= 0")
        if self.prepend_axis_num:
            if self.data_shape is None:
                self.data_shape = tuple(self.data.shape)
            self.data = self.data.view((1,) * self.prepend_axis_num + tuple(self.data.shape))
            self.prepend_axis_num = 0
        self.local_shape = tuple(self.data.shape)

    def _check_geometry(self) -> None:
        local = self.local_shape
        if not (len(local) == len(self.global_shape) == len(self.global_offset)):
            raise ValueError(
                f"ShardedTensor {self.key!r}: local shape {local}, global shape {self.global_shape} "
                f"and offset {self.global_offset} must have the same number of dimensions"
            )
        for dim, (size, full, start) in enumerate(zip(local, self.global_shape, self.global_offset)):
            if start < 0 or start + size > full:
                raise ValueError(
                    f"ShardedTensor {self.key!r}: dim {dim} covers [{start}, {start + size}) "
                    f"outside the global size {full}"
                )
        if self.replica_id < 0:
            raise ValueError(f"ShardedTensor {self.key!r}: replica_id={self.replica_id} must be >= 0")

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: Tuple[int, int, int],
        replica_id: Union[int, Tuple[int, ...]] = 0,
        prepend_axis_num: int = 0,
        flattened_range: Optional[slice] = None,
    ) -> ShardedTensor:
        """Megatron-core's constructor: ``data`` is piece ``rank`` of ``fragments`` along ``axis``.

        Args:
            key: checkpoint key.
            data: this rank's piece.
            *rank_offsets: ``(axis, rank_along_axis, fragments_along_axis)`` per sharded axis; the
                axes count the ``prepend_axis_num`` leading axes of size 1 added to ``data``.
            replica_id: 0 (or all zeros) for the copy this rank writes.
            prepend_axis_num: leading axes the global tensor has and ``data`` lacks.
            flattened_range: not supported yet (a flat slice of the piece, for distributed
                optimizer state); must be None.
        """
        if flattened_range is not None:
            raise NotImplementedError(f"ShardedTensor {key!r}: flattened_range={flattened_range} not supported yet")
        view = data.view((1,) * prepend_axis_num + tuple(data.shape))
        full, offset = list(view.shape), [0] * view.dim()
        for axis, rank, fragments in rank_offsets:
            if not 0 <= axis < view.dim() or not 0 <= rank < fragments:
                raise ValueError(f"ShardedTensor {key!r}: rank offset {(axis, rank, fragments)} for shape {full}")
            offset[axis] = rank * view.shape[axis]
            full[axis] = fragments * view.shape[axis]
        return cls.from_global(key, view, tuple(full), tuple(offset), replica_id, data_shape=tuple(data.shape))

    def with_data(self, key: str, data: torch.Tensor) -> ShardedTensor:
        """Same geometry for another tensor of the same numel (optimizer state of a parameter).

        ``data`` is viewed to the local shape, so filling the result fills ``data``.
        """
        if data.numel() != self.data.numel():
            raise ValueError(
                f"{key!r}: tensor with {data.numel()} elements cannot take the geometry of "
                f"{self.key!r} (local shape {self.local_shape})"
            )
        return ShardedTensor.from_global(
            key,
            data.view(self.local_shape),
            self.global_shape,
            self.global_offset,
            self.replica_id,
            data_shape=tuple(data.shape),
        )


def replica_number(replica_id: Union[int, Tuple[int, ...]]) -> int:
    """An int replica id: Megatron-core's tuple form (all zeros: the written copy) becomes 0 or 1."""
    if isinstance(replica_id, (tuple, list)):
        if any(int(r) < 0 for r in replica_id):
            raise ValueError(f"replica_id={replica_id}: entries must be >= 0")
        return 0 if all(int(r) == 0 for r in replica_id) else 1
    return int(replica_id)


@dataclass
class ShardedObject:
    """A piece of plain data (numbers, strings, lists, dicts, tensors, ``BytesIO``) sharded like a tensor of objects.

    Stored as JSON (``dist_checkpointing/plain_data.py``), never pickled: a value that is not plain
    data raises ``TypeError`` on save. ``global_shape`` / ``global_offset`` place the piece in a grid
    of objects; the copy with ``replica_id`` 0 is written.
    """

    key: str
    data: Any
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: Union[int, Tuple[int, ...]] = 0

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(o) for o in self.global_offset)
        self.replica_id = replica_number(self.replica_id)
        if len(self.global_shape) != len(self.global_offset) or any(
            not 0 <= o < s for o, s in zip(self.global_offset, self.global_shape)
        ):
            raise ValueError(
                f"ShardedObject {self.key!r}: offset {self.global_offset} outside shape {self.global_shape}"
            )

    @property
    def unique_key(self) -> str:
        """``key`` plus this piece's place in the grid: one stored file per piece."""
        offsets = ".".join(map(str, self.global_offset)) or "0"
        shape = ".".join(map(str, self.global_shape)) or "1"
        return f"{self.key}/shard_{offsets}_{shape}"


@dataclass
class ShardedTensorFactory:
    """A tensor stored as what ``build_fn`` makes of it and rebuilt by ``merge_fn`` on load.

    ``build_fn(key, data, replica_id, flattened_range)`` returns a (nested) sharded state dict;
    ``merge_fn(loaded)`` turns the loaded form of that dict back into the tensor.
    """

    key: str
    data: torch.Tensor
    build_fn: Callable[..., Any]
    merge_fn: Callable[[Any], Any]
    replica_id: Union[int, Tuple[int, ...]] = 0
    flattened_range: Optional[slice] = None

    def build(self) -> Any:
        """The sharded state dict this factory stands for."""
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)


class LocalNonpersistentObject:
    """A value kept on this rank and never saved: ``load`` returns it as it was passed in."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        """The wrapped value."""
        return self.obj


def apply_factories(sharded_state_dict: Any) -> None:
    """Replace, in place, every ShardedTensorFactory of a nested dict (or list) by what it builds."""
    items = sharded_state_dict.items() if isinstance(sharded_state_dict, dict) else enumerate(sharded_state_dict)
    for key, value in list(items):
        if isinstance(value, ShardedTensorFactory):
            sharded_state_dict[key] = value.build()
        elif isinstance(value, (dict, list)):
            apply_factories(value)


ShardedBase = Union[ShardedTensor, ShardedObject]
# Flat (our model and optimizer dicts: key -> ShardedTensor of that key) or nested as in Megatron-core
# (dicts and lists whose leaves are ShardedTensor, ShardedObject, ShardedTensorFactory,
# LocalNonpersistentObject or plain "common" values).
ShardedStateDict = Dict[str, Any]


def tensor_parallel_geometry(
    local_shape: Tuple[int, ...], partition_dim: int, stride: int, tp_rank: int, tp_size: int
) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
    """(view shape, global shape, global offset) of a TP shard.

    With stride 1, shard ``r`` is the ``r``-th contiguous block of ``partition_dim``.
    With stride ``k`` the full dim is ``k * tp`` blocks and rank ``r`` holds blocks
    ``r, r + tp, ...`` (e.g. SwiGLU's ``[gate_r; up_r]``). That is a regular slice once
    the dim is split into ``(k, size / k)``: the shard is viewed as
    ``[..., k, m, ...]`` of the global ``[..., k, m * tp, ...]`` at offset ``r * m``.
    """
    d = partition_dim % len(local_shape)
    if stride == 1:
        view = tuple(local_shape)
        full = view[:d] + (view[d] * tp_size,) + view[d + 1 :]
        offset = tuple(tp_rank * view[d] if i == d else 0 for i in range(len(view)))
        return view, full, offset
    m = divide(local_shape[d], stride)
    view = tuple(local_shape[:d]) + (stride, m) + tuple(local_shape[d + 1 :])
    full = view[:d] + (stride, m * tp_size) + view[d + 2 :]
    offset = tuple(tp_rank * m if i == d + 1 else 0 for i in range(len(view)))
    return view, full, offset


def sharded_tensor_for(key: str, tensor: torch.Tensor, tp_rank: int, tp_size: int, replica_id: int) -> ShardedTensor:
    """A ShardedTensor for a parameter (or buffer) from its TP attributes.

    Replicated tensors (``tensor_model_parallel`` False) are whole tensors; only
    TP rank 0 of them is written, on top of the data-parallel ``replica_id``.
    """
    if getattr(tensor, "tensor_model_parallel", False):
        view, full, offset = tensor_parallel_geometry(
            tuple(tensor.shape), tensor.partition_dim, getattr(tensor, "partition_stride", 1), tp_rank, tp_size
        )
        return ShardedTensor.from_global(
            key, tensor.detach().view(view), full, offset, replica_id, data_shape=tuple(tensor.shape)
        )
    shape = tuple(tensor.shape)
    return ShardedTensor.from_global(key, tensor.detach(), shape, (0,) * len(shape), tp_rank + tp_size * replica_id)
