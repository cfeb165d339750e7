"""Index builders for the GPT and blended datasets: pure functions of arrays and a RandomState.

Everything here is data first (STYLE.md item 8): the indices can be built, printed and tested
without any file or process. The sample index is vectorised (cumulative sums plus a binary
search), so building the indices of 10^9 tokens takes seconds. The blending index is a greedy
loop over samples (about 0.2 s per 10^6 samples for two datasets); it is built once and cached.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

# A last partial epoch that needs fewer than this fraction of an epoch's samples is shuffled
# apart from the full epochs, so that its few samples are not all drawn from the same documents.
SEPARATE_LAST_EPOCH_FRACTION = 0.80


def smallest_int_dtype(max_value: int) -> type:
    """int32 when ``max_value`` fits in it, int64 otherwise (halves the size of most indices)."""
    return np.int32 if max_value < np.iinfo(np.int32).max else np.int64


def get_num_epochs(
    tokens_per_epoch: int, sequence_length: int, num_samples: Optional[int], add_extra_token: bool
) -> int:
    """Number of passes over the documents needed for ``num_samples`` samples.

    One sample consumes ``sequence_length`` tokens; the very last sample also needs the
    extra label token when ``add_extra_token`` is set.
    """
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise ValueError(f"tokens_per_epoch={tokens_per_epoch}: the split holds no tokens")
    needed = num_samples * sequence_length + int(add_extra_token)
    return max(1, -(-needed // tokens_per_epoch))


def separate_last_epoch(
    num_epochs: int, tokens_per_epoch: int, sequence_length: int, num_samples: Optional[int], add_extra_token: bool
) -> Tuple[bool, int]:
    """Whether the last epoch is shuffled on its own, and the samples in the epochs before it.

    Returns:
        ``(separate, samples_before_last_epoch)``; ``separate`` is True when the last epoch
        contributes fewer than 80% of an epoch's samples.
    """
    if num_epochs == 1 or num_samples is None:
        return False, 0
    extra = int(add_extra_token)
    before_last = ((num_epochs - 1) * tokens_per_epoch - extra) // sequence_length
    from_last = num_samples - before_last
    per_epoch = (tokens_per_epoch - extra) // sequence_length
    # The last epoch can hold one sample more than a lone epoch: it inherits the shared token.
    if not 0 <= from_last <= per_epoch + 1:
        raise RuntimeError(f"samples from the last epoch ({from_last}) outside [0, {per_epoch + 1}]")
    return from_last < int(SEPARATE_LAST_EPOCH_FRACTION * per_epoch), before_last


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """Document ids repeated ``num_epochs`` times and shuffled.

    With ``separate_final_epoch`` the first ``num_epochs - 1`` epochs are shuffled together and
    the last one on its own, so the last partial epoch still sees a uniform document mix.
    """
    documents = np.asarray(documents)
    dtype = smallest_int_dtype(int(documents.max(initial=0)))
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(documents.astype(dtype), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(
    sequence_lengths: np.ndarray,
    document_index: np.ndarray,
    sequence_length: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token: bool = True,
) -> np.ndarray:
    """Start of every sample in the stream of documents listed by ``document_index``.

    Sample ``i`` starts at stream position ``i * sequence_length`` and spans
    ``sequence_length + add_extra_token`` tokens, so consecutive samples share one token.

    Args:
        sequence_lengths: tokens of every document of the low-level dataset (indexed by id).
        document_index: document ids in stream order.
        sequence_length: input tokens per sample.
        drop_last_partial_sequence: drop a last sample that would be short; otherwise keep it
            (it ends at the last token of the stream and is padded when read).
        add_extra_token: samples carry one extra token for the labels.

    Returns:
        ``[num_samples + 1, 2]`` array: row ``i`` is (position in ``document_index``, token
        offset in that document) of sample ``i``'s first token; row ``i + 1`` is where sample
        ``i`` ends (its extra token when ``add_extra_token``, else one past its last token).
    """
    if sequence_length < 1:
        raise ValueError(f"sequence_length={sequence_length}: must be positive")
    extra = int(add_extra_token)
    lengths = np.asarray(sequence_lengths)[np.asarray(document_index)].astype(np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if ends.size else 0
    usable = max(total - extra, 0)
    num_samples = usable // sequence_length if drop_last_partial_sequence else -(-usable // sequence_length)
    positions = np.arange(num_samples + 1, dtype=np.int64) * sequence_length
    positions = np.minimum(positions, usable)  # a kept partial last sample ends at the stream's end
    # Without the extra token a sample ends one past its last token: it stays in the document
    # holding that last token (offset may equal the document's length), as Megatron does.
    doc_pos = np.searchsorted(ends, positions - 1 + extra, side="right")
    doc_pos = np.minimum(doc_pos, max(len(lengths) - 1, 0))
    offsets = positions - (ends[doc_pos] - lengths[doc_pos]) if ends.size else positions
    index = np.empty((num_samples + 1, 2), dtype=smallest_int_dtype(max(len(lengths), int(lengths.max(initial=0)))))
    index[:, 0] = doc_pos
    index[:, 1] = offsets
    index[0] = 0
    return index


def build_sample_idx(
    sizes: np.ndarray,
    document_indices: np.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: bool = True,
) -> np.ndarray:
    """Megatron-core's name and arguments for ``build_sample_index``.

    ``num_epochs x tokens_per_epoch`` must be the number of tokens ``document_indices`` lists
    (upstream sizes the index from them; here they are checked, ``ValueError``).
    """
    stream = int(np.asarray(sizes)[np.asarray(document_indices)].astype(np.int64).sum())
    if num_epochs * tokens_per_epoch != stream:
        raise ValueError(
            f"num_epochs={num_epochs} x tokens_per_epoch={tokens_per_epoch} != {stream} tokens in document_indices"
        )
    return build_sample_index(
        sizes, document_indices, sequence_length, drop_last_partial_sequence, add_extra_token_to_sequence
    )


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of ``range(total_size)`` that shuffles ``[0, num_samples)`` and the rest apart."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def _greedy_blend_python(
    weights: np.ndarray, size: int, dataset_index: np.ndarray, dataset_sample_index: np.ndarray
) -> None:
    """Fill the blending indices: each step serves the dataset furthest behind its share."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    others = range(1, len(w))
    for step in range(size):
        # Step 0 uses 1 so that the first sample goes to the heaviest dataset.
        x = step if step else 1
        best, best_error = 0, w[0] * x - counts[0]
        for i in others:
            error = w[i] * x - counts[i]
            if error > best_error:
                best, best_error = i, error
        dataset_index[step] = best
        dataset_sample_index[step] = counts[best]
        counts[best] += 1


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Interleave datasets so that after n samples dataset i has delivered about ``w_i * n``.

    Args:
        weights: normalised non-negative weights, one per dataset.
        size: number of samples of the blend.

    Returns:
        ``(dataset_index, dataset_sample_index)``: for each blended sample, which dataset it
        comes from and the running count of that dataset's samples.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if weights.ndim != 1 or weights.size == 0 or (weights < 0).any():
        raise ValueError(f"weights={weights.tolist()}: need a non-empty list of non-negative numbers")
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    _greedy_blend_python(weights, size, dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Blending indices that simply concatenate whole datasets (no weights given)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    dataset_index = np.repeat(np.arange(len(sizes), dtype=np.int16), sizes)
    starts = np.repeat(np.cumsum(sizes) - sizes, sizes)
    dataset_sample_index = np.arange(int(sizes.sum()), dtype=np.int64) - starts
    return dataset_index, dataset_sample_index
