"""NumPy references for small float formats, built from the format definitions alone.

Every code of a format is decoded from its sign / exponent / mantissa fields; rounding picks the
nearest representable value by brute-force search, ties going to the even code (mantissa LSB 0).
Nothing here calls torch's float8 casts, so the quantizers are checked against the definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np


@dataclass(frozen=True)
class FloatFormat:
    """A sign + ``exp_bits`` + ``man_bits`` format; ``special`` says which top codes are not finite."""

    exp_bits: int
    man_bits: int
    bias: int
    special: str  # "fn": only all-ones is NaN; "ieee": top exponent is inf/NaN; "none": all finite

    def magnitudes(self) -> tuple[np.ndarray, np.ndarray]:
        """(values, codes) of every finite non-negative code, sorted by value."""
        return _magnitudes(self)

    @property
    def max(self) -> float:
        return float(self.magnitudes()[0][-1])


@cache
def _magnitudes(fmt: FloatFormat) -> tuple[np.ndarray, np.ndarray]:
    """Decode every code of ``fmt`` from its fields (cached: the test references call it per block)."""
    values, codes = [], []
    for code in range(1 << (fmt.exp_bits + fmt.man_bits)):
        e, m = code >> fmt.man_bits, code & ((1 << fmt.man_bits) - 1)
        top_e = e == (1 << fmt.exp_bits) - 1
        if (fmt.special == "ieee" and top_e) or (fmt.special == "fn" and top_e and m == (1 << fmt.man_bits) - 1):
            continue
        frac = m / (1 << fmt.man_bits)
        value = frac * 2.0 ** (1 - fmt.bias) if e == 0 else (1 + frac) * 2.0 ** (e - fmt.bias)
        values.append(value)
        codes.append(code)
    order = np.argsort(values)
    return np.array(values)[order], np.array(codes)[order]


E4M3 = FloatFormat(exp_bits=4, man_bits=3, bias=7, special="fn")
E5M2 = FloatFormat(exp_bits=5, man_bits=2, bias=15, special="ieee")
E2M1 = FloatFormat(exp_bits=2, man_bits=1, bias=1, special="none")


def round_nearest_even(y: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Round ``y`` to ``fmt`` (saturating at its max), ties to the even code; NaN/inf give NaN."""
    values, codes = fmt.magnitudes()
    a = np.abs(y.astype(np.float64)).reshape(-1)
    finite = np.isfinite(a)
    a = np.where(finite, np.minimum(a, values[-1]), 0.0)
    dist = np.abs(a[:, None] - values[None, :])  # [n, num_values]
    nearest = dist == dist.min(axis=1, keepdims=True)
    # among equally near values prefer the even code: penalize odd codes, then take the nearest
    pick = np.argmax(nearest * (2 - (codes[None, :] & 1)), axis=1)
    out = np.where(finite, np.sign(y.reshape(-1)) * values[pick], np.nan)
    return out.reshape(y.shape)


def neighbours(a: np.ndarray, fmt: FloatFormat) -> tuple[np.ndarray, np.ndarray]:
    """The representable magnitudes just below-or-at and just above-or-at ``|a|`` (saturating)."""
    values, _ = fmt.magnitudes()
    a = np.minimum(np.abs(a.astype(np.float64)), values[-1])
    lo = values[np.searchsorted(values, a, side="right") - 1]
    hi = values[np.minimum(np.searchsorted(values, a, side="left"), len(values) - 1)]
    return lo, hi


def blocks(shape: tuple[int, int], block: tuple[int, int]):
    """Yield ``(bi, bj, row_slice, col_slice)`` for every (possibly ragged) block."""
    for bi, r0 in enumerate(range(0, shape[0], block[0])):
        for bj, c0 in enumerate(range(0, shape[1], block[1])):
            yield bi, bj, slice(r0, r0 + block[0]), slice(c0, c0 + block[1])
