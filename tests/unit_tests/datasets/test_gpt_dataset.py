"""GPTDataset on real .bin/.idx files: contents, epochs, masks, splits and the index cache."""

import os
from fractions import Fraction

import numpy as np
import pytest
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split
from tests.dist_harness import run_distributed
from tests.unit_tests.datasets.fixtures import EOD, Tokenizer, random_documents, write_dataset

SEQ = 8


@pytest.fixture()
def corpus(tmp_path):
    docs = random_documents(seed=0, n=60)
    return write_dataset(str(tmp_path), "corpus", docs), docs


def make(prefix, num_samples, split="1,0,0", index_split=Split.train, cache=None, **kw):
    cfg_kw = dict(
        random_seed=kw.pop("seed", 1234),
        sequence_length=kw.pop("seq", SEQ),
        blend=([prefix], None),
        split=split,
        tokenizer=Tokenizer(),
        path_to_cache=cache,
    )
    cfg = GPTDatasetConfig(**cfg_kw, **kw)
    low = GPTDataset.build_low_level_dataset(prefix, cfg)
    docs = np.arange(len(low))
    return GPTDataset(low, prefix, docs, num_samples, index_split, cfg)


def reference_samples(docs, document_index, s, count):
    """Concatenate the documents in index order; sample i is stream[i*s : i*s + s + 1]."""
    stream = [int(t) for d in document_index for t in docs[int(d)]]
    return [stream[i * s : i * s + s + 1] for i in range(count)]


def test_samples_equal_slow_concatenation(corpus, tmp_path):
    prefix, docs = corpus
    ds = make(prefix, num_samples=300, cache=str(tmp_path / "c"))
    n = len(ds)
    assert n >= 300
    ref = reference_samples(docs, ds.document_index, SEQ, n)
    for j in range(0, n, 7):
        sample = ds[j]
        want = ref[int(ds.shuffle_index[j])]
        assert sample["tokens"].tolist() == want[:-1]
        assert sample["labels"].tolist() == want[1:]


def test_one_epoch_uses_every_token_once(corpus, tmp_path):
    prefix, docs = corpus
    # Valid split without dropping the partial sample: the samples tile the whole stream.
    ds = make(
        prefix,
        num_samples=None,
        index_split=Split.valid,
        cache=str(tmp_path / "c"),
        drop_last_partial_validation_sequence=False,
    )
    assert sorted(ds.document_index.tolist()) == list(range(len(docs)))
    total = sum(len(d) for d in docs)
    stream = [int(t) for d in ds.document_index for t in docs[int(d)]]
    inputs = []
    for i in range(len(ds)):  # unshuffled order through the sample index
        j = int(np.nonzero(np.asarray(ds.shuffle_index) == i)[0][0])
        inputs.extend(ds.sample_tokens(j)[:SEQ].tolist())
    assert len(ds) == -(-(total - 1) // SEQ)
    assert inputs[: total - 1] == stream[: total - 1]  # every input token once, in stream order
    assert len(set(np.asarray(ds.shuffle_index).tolist())) == len(ds)


def test_seed_determinism_and_variation(corpus, tmp_path):
    prefix, _ = corpus
    a = make(prefix, 100, cache=str(tmp_path / "a"))
    b = make(prefix, 100, cache=str(tmp_path / "b"))
    c = make(prefix, 100, seed=99, cache=str(tmp_path / "c"))
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.document_index, c.document_index)
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)


def test_cache_is_reused_and_never_stale(corpus, tmp_path):
    prefix, docs = corpus
    cache = str(tmp_path / "idx")
    first = make(prefix, 100, cache=cache)
    files = set(os.listdir(cache))
    again = make(prefix, 100, cache=cache)
    assert isinstance(again.document_index, np.memmap)  # loaded, not rebuilt
    assert set(os.listdir(cache)) == files
    np.testing.assert_array_equal(first.shuffle_index, again.shuffle_index)
    for kw in (dict(seed=7), dict(seq=5)):
        changed = make(prefix, 100, cache=cache, **kw)
        new_files = set(os.listdir(cache)) - files
        assert len(new_files) == 4  # three indices and a description, under a new hash
        files |= new_files
        fresh = make(prefix, 100, cache=str(tmp_path / "other"), **kw)
        np.testing.assert_array_equal(changed.shuffle_index, fresh.shuffle_index)
        s = kw.get("seq", SEQ)
        ref = reference_samples(docs, changed.document_index, s, len(changed))
        assert changed[3]["tokens"].tolist() == ref[int(changed.shuffle_index[3])][:-1]


def test_cache_rebuilt_when_the_data_is_preprocessed_again(tmp_path):
    cache = str(tmp_path / "idx")
    prefix = write_dataset(str(tmp_path), "corpus", random_documents(seed=0, n=60))
    old = make(prefix, 100, cache=cache)
    old_index = np.array(old.sample_index)
    # The same prefix written again: as many documents (the old key had their count), other lengths.
    new_docs = random_documents(seed=1, n=60)
    assert write_dataset(str(tmp_path), "corpus", new_docs) == prefix
    again = make(prefix, 100, cache=cache)
    fresh = make(prefix, 100, cache=str(tmp_path / "fresh"))
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(again, name), getattr(fresh, name))
    assert not np.array_equal(again.sample_index, old_index)
    ref = reference_samples(new_docs, again.document_index, SEQ, len(again))
    for j in (0, 5, len(again) - 1):
        assert again[j]["tokens"].tolist() == ref[int(again.shuffle_index[j])][:-1]


def test_default_cache_beside_the_data(corpus):
    prefix, _ = corpus
    ds = make(prefix, 20)
    expected = os.path.join(os.path.dirname(prefix), "cache", "GPTDataset_indices")
    assert ds.path_to_cache == expected and any(f.endswith("shuffle_index.npy") for f in os.listdir(expected))


def reference_masks(tokens, reset_pos, reset_attn, eod_mask):
    """Megatron's meaning, loop by loop: a document ends with its eod token."""
    s = len(tokens)
    allowed = [[k <= j for k in range(s)] for j in range(s)]
    pos = list(range(s))
    start = 0
    for j in range(s):
        pos[j] = j - start if reset_pos else j
        if tokens[j] == EOD:
            if reset_attn:
                for row in range(j + 1, s):
                    for col in range(j + 1):
                        allowed[row][col] = False
            start = j + 1
    loss = [0.0 if (eod_mask and t == EOD) else 1.0 for t in tokens]
    return [[not a for a in row] for row in allowed], loss, pos


@pytest.mark.parametrize(
    "flags", [(False, False, False), (True, True, True), (True, False, True), (False, True, False)]
)
def test_masks_and_positions_match_reference(corpus, tmp_path, flags):
    prefix, _ = corpus
    reset_pos, reset_attn, eod_mask = flags
    ds = make(
        prefix,
        50,
        seq=24,
        cache=str(tmp_path / "c"),
        reset_position_ids=reset_pos,
        reset_attention_mask=reset_attn,
        eod_mask_loss=eod_mask,
    )
    seen_eod = False
    for j in range(10):
        sample = ds[j]
        toks = sample["tokens"].tolist()
        seen_eod |= EOD in toks[:-1]
        mask, loss, pos = reference_masks(toks, reset_pos, reset_attn, eod_mask)
        assert sample["attention_mask"].shape == (1, 24, 24) and sample["attention_mask"].dtype == torch.bool
        assert sample["attention_mask"][0].tolist() == mask
        assert sample["loss_mask"].tolist() == loss
        assert sample["position_ids"].tolist() == pos
    assert seen_eod  # the fixture really exercises document boundaries


def test_no_attention_mask_when_not_requested(corpus, tmp_path):
    prefix, _ = corpus
    ds = make(prefix, 10, cache=str(tmp_path / "c"), create_attention_mask=False)
    assert "attention_mask" not in ds[0] and ds[None]["loss_mask"].sum() == 0


@pytest.mark.parametrize("split,n", [("6,3,1", 10), ("969,30,1", 1000), ("969,30,1", 61), ("1,1,1", 7), ("90,10", 37)])
def test_split_boundaries(tmp_path, split, n):
    prefix = write_dataset(str(tmp_path), "d", random_documents(1, n, max_len=30))
    cfg = GPTDatasetConfig(
        random_seed=1,
        sequence_length=4,
        blend=([prefix], None),
        split=split,
        tokenizer=Tokenizer(),
        path_to_cache=str(tmp_path / "c"),
    )
    parts = [Fraction(p) for p in split.split(",")] + [Fraction(0)] * (3 - len(split.split(",")))
    bookends = [sum(parts[:k], Fraction(0)) / sum(parts) for k in range(4)]
    ranges = [(round(bookends[k] * n), round(bookends[k + 1] * n)) for k in range(3)]
    sizes = [5 if lo < hi else 0 for lo, hi in ranges]
    datasets = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()
    for (lo, hi), ds in zip(ranges, datasets):
        assert (ds is None) if lo == hi else ds.indices.tolist() == list(range(lo, hi))
    if 0 in sizes[:2] or (sizes[2] == 0 and parts[2] > 0):
        empty = sizes.index(0)
        with pytest.raises(ValueError, match=f"split {Split(empty).name}: no documents"):
            BlendedMegatronDatasetBuilder(GPTDataset, [5, 5, 5], lambda: True, cfg).build()


def test_mock_dataset_is_deterministic():
    cfg = GPTDatasetConfig(random_seed=3, sequence_length=16, mock=True, tokenizer=Tokenizer())
    a = BlendedMegatronDatasetBuilder(MockGPTDataset, [20, 4, 0], lambda: True, cfg).build()
    b = BlendedMegatronDatasetBuilder(MockGPTDataset, [20, 4, 0], lambda: True, cfg).build()
    assert a[2] is None and len(a[0]) >= 20
    assert torch.equal(a[0][5]["tokens"], b[0][5]["tokens"])
    assert int(a[0][5]["tokens"].max()) < Tokenizer.vocab_size


def _build_on_two_ranks(rank, world_size, prefix, cache):
    cfg = GPTDatasetConfig(
        random_seed=5,
        sequence_length=SEQ,
        blend=([prefix], None),
        split="8,2,0",
        tokenizer=Tokenizer(),
        path_to_cache=cache,
    )
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [40, 10, 0], lambda: True, cfg).build()
    return (
        isinstance(train.shuffle_index, np.memmap),
        train[4]["tokens"].tolist(),
        np.asarray(valid.document_index).tolist(),
    )


def test_rank_zero_builds_others_load(corpus, tmp_path):
    prefix, _ = corpus
    cache = str(tmp_path / "cache")
    results = run_distributed(_build_on_two_ranks, 2, prefix, cache, timeout=120)
    assert results[0][0] is False and results[1][0] is True  # rank 0 built, rank 1 mapped the files
    assert results[0][1:] == results[1][1:]
    assert IndexedDataset.exists(prefix)


def test_config_validation(corpus):
    prefix, _ = corpus
    with pytest.raises(ValueError, match="exactly one"):
        GPTDatasetConfig(random_seed=1, sequence_length=4, blend=([prefix], None), blend_per_split=[None] * 3)
    no_data = GPTDatasetConfig(random_seed=1, sequence_length=4)  # Megatron-core: mock data, even split
    assert no_data.mock and no_data.split == "1,1,1"
    with pytest.raises(ValueError, match="split=None"):
        GPTDatasetConfig(random_seed=1, sequence_length=4, blend=([prefix], None))
    with pytest.raises(ValueError, match="sequence_length=0"):
        GPTDatasetConfig(random_seed=1, sequence_length=0, mock=True)
    with pytest.raises(ValueError, match="split='0,0,0'"):
        GPTDatasetConfig(random_seed=1, sequence_length=4, blend=([prefix], None), split="0,0,0")
    with pytest.raises(ValueError, match="tokenizer"):
        GPTDatasetConfig(random_seed=1, sequence_length=4, mock=True, eod_mask_loss=True)
