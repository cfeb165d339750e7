"""Which layer of a hybrid stack is Mamba, attention, MLP or MoE (Megatron-core's symbols and rules).

A pattern such as ``M-M-M*-M-`` names every layer; without one, ``--hybrid-attention-ratio`` and
``--hybrid-mlp-ratio`` place that share of attention layers evenly between Mamba runs (starting and
ending with Mamba), then MLP layers evenly over the remaining Mamba slots, as Megatron-core does,
so the same flags give the same layer numbers and checkpoint keys.
"""

from __future__ import annotations

from typing import List, Optional


class Symbols:
    """One character per layer type."""

    MAMBA = "M"
    ATTENTION = "*"
    MLP = "-"
    MOE = "E"
    VALID = (MAMBA, ATTENTION, MLP, MOE)


def _place(types: List[str], symbol: str, count: int) -> None:
    """Turn ``count`` of the Mamba slots of ``types`` into ``symbol``, spread evenly over them.

    A walker moves over the Mamba slots: it stands ``gap`` slots before the next placement (``gap``:
    the Mamba slots left per section between placements) and places when less than half a slot remains.
    """
    if count <= 0:
        return
    mamba_left = types.count(Symbols.MAMBA) - count
    gap = mamba_left / (count + 1) if symbol == Symbols.ATTENTION else mamba_left / count
    ahead = gap
    for i, kind in enumerate(types):
        if kind != Symbols.MAMBA:
            continue
        if ahead < 0.5:
            types[i] = symbol
            ahead += gap
        else:
            ahead -= 1


def _from_ratios(num_layers: int, attention_ratio: float, mlp_ratio: float) -> List[str]:
    types = [Symbols.MAMBA] * num_layers
    _place(types, Symbols.ATTENTION, round(num_layers * attention_ratio))
    _place(types, Symbols.MLP, round(num_layers * mlp_ratio))
    return types


def _check_pattern(num_layers: int, pattern: str) -> List[str]:
    if len(pattern) != num_layers:
        raise ValueError(f"hybrid_override_pattern={pattern!r} has {len(pattern)} layers; num_layers={num_layers}")
    unknown = sorted(set(pattern) - set(Symbols.VALID))
    if unknown:
        raise ValueError(f"hybrid_override_pattern={pattern!r}: {unknown} not among the layer symbols {Symbols.VALID}")
    return list(pattern)


def allocate_layers(
    total_layers_count: int,
    target_attention_ratio: float,
    target_mlp_ratio: float,
    override_pattern: Optional[str] = None,
) -> List[str]:
    """The symbol of every layer (Megatron-core's function). With a pattern and nonzero ratios, the
    pattern must hold as many layers of each type as the ratios would."""
    if total_layers_count <= 0:
        raise ValueError(f"num_layers={total_layers_count}: must be positive")
    for name, value in (("hybrid_attention_ratio", target_attention_ratio), ("hybrid_mlp_ratio", target_mlp_ratio)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}={value}: must be in [0, 1]")
    if target_attention_ratio + target_mlp_ratio > 1.0:
        raise ValueError(
            f"hybrid_attention_ratio={target_attention_ratio} + hybrid_mlp_ratio={target_mlp_ratio}: must be <= 1"
        )
    types = _from_ratios(total_layers_count, target_attention_ratio, target_mlp_ratio)
    if override_pattern is None:
        return types
    pattern = _check_pattern(total_layers_count, override_pattern)
    ratios_given = target_attention_ratio > 0.0 or target_mlp_ratio > 0.0
    if ratios_given and any(pattern.count(s) != types.count(s) for s in Symbols.VALID):
        raise ValueError(
            f"hybrid_override_pattern={override_pattern!r} must hold as many layers of each type as the "
            f"ratios give ({''.join(types)!r})"
        )
    return pattern
