"""Plain-data encoding for JSON files: small tensors, tuples and non-string keys survive a round trip.

Checkpoint side data (optimizer hyper-parameters and step counters, loss-scaler
state, RNG states) is stored as JSON rather than pickled, so reading a checkpoint
never runs arbitrary code. Anything other than None, bool, int, float, str, list,
tuple, dict, tensors and ``io.BytesIO`` buffers is refused with the path to the offending value.
A ``BytesIO`` (megatron-core stores some ``ShardedObject`` values so) keeps its bytes, base64 in
the JSON, and comes back as a ``BytesIO`` at position 0; what the bytes mean is the caller's.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import torch

_TENSOR, _TUPLE, _DICT, _BYTES = "__tensor__", "__tuple__", "__dict__", "__bytesio__"


def encode(value: Any, path: str = "$") -> Any:
    """``value`` as JSON-compatible data (see ``decode``)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        return {
            _TENSOR: {
                "dtype": str(t.dtype).replace("torch.", ""),
                "shape": list(t.shape),
                "data": t.reshape(-1).tolist(),
            }
        }
    if isinstance(value, io.BytesIO):
        return {_BYTES: base64.b64encode(value.getvalue()).decode("ascii")}
    if isinstance(value, tuple):
        return {_TUPLE: [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and k not in (_TENSOR, _TUPLE, _DICT, _BYTES) for k in value):
            return {k: encode(v, f"{path}.{k}") for k, v in value.items()}
        return {_DICT: [[encode(k, f"{path}<key>"), encode(v, f"{path}[{k!r}]")] for k, v in value.items()]}
    raise TypeError(f"{path}: a {type(value).__name__} cannot be stored as plain data")


def _decode_tensor(spec: dict) -> torch.Tensor:
    dtype = getattr(torch, spec["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {spec['dtype']!r}")
    return torch.tensor(spec["data"], dtype=dtype).reshape(spec["shape"])


def decode(value: Any) -> Any:
    """Inverse of ``encode``."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {_TENSOR}:
        return _decode_tensor(value[_TENSOR])
    if set(value) == {_BYTES}:
        return io.BytesIO(base64.b64decode(value[_BYTES]))
    if set(value) == {_TUPLE}:
        return tuple(decode(v) for v in value[_TUPLE])
    if set(value) == {_DICT}:
        return {_hashable(decode(k)): decode(v) for k, v in value[_DICT]}
    return {k: decode(v) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key
