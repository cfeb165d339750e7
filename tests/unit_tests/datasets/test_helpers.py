"""Index builders against slow, loop-by-loop reference constructions."""

import numpy as np
import pytest

from megatron.core.datasets import helpers


def slow_sample_index(lengths, doc_index, s, drop_last, extra):
    """Walk the documents token budget by token budget, one sample at a time."""
    total = sum(lengths[d] for d in doc_index)
    usable = total - extra
    n = usable // s if drop_last else -(-usable // s)
    rows = [(0, 0)]
    pos, offset = 0, 0
    for _ in range(n):
        need = s + extra
        while True:
            avail = lengths[doc_index[pos]] - offset
            if need <= avail:
                offset += need - extra  # the extra token is shared with the next sample
                break
            if pos == len(doc_index) - 1:  # partial last sample: ends at the stream's end
                offset = lengths[doc_index[pos]] - extra
                break
            need -= avail
            pos, offset = pos + 1, 0
        rows.append((pos, offset))
    return np.array(rows)


def stream_position(lengths, doc_index, row):
    return sum(lengths[d] for d in doc_index[: row[0]]) + row[1]


@pytest.mark.parametrize("extra", [1, 0])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("s", [1, 5, 17])
def test_sample_index_matches_slow_walk(extra, drop_last, s):
    rng = np.random.RandomState(3)
    lengths = rng.randint(1, 30, size=25)
    doc_index = rng.permutation(np.tile(np.arange(25), 2))
    got = helpers.build_sample_index(lengths, doc_index, s, drop_last, bool(extra))
    want = slow_sample_index(lengths.tolist(), doc_index.tolist(), s, drop_last, extra)
    np.testing.assert_array_equal(got, want)
    # Each row sits at its nominal stream position (clamped for a kept partial sample).
    usable = int(lengths[doc_index].sum()) - extra
    for i, row in enumerate(got):
        assert stream_position(lengths, doc_index, row) == min(i * s, usable)


def test_document_index_is_seeded_and_covers_each_epoch():
    docs = np.arange(10, 30)
    a = helpers.build_document_index(docs, 3, np.random.RandomState(5), separate_final_epoch=False)
    b = helpers.build_document_index(docs, 3, np.random.RandomState(5), separate_final_epoch=False)
    c = helpers.build_document_index(docs, 3, np.random.RandomState(6), separate_final_epoch=False)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert sorted(a.tolist()) == sorted(docs.tolist() * 3)


def test_separate_final_epoch_shuffles_last_epoch_alone():
    docs = np.arange(40)
    idx = helpers.build_document_index(docs, 3, np.random.RandomState(0), separate_final_epoch=True)
    assert sorted(idx[:80].tolist()) == sorted(docs.tolist() * 2)
    assert sorted(idx[80:].tolist()) == docs.tolist()


def slow_separate_rule(lengths, s, num_samples, extra):
    """Count epochs and samples by accumulating whole epochs of tokens."""
    per_epoch_tokens = sum(lengths)
    epochs, tokens = 1, per_epoch_tokens
    while tokens < num_samples * s + extra:
        epochs, tokens = epochs + 1, tokens + per_epoch_tokens
    if epochs == 1:
        return epochs, False
    before = ((epochs - 1) * per_epoch_tokens - extra) // s
    per_epoch = (per_epoch_tokens - extra) // s
    return epochs, (num_samples - before) < int(0.8 * per_epoch)  # Megatron truncates the threshold


@pytest.mark.parametrize("num_samples", [5, 40, 41, 60, 75, 79, 80, 81, 100, 119, 150, 159])
def test_eighty_percent_rule(num_samples):
    lengths = [10] * 8  # 80 tokens an epoch, 79 samples of one token plus the extra one
    s = 2
    epochs = helpers.get_num_epochs(sum(lengths), s, num_samples, True)
    separate, before = helpers.separate_last_epoch(epochs, sum(lengths), s, num_samples, True)
    want_epochs, want_separate = slow_separate_rule(lengths, s, num_samples, 1)
    assert (epochs, separate) == (want_epochs, want_separate)
    if separate:
        assert before == ((epochs - 1) * 80 - 1) // s


def test_shuffle_index_keeps_two_ranges_apart():
    idx = helpers.build_shuffle_index(30, 50, np.random.RandomState(1))
    assert sorted(idx[:30].tolist()) == list(range(30))
    assert sorted(idx[30:].tolist()) == list(range(30, 50))
    full = helpers.build_shuffle_index(50, 50, np.random.RandomState(1))
    assert sorted(full.tolist()) == list(range(50))


def slow_greedy(weights, size):
    counts = [0] * len(weights)
    out = []
    for n in range(size):
        x = max(n, 1)
        errors = [w * x - c for w, c in zip(weights, counts)]
        best = errors.index(max(errors))  # first of equal maxima
        out.append((best, counts[best]))
        counts[best] += 1
    return out


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.5], [0.1, 0.2, 0.3, 0.4], [1.0]])
def test_blending_matches_greedy_and_shares(weights):
    size = 10_000
    ds, dsi = helpers.build_blending_indices(weights, size)
    assert list(zip(ds.tolist(), dsi.tolist())) == slow_greedy(weights, size)
    counts = np.bincount(ds, minlength=len(weights))
    for w, c in zip(weights, counts):
        assert abs(c - w * size) <= 0.01 * w * size


def test_exhaustive_blending_concatenates():
    ds, dsi = helpers.build_exhaustive_blending_indices([2, 0, 3])
    assert ds.tolist() == [0, 0, 2, 2, 2] and dsi.tolist() == [0, 1, 0, 1, 2]
