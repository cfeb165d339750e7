"""The sample index of the masked-LM datasets: runs of whole sentences cut from each document.

A re-implementation of the semantics of megatron-core's C++ ``helpers.build_mapping`` so that the
same documents, lengths and seed give the same ``(first sentence, end sentence, target length)``
rows in the same (shuffled) order. Its two random streams are the C++ standard's engines:

* ``std::mt19937(seed)`` picks the target lengths. NumPy's legacy ``RandomState(seed)`` is the same
  engine with the same seeding for a 32-bit seed, and ``randint(0, 2**32, dtype=uint32)`` returns its
  raw outputs (checked in the tests against the standard's 10000th-output value).
* ``std::mt19937_64(seed + 1)`` drives the final Fisher-Yates shuffle; :class:`Mt19937_64` is a
  vectorised NumPy implementation of that engine.

The walk over the sentences is plain Python (about 0.3 s per 10^6 sentences and epoch; the
shuffle about 1 s per 10^6 rows).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import numpy as np

# Documents of several sentences holding a sentence longer than this are skipped (as upstream).
LONG_SENTENCE_LEN = 512

_MT64_N, _MT64_M = 312, 156
_MT64_MATRIX = np.uint64(0xB5026F5AA96619E9)
_MT64_UPPER = np.uint64(0xFFFFFFFF80000000)
_MT64_LOWER = np.uint64(0x000000007FFFFFFF)
_MASK64 = (1 << 64) - 1


class Mt19937_64:
    """The 64-bit Mersenne Twister of C++'s ``std::mt19937_64``, seeded like its constructor."""

    def __init__(self, seed: int) -> None:
        state = [int(seed) & _MASK64]
        for i in range(1, _MT64_N):
            prev = state[-1]
            state.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & _MASK64)
        self._state = np.array(state, dtype=np.uint64)
        self._out = np.empty(0, dtype=np.uint64)

    def _twist(self) -> None:
        """Regenerate the 312 state words: two vectorised halves and the last word."""
        mt, n, m = self._state, _MT64_N, _MT64_M
        one = np.uint64(1)
        for lo, hi in ((0, n - m), (n - m, n - 1)):
            idx = np.arange(lo, hi)
            y = (mt[idx] & _MT64_UPPER) | (mt[idx + 1] & _MT64_LOWER)
            mt[idx] = mt[(idx + m) % n] ^ (y >> one) ^ np.where(y & one, _MT64_MATRIX, np.uint64(0))
        y = (mt[n - 1] & _MT64_UPPER) | (mt[0] & _MT64_LOWER)
        mt[n - 1] = mt[m - 1] ^ (y >> one) ^ (_MT64_MATRIX if y & one else np.uint64(0))

    def _block(self) -> np.ndarray:
        """The next 312 tempered outputs."""
        self._twist()
        y = self._state.copy()
        y ^= (y >> np.uint64(29)) & np.uint64(0x5555555555555555)
        y ^= (y << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
        y ^= (y << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
        y ^= y >> np.uint64(43)
        return y

    def draw(self, count: int) -> np.ndarray:
        """The next ``count`` outputs as uint64."""
        blocks = [self._out]
        have = self._out.size
        while have < count:
            blocks.append(self._block())
            have += _MT64_N
        out = np.concatenate(blocks)
        self._out = out[count:]
        return out[:count]


class Mt19937Stream:
    """Raw outputs of ``std::mt19937(seed)``, one at a time, drawn from NumPy in batches."""

    _BATCH = 4096

    def __init__(self, seed: int) -> None:
        self._rng = np.random.RandomState(int(seed) & 0xFFFFFFFF)
        self._buf: List[int] = []
        self._pos = 0

    def draw(self, count: int) -> np.ndarray:
        """The next ``count`` outputs as uint32 (only valid before any :meth:`next`)."""
        return self._rng.randint(0, 2**32, size=count, dtype=np.uint32)

    def next(self) -> int:
        """The next output."""
        if self._pos == len(self._buf):
            self._buf = self.draw(self._BATCH).tolist()
            self._pos = 0
        self._pos += 1
        return self._buf[self._pos - 1]


def short_sequence_ratio(short_seq_prob: float) -> int:
    """``round(1 / p)`` rounding halves away from zero (as C's ``round``); 0 for p = 0."""
    if short_seq_prob <= 0:
        return 0
    return int(np.floor(1.0 / short_seq_prob + 0.5))


def eligible_documents(document_bounds: np.ndarray, sentence_lengths: np.ndarray, min_num_sent: int) -> np.ndarray:
    """Positions of the documents that give samples: at least ``min_num_sent`` sentences and,
    when they have several, none longer than :data:`LONG_SENTENCE_LEN`."""
    bounds = np.asarray(document_bounds, dtype=np.int64)
    counts = np.diff(bounds)
    long_sentence = np.asarray(sentence_lengths) > LONG_SENTENCE_LEN
    long_before = np.concatenate([[0], np.cumsum(long_sentence, dtype=np.int64)])
    has_long = long_before[bounds[1:]] > long_before[bounds[:-1]]
    return np.flatnonzero((counts >= min_num_sent) & ~((counts > 1) & has_long))


def _walk_epoch(
    bounds: List[int],
    sizes: List[int],
    docs: List[int],
    min_num_sent: int,
    target: Callable[[], int],
    rows: List[Tuple[int, int, int]],
) -> None:
    """Append one epoch of samples: greedy runs of sentences that reach the target length."""
    for d in docs:
        first, last = bounds[d], bounds[d + 1]
        remaining = last - first
        start, seq_len, num_sent = first, 0, 0
        goal = target()
        for sent in range(first, last):
            seq_len += sizes[sent]
            num_sent += 1
            remaining -= 1
            if remaining == 0 or (seq_len >= goal and remaining > 1 and num_sent >= min_num_sent):
                rows.append((start, sent + 1, goal))
                start, seq_len, num_sent = sent + 1, 0, 0
                goal = target()


def _shuffle_rows(rows: np.ndarray, seed: int) -> np.ndarray:
    """Fisher-Yates from the last row down, ``j = mt19937_64() % (i + 1)``."""
    n = rows.shape[0]
    if n < 2:
        return rows
    i = np.arange(n - 1, 0, -1, dtype=np.uint64)
    j = (Mt19937_64(seed + 1).draw(n - 1) % (i + np.uint64(1))).tolist()
    perm = list(range(n))
    for a, b in zip(range(n - 1, 0, -1), j):
        perm[a], perm[b] = perm[b], perm[a]
    return rows[np.asarray(perm, dtype=np.int64)]


def build_mapping(
    document_bounds: np.ndarray,
    sentence_lengths: np.ndarray,
    num_samples: Optional[int],
    max_seq_length: int,
    short_seq_prob: float,
    seed: int,
    min_num_sent: int,
) -> np.ndarray:
    """The shuffled ``[n, 3]`` sample index (uint32, or uint64 for > 2^32 - 1 sentences).

    Args:
        document_bounds: sentence ids where each document starts, then the end of the last one.
        sentence_lengths: tokens of every sentence of the low-level dataset.
        num_samples: whole epochs are walked until at least this many rows exist (all are kept,
            as upstream); None walks one epoch.
        max_seq_length: the target length of a sample (without special tokens).
        short_seq_prob: probability of a target length drawn uniformly from ``[2, max_seq_length]``.
        seed: seeds the target-length stream (``seed``) and the shuffle (``seed + 1``).
        min_num_sent: fewest sentences per sample.

    Raises:
        ValueError: more samples are requested but an epoch gives none (upstream loops ~2^31 epochs).
    """
    bounds = np.asarray(document_bounds, dtype=np.int64)
    docs = eligible_documents(bounds, sentence_lengths, min_num_sent).tolist()
    ratio = short_sequence_ratio(short_seq_prob)
    stream = Mt19937Stream(seed)

    def target() -> int:
        if ratio == 0:
            return max_seq_length
        r = stream.next()
        return 2 + r % (max_seq_length - 1) if r % ratio == 0 else max_seq_length

    rows: List[Tuple[int, int, int]] = []
    bounds_list, sizes = bounds.tolist(), np.asarray(sentence_lengths).tolist()
    while True:
        if num_samples is not None and len(rows) >= num_samples:
            break
        if num_samples is not None and not docs:
            raise ValueError(f"no document has {min_num_sent} or more usable sentences: no sample can be built")
        _walk_epoch(bounds_list, sizes, docs, min_num_sent, target, rows)
        if num_samples is None:
            break
    dtype = np.uint64 if len(sizes) > np.iinfo(np.uint32).max else np.uint32
    table = np.array(rows, dtype=dtype).reshape(-1, 3)
    return _shuffle_rows(table, seed)
