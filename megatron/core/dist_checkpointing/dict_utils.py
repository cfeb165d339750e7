"""Megatron-core's helpers over nested dicts and lists (state dicts); tuples and other objects are leaves.

The same names and signatures as ``megatron.core.dist_checkpointing.dict_utils`` of megatron-core 0.16.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, Iterator, List, Tuple, TypeVar, Union

import numpy as np
import torch

U, V = TypeVar("U"), TypeVar("V")
Nested = Union[dict, list]


def _put(target: Nested, key: Any, value: Any) -> None:
    if isinstance(target, dict):
        target[key] = value
    else:
        target.append(value)


def extract_matching_values(
    x: Nested, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> Tuple[Nested, Nested]:
    """Split ``x`` into (matching, non-matching) leaves by ``predicate``, keeping the nesting.

    A list becomes a ``{index: value}`` dict when ``return_lists_as_dicts`` (so indices survive);
    an empty container stays on the non-matching side.
    """
    if isinstance(x, dict):
        items, new = x.items(), dict
    elif isinstance(x, list):
        items, new = enumerate(x), (dict if return_lists_as_dicts else list)
    else:
        raise ValueError(f"extract_matching_values: the top level must be a dict or list, got {type(x)}")
    matching, other = new(), new()
    for key, value in items:
        if isinstance(value, (dict, list)) and (value or isinstance(x, dict)):
            sub_match, sub_other = extract_matching_values(value, predicate, return_lists_as_dicts)
            if sub_match:
                _put(matching, key, sub_match)
            if sub_other or not value:
                _put(other, key, sub_other)
        else:
            _put(matching if predicate(value) else other, key, value)
    return matching, other


def _leaf_mismatch(x1: Any, x2: Any, prefix: Tuple) -> List[tuple]:
    """``[(prefix, type1, type2, ...)]`` when two leaves differ, else ``[]``; tensors compare all elements."""
    if isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
        try:
            unequal = x1.cpu() != x2.cpu()  # broadcasting shapes compare; others raise
            return [(prefix, type(x1), type(x2), unequal.sum(), unequal.shape)] if unequal.any() else []
        except (RuntimeError, TypeError, ValueError):
            return [(prefix, type(x1), type(x2), x1.shape, x2.shape)]
    try:
        return [(prefix, type(x1), type(x2))] if bool(x1 != x2) else []
    except (RuntimeError, TypeError, ValueError):
        return [(prefix, type(x1), type(x2))]


def diff(x1: Any, x2: Any, prefix: Tuple = ()) -> Tuple[list, list, list]:
    """Recursive difference: (keys only in ``x1``, keys only in ``x2``, mismatching leaves).

    Keys are tuples of the path (for dicts) or indices (for sequences of unequal length); a
    mismatch is ``(path, type of left, type of right, ...)``. Sharded objects (anything with
    ``replica_id``) are compared by their ``data``.
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        pairs = [(x1[k], x2[k], prefix + (k,)) for k in x1.keys() & x2.keys()]
    elif isinstance(x1, (list, tuple, np.ndarray)):
        if type(x1) is not type(x2):
            return [], [], [(prefix, type(x1), type(x2))]
        left = list(range(len(x1) - 1, len(x2) - 1, -1))
        right = list(range(len(x2) - 1, len(x1) - 1, -1))
        pairs = [(a, b, prefix + (i,)) for i, (a, b) in enumerate(zip(x1, x2))]
    elif hasattr(x1, "replica_id") and hasattr(x2, "replica_id"):
        return diff(x1.data, x2.data, prefix + (type(x1),))
    else:
        return [], [], _leaf_mismatch(x1, x2, prefix)
    mismatch: list = []
    for a, b, path in pairs:
        sub_left, sub_right, sub_mismatch = diff(a, b, path)
        left += sub_left
        right += sub_right
        mismatch += sub_mismatch
    return left, right, mismatch


def inspect_types(x: Any, prefix: Tuple = (), indent: int = 4) -> None:
    """Print the type (tensors: the shape) of every leaf of ``x``, indented by depth."""
    pad = " " * indent * len(prefix)
    if isinstance(x, (dict, list)):
        print()
        marker = ">" if isinstance(x, dict) else "-"
        for key, value in x.items() if isinstance(x, dict) else enumerate(x):
            print(f"{pad}{marker} {key}: ", end="")
            inspect_types(value, prefix + (key,), indent)
    elif isinstance(x, torch.Tensor):
        print(f"Tensor of shape {x.shape}")
    else:
        try:
            text = str(x)
        except Exception:  # noqa: BLE001 - any __str__ may fail; the type is still worth printing
            text = "<no string repr>"
        print(f"[{type(x)}]: {text[:30] + '... (truncated)' if len(text) > 30 else text}")


def nested_items_iter(x: Nested) -> Iterator[Tuple[Nested, Any, Any]]:
    """Every leaf as ``(container, key, value)``, depth first."""
    for key, value in x.items() if isinstance(x, dict) else enumerate(x):
        if isinstance(value, (dict, list)):
            yield from nested_items_iter(value)
        else:
            yield x, key, value


def nested_values(x: Nested) -> Iterator[Any]:
    """Every leaf value of ``x``, depth first."""
    return (value for _, _, value in nested_items_iter(x))


def dict_map(f: Callable, d: dict) -> None:
    """Replace every leaf ``v`` of ``d`` by ``f(v)``, in place."""
    for container, key, value in list(nested_items_iter(d)):
        container[key] = f(value)


def dict_map_with_key(f: Callable, d: dict) -> None:
    """Replace every leaf ``v`` (under key ``k`` of its container) by ``f(k, v)``, in place."""
    for container, key, value in list(nested_items_iter(d)):
        container[key] = f(key, value)


def dict_list_map_inplace(f: Callable[[U], V], x: Union[Dict, List, U]) -> Union[Dict, List, V]:
    """Apply ``f`` to every leaf, changing the dicts and lists themselves; returns ``x`` (or ``f(x)`` for a leaf)."""
    if isinstance(x, dict):
        for key in x:
            x[key] = dict_list_map_inplace(f, x[key])
        return x
    if isinstance(x, list):
        x[:] = [dict_list_map_inplace(f, v) for v in x]
        return x
    return f(x)


def dict_list_map_outplace(f: Callable[[U], V], x: Union[Dict, List, U]) -> Union[Dict, List, V]:
    """A new nesting with ``f`` applied to every leaf of ``x``; ``x`` is left as it was."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def merge(x1: Nested, x2: Nested, key: Tuple[Union[str, int], ...] = ()) -> Nested:
    """Merge ``x2`` into ``x1`` (in place, returned): dict keys are united, lists merged element-wise.

    Two lists of different lengths, or a leaf present in both, raise ValueError naming the path.
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = merge(x1[k], v2, key + (k,)) if k in x1 else v2
        return x1
    if isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(f"merge: lists of lengths {len(x1)} and {len(x2)} at {key} cannot be merged")
        x1[:] = [merge(a, b, key + (i,)) for i, (a, b) in enumerate(zip(x1, x2))]
        return x1
    raise ValueError(f"merge: both sides hold a value at {key} (`{x1}` and `{x2}`), not a dict or list")


def map_reduce(
    xs: Iterable,
    key_fn: Callable = lambda x: x,
    value_fn: Callable = lambda x: x,
    reduce_fn: Callable = lambda x: x,
) -> dict:
    """Group ``value_fn(x)`` by ``key_fn(x)``, then reduce each group's list by ``reduce_fn`` (more_itertools')."""
    groups: Dict[Any, list] = defaultdict(list)
    for x in xs:
        groups[key_fn(x)].append(value_fn(x))
    return {k: reduce_fn(v) for k, v in groups.items()}
