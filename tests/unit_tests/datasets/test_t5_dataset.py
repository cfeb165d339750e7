"""T5MaskedWordPieceDataset without the oracle: layout, sentinels, masks, seeds, cache, bad input."""

import dataclasses

import numpy as np
import pytest

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.t5_dataset import MockT5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig
from megatron.core.tokenizers.base import MissingSpecialTokenError
from tests.unit_tests.datasets.bert_corpus import write_bert_corpus
from tests.unit_tests.datasets.fixtures import write_sentence_dataset
from tests.unit_tests.datasets.t5_corpus import PRETRAIN_T5, T5_FIELDS, build_t5_datasets, t5_config, write_t5_corpus

SIZES = [200, 30, 0]
ENC, DEC = 64, 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_t5_corpus(str(tmp_path_factory.mktemp("t5_corpus")))


@pytest.fixture(scope="module")
def train(corpus, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache"))
    return build_t5_datasets(t5_config(corpus["tokenizer"], corpus["prefix"], cache), SIZES)[0]


def _source_tokens(dataset, idx):
    """The sample's sentence run, flattened and cut to its target length."""
    first, end, target = (int(v) for v in dataset.sample_index[idx])
    tokens = np.concatenate([np.asarray(dataset.dataset[i]) for i in range(first, end)]).astype(np.int64)
    return tokens[:target], len(tokens) > target


def _decoder_length(sample):
    return int(sample["loss_mask"].sum())


def test_config_defaults_are_pretrain_t5s(corpus, tmp_path):
    config = T5MaskedWordPieceDatasetConfig(
        random_seed=1, sequence_length=ENC, sequence_length_decoder=DEC, blend=([corpus["prefix"]], None),
        split="80,20,0", tokenizer=corpus["tokenizer"],
    )  # fmt: skip
    assert {name: getattr(config, name) for name in PRETRAIN_T5} == PRETRAIN_T5
    assert config.sequence_length_encoder == ENC
    assert "sequence_length_encoder" not in {f.name for f in dataclasses.fields(config) if f.init}


def test_sample_layout_and_dtypes(train, corpus):
    tok = corpus["tokenizer"]
    assert len(train) >= SIZES[0]
    for i in range(len(train)):
        s = train[i]
        assert list(s) == list(T5_FIELDS[:4]) + ["truncated", "enc_mask", "dec_mask"]
        for field, length in [("text_enc", ENC), ("enc_mask", ENC)] + [(f, DEC) for f in T5_FIELDS[1:4]]:
            assert s[field].dtype == np.int64 and s[field].shape == (length,), field
        assert s["dec_mask"].dtype == np.int64 and s["dec_mask"].shape == (DEC,)
        assert isinstance(s["truncated"], int)
        n = _decoder_length(s)
        # Decoder input is [BOS] + targets, labels are targets + [EOS]; padding: 0 and -1 ([PAD] is 0).
        assert s["text_dec"][0] == tok.bos and s["labels"][n - 1] == tok.eos
        np.testing.assert_array_equal(s["text_dec"][1:n], s["labels"][: n - 1])
        assert (s["text_dec"][n:] == 0).all() and (s["labels"][n:] == -1).all()
        assert (s["loss_mask"][:n] == 1).all() and (s["loss_mask"][n:] == 0).all()
        np.testing.assert_array_equal(s["dec_mask"], s["loss_mask"])  # the corpus holds no [PAD]
        m = int(s["enc_mask"].sum())
        assert (s["enc_mask"][:m] == 1).all() and (s["text_enc"][m:] == 0).all() and m <= ENC - 2


def test_sentinels_in_order_and_spans_restore_the_source(train, corpus):
    sentinels = corpus["tokenizer"].additional_special_tokens_ids
    spans_seen = 0
    for i in range(len(train)):
        s = train[i]
        source, truncated = _source_tokens(train, i)
        assert s["truncated"] == int(truncated)
        n = _decoder_length(s)
        targets = s["labels"][: n - 1].tolist()
        encoder = s["text_enc"][: int(s["enc_mask"].sum())].tolist()
        used = [t for t in encoder if t in sentinels]
        assert used == sentinels[: len(used)] and [t for t in targets if t in sentinels] == used
        # Replace each sentinel of the encoder input by the tokens after it in the targets.
        starts = [targets.index(x) for x in used] + [len(targets)]
        fill = {x: targets[a + 1 : b] for x, a, b in zip(used, starts, starts[1:])}
        assert all(len(v) >= 1 for v in fill.values())
        restored = [t for x in encoder for t in (fill[x] if x in fill else [x])]
        assert restored == source.tolist()
        spans_seen += len(used)
    assert spans_seen > len(train)  # several spans per sample on average


def test_masking_rate(train, corpus):
    sentinels = corpus["tokenizer"].additional_special_tokens_ids
    masked = tokens = 0
    for i in range(len(train)):
        s = train[i]
        spans = int(np.isin(s["text_enc"], sentinels).sum())
        hidden = _decoder_length(s) - 1 - spans
        masked, tokens = masked + hidden, tokens + int(s["enc_mask"].sum()) - spans + hidden
    assert 0.10 < masked / tokens < 0.16


def test_same_seed_same_samples_other_seed_differs(corpus, tmp_path):
    def samples(seed, cache, order):
        config = t5_config(corpus["tokenizer"], corpus["prefix"], str(tmp_path / cache), random_seed=seed)
        ds = build_t5_datasets(config, SIZES)[0]
        return {i: ds[i] for i in order}

    a, b, c = samples(5, "a", range(20)), samples(5, "b", reversed(range(20))), samples(6, "c", range(20))
    for i in range(20):
        for field in T5_FIELDS:
            np.testing.assert_array_equal(a[i][field], b[i][field])
    assert any((a[i]["text_enc"] != c[i]["text_enc"]).any() for i in range(20))


def test_sample_index_is_cached_under_the_class_name(corpus, tmp_path):
    config = t5_config(corpus["tokenizer"], corpus["prefix"], str(tmp_path))
    first = build_t5_datasets(config, SIZES)[0]

    def indices():
        return {p.name for p in tmp_path.iterdir() if p.name.endswith("-T5MaskedWordPieceDataset-sample_index.npy")}

    before = indices()
    assert len(before) == 2  # train and valid
    # The decoder length is part of the cache key.
    longer = t5_config(corpus["tokenizer"], corpus["prefix"], str(tmp_path), sequence_length_decoder=40)
    build_t5_datasets(longer, SIZES)
    assert len(indices()) == 4 and before < indices()
    assert first.unique_identifiers["sequence_length_decoder"] == DEC


def test_one_sentence_documents_are_enough(corpus, tmp_path):
    rng = np.random.RandomState(0)
    prefix = write_sentence_dataset(str(tmp_path), "flat", [[rng.randint(5, 100, size=20)] for _ in range(30)])
    train = build_t5_datasets(t5_config(corpus["tokenizer"], prefix, str(tmp_path / "cache")), SIZES)[0]
    assert len(train) >= SIZES[0] and train[0]["text_dec"][0] == corpus["tokenizer"].bos


def test_tokenizer_without_sentinels_is_refused(tmp_path):
    plain = write_bert_corpus(str(tmp_path))
    with pytest.raises(ValueError, match="vocab_extra_ids"):
        t5_config(plain["tokenizer"], plain["prefix"], str(tmp_path / "cache"))


def test_too_few_sentinels_name_the_flag(tmp_path):
    few = write_t5_corpus(str(tmp_path), sentinels=1)
    train = build_t5_datasets(t5_config(few["tokenizer"], few["prefix"], str(tmp_path / "cache")), SIZES)[0]
    with pytest.raises(ValueError, match=r"only 1 sentinels \(vocab_extra_ids=1\): raise it"):
        for i in range(len(train)):
            train[i]


def test_short_decoder_names_the_flag(corpus, tmp_path):
    config = t5_config(corpus["tokenizer"], corpus["prefix"], str(tmp_path), sequence_length_decoder=4)
    train = build_t5_datasets(config, SIZES)[0]
    with pytest.raises(ValueError, match="T5MaskedWordPieceDatasetConfig.sequence_length_decoder=4: "):
        for i in range(len(train)):
            train[i]


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"sequence_length_decoder": None}, "sequence_length_decoder=None"),
        ({"sequence_length_decoder": 1}, "sequence_length_decoder=1"),
        ({"sequence_length": 2}, "sequence_length=2"),
        ({"masking_probability": 0.0}, "masking_probability=0.0"),
        ({"masking_do_permutation": True}, "cannot be combined"),
    ],
)
def test_config_validation(corpus, tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        t5_config(corpus["tokenizer"], corpus["prefix"], str(tmp_path), **overrides)


class _NoPadTokenizer:
    """The corpus tokenizer without a pad token."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @property
    def pad(self):
        raise MissingSpecialTokenError("no pad")


def test_without_pad_token_labels_pad_with_zero(corpus, tmp_path):
    tokenizer = _NoPadTokenizer(corpus["tokenizer"])
    train = build_t5_datasets(t5_config(tokenizer, corpus["prefix"], str(tmp_path)), SIZES)[0]
    s = train[0]
    n = _decoder_length(s)
    assert (s["labels"][n:] == 0).all() and (s["text_dec"][n:] == 0).all()
    np.testing.assert_array_equal(s["dec_mask"], s["loss_mask"])


def test_mock_dataset_through_the_builder(corpus):
    tok = corpus["tokenizer"]

    def build(seed):
        config = T5MaskedWordPieceDatasetConfig(
            random_seed=seed, sequence_length=ENC, sequence_length_decoder=DEC, mock=True, tokenizer=tok
        )
        return BlendedMegatronDatasetBuilder(MockT5MaskedWordPieceDataset, [50, 10, 5], lambda: True, config).build()

    train, valid, test = build(3)
    assert len(train) >= 50 and len(valid) >= 10 and len(test) >= 5
    again = build(3)[0]
    special = {tok.cls, tok.sep, tok.pad, tok.mask, tok.bos, tok.eos}
    for i in (0, 7, 49):
        for field in T5_FIELDS:
            np.testing.assert_array_equal(train[i][field], again[i][field])
        text = train[i]["text_enc"][: int(train[i]["enc_mask"].sum())]
        assert not special & set(text.tolist()) and train[i]["text_dec"][0] == tok.bos
