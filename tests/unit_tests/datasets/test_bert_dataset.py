"""BERTMaskedWordPieceDataset without the oracle: sample layout, masking, seeds, cache, bad input."""

import numpy as np
import pytest

from megatron.core.datasets import sentence_mapping
from megatron.core.datasets.bert_dataset import MockBERTMaskedWordPieceDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.sentence_mapping import Mt19937_64, Mt19937Stream, build_mapping, short_sequence_ratio
from tests.unit_tests.datasets.bert_corpus import FIELDS, bert_config, build_bert_datasets, write_bert_corpus
from tests.unit_tests.datasets.fixtures import write_sentence_dataset

SIZES = [200, 30, 0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_bert_corpus(str(tmp_path_factory.mktemp("bert_corpus")))


@pytest.fixture(scope="module")
def train(corpus, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache"))
    return build_bert_datasets(bert_config(corpus["tokenizer"], corpus["prefix"], cache), SIZES)[0]


def test_generators_match_the_cpp_standard():
    # The C++ standard fixes the 10000th output of default-seeded (5489) engines.
    assert int(Mt19937Stream(5489).draw(10000)[-1]) == 4123659995
    assert int(Mt19937_64(5489).draw(10000)[-1]) == 9981545732273789042
    # Values printed by g++'s std::mt19937(1234) / std::mt19937_64(1235), one at a time.
    stream = Mt19937Stream(1234)
    assert [stream.next() for _ in range(3)] == [822569775, 2137449171, 2671936806]
    engine = Mt19937_64(1235)
    first = engine.draw(2).tolist() + engine.draw(1).tolist()
    assert first == [12475983374653888083, 573922149886606219, 5802434057304372554]


def test_short_sequence_ratio_rounds_halves_up():
    assert [short_sequence_ratio(p) for p in (0.0, 0.1, 0.4, 1.0)] == [0, 10, 3, 1]


def test_mapping_rows_are_sentence_runs_inside_documents():
    bounds = np.array([0, 3, 4, 9, 9, 12])
    lengths = np.array([5, 7, 3, 9, 9, 2, 2, 2, 2, 4, 600, 4])
    rows = build_mapping(bounds, lengths, None, 10, 0.0, 3, 2)
    assert rows.dtype == np.uint32 and rows.shape[1] == 3
    # Document [9, 12) holds a 600-token sentence: skipped; [3, 4) has one sentence: skipped.
    covered = sorted((int(a), int(b)) for a, b, _ in rows)
    assert covered == [(0, 3), (4, 6), (6, 9)]
    assert set(rows[:, 2].tolist()) == {10}
    more = build_mapping(bounds, lengths, 7, 10, 0.0, 3, 2)
    assert len(more) == 9  # whole epochs of 3 rows until at least 7


def test_sample_layout_and_dtypes(train, corpus):
    tok = corpus["tokenizer"]
    assert len(train) >= SIZES[0]
    for i in range(len(train)):
        s = train[i]
        assert set(s) == set(FIELDS)
        for field in ("text", "types", "labels", "padding_mask", "loss_mask"):
            assert s[field].dtype == np.int64 and s[field].shape == (64,)
        assert isinstance(s["is_random"], int) and isinstance(s["truncated"], int)
        # The final [SEP] is never masked, so the last 1 of padding_mask ends the sequence. Inside,
        # padding_mask is 0 only where masking put a random [PAD] (id 0), as in megatron-core.
        n = int(np.flatnonzero(s["padding_mask"])[-1]) + 1
        holes = s["padding_mask"][:n] == 0
        assert (s["padding_mask"][n:] == 0).all() and (s["loss_mask"][:n][holes] == 1).all()
        text, types = s["text"], s["types"]
        assert text[0] == tok.cls and text[n - 1] == tok.sep and (text[n:] == 0).all()
        # [CLS] A [SEP] has type 0, B [SEP] type 1; the head always has both segments. (A random
        # replacement of a masked token may also be [SEP], so the types locate the separators.)
        a_end = int(np.flatnonzero(types[:n] == 0)[-1])
        seps = [a_end, n - 1]
        assert a_end < n - 1 and (types[a_end + 1 : n] == 1).all() and (text[seps] == tok.sep).all()
        masked = s["loss_mask"] == 1
        assert (s["labels"][~masked] == -1).all() and (s["labels"][masked] >= 0).all()
        assert not masked[seps].any() and not masked[0]


def test_masking_rate_and_replacements(train, corpus):
    masked = real = as_mask = 0
    for i in range(len(train)):
        s = train[i]
        m = s["loss_mask"] == 1
        masked, real = masked + m.sum(), real + s["padding_mask"].sum()
        as_mask += (s["text"][m] == corpus["tokenizer"].mask).sum()
    assert 0.11 < masked / real < 0.16
    assert 0.7 < as_mask / masked < 0.9  # 80% [MASK]


def test_same_seed_same_samples_other_seed_differs(corpus, tmp_path):
    def samples(seed, cache):
        config = bert_config(corpus["tokenizer"], corpus["prefix"], str(tmp_path / cache), random_seed=seed)
        ds = build_bert_datasets(config, SIZES)[0]
        return [ds[i]["text"] for i in range(20)]

    a, b, c = samples(5, "a"), samples(5, "b"), samples(6, "c")
    assert all((x == y).all() for x, y in zip(a, b))
    assert any((x != y).any() for x, y in zip(a, c))


def test_sample_index_is_cached_and_reused(corpus, tmp_path, monkeypatch):
    config = bert_config(corpus["tokenizer"], corpus["prefix"], str(tmp_path))
    first = build_bert_datasets(config, SIZES)[0]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert any(f.endswith("-BERTMaskedWordPieceDataset-sample_index.npy") for f in files)
    assert any(f.endswith("-BERTMaskedWordPieceDataset-description.txt") for f in files)

    def fail(*args, **kwargs):
        raise AssertionError("the cached sample index should have been loaded")

    monkeypatch.setattr("megatron.core.datasets.masked_dataset.build_mapping", fail)
    again = build_bert_datasets(config, SIZES)[0]
    np.testing.assert_array_equal(np.asarray(again.sample_index), np.asarray(first.sample_index))
    assert (again[3]["text"] == first[3]["text"]).all()


def _one_sentence_corpus(directory):
    rng = np.random.RandomState(0)
    return write_sentence_dataset(str(directory), "flat", [[rng.randint(5, 100, size=20)] for _ in range(30)])


def test_corpus_without_split_sentences_needs_no_head(corpus, tmp_path):
    prefix = _one_sentence_corpus(tmp_path)
    config = bert_config(corpus["tokenizer"], prefix, str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="--split-sentences.*classification_head=False"):
        build_bert_datasets(config, SIZES)
    no_head = bert_config(corpus["tokenizer"], prefix, str(tmp_path / "cache"), classification_head=False)
    train = build_bert_datasets(no_head, SIZES)[0]
    assert len(train) >= SIZES[0] and train[0]["is_random"] == 0


def test_mapping_refuses_to_loop_without_samples():
    with pytest.raises(ValueError, match="no document"):
        build_mapping(np.array([0, 1, 2]), np.array([4, 4]), 10, 20, 0.0, 1, 2)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"masking_probability": 1.0}, "masking_probability=1.0"),
        ({"short_sequence_probability": -0.1}, "short_sequence_probability=-0.1"),
        ({"masking_max_ngram": 0}, "masking_max_ngram=0"),
        ({"masking_do_permutation": True, "masking_use_geometric_distribution": True}, "cannot be combined"),
        ({"classification_head": None}, "classification_head=None"),
        ({"random_seed": -1}, "random_seed=-1"),
        ({"sequence_length": 3}, "sequence_length=3"),
    ],
)
def test_config_validation(corpus, tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        bert_config(corpus["tokenizer"], corpus["prefix"], str(tmp_path), **overrides)


def test_mock_dataset_through_the_builder(corpus):
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDatasetConfig

    def build(seed):
        config = BERTMaskedWordPieceDatasetConfig(
            random_seed=seed, sequence_length=32, mock=True, tokenizer=corpus["tokenizer"]
        )
        return BlendedMegatronDatasetBuilder(MockBERTMaskedWordPieceDataset, [50, 10, 5], lambda: True, config).build()

    train, valid, test = build(3)
    assert len(train) >= 50 and len(valid) >= 10 and len(test) >= 5
    again = build(3)[0]
    for i in (0, 7, 49):
        assert (train[i]["text"] == again[i]["text"]).all()
        assert train[i]["text"][0] == corpus["tokenizer"].cls


def test_long_sentence_limit_is_upstreams():
    assert sentence_mapping.LONG_SENTENCE_LEN == 512


def test_unweighted_blend_builds_one_epoch_of_each(corpus, tmp_path):
    """num_samples=None (an unweighted blend) walks one epoch; megatron-core's build_mapping
    rejects None with a TypeError there."""
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDatasetConfig

    other = write_bert_corpus(str(tmp_path), seed=3)["prefix"]
    config = BERTMaskedWordPieceDatasetConfig(
        random_seed=1, sequence_length=64, blend=([corpus["prefix"], other], None), split="80,20,0",
        path_to_cache=str(tmp_path / "cache"), tokenizer=corpus["tokenizer"],
    )  # fmt: skip
    train = build_bert_datasets(config, [30, 0, 0])[0]
    assert len(train) == 30
    assert set(train[0]) >= set(FIELDS)
