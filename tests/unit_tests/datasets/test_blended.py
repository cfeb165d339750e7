"""Blends and the builder: weighted, unweighted, per-split; --data-path and --split parsing."""

import numpy as np
import pytest

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import (
    get_blend_from_list,
    get_num_samples,
    normalize,
    parse_and_normalize_split,
)
from tests.unit_tests.datasets.fixtures import Tokenizer, random_documents, write_dataset


@pytest.fixture()
def two_corpora(tmp_path):
    a = write_dataset(str(tmp_path), "a", random_documents(10, 80))
    b = write_dataset(str(tmp_path), "b", random_documents(11, 50))
    return a, b


def config(tmp_path, **kw):
    return GPTDatasetConfig(
        random_seed=2, sequence_length=6, tokenizer=Tokenizer(), path_to_cache=str(tmp_path / "cache"), **kw
    )


def test_weighted_blend_shares_and_contents(two_corpora, tmp_path):
    a, b = two_corpora
    cfg = config(tmp_path, blend=([a, b], [3.0, 7.0]), split="1,0,0")
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [10_000, 0, 0], lambda: True, cfg).build()
    assert valid is None and test is None and isinstance(train, BlendedDataset)
    assert len(train) == 10_000 and train.weights == pytest.approx([0.3, 0.7])
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert abs(counts[0] - 3000) <= 30 and abs(counts[1] - 7000) <= 70
    for comp, w in zip(train.datasets, (0.3, 0.7)):  # 0.5% surplus on each share
        assert comp.num_samples == int(np.ceil(np.ceil(10_000 * w) * 1.005))
    for j in (0, 1, 17, 9_999):
        d, k = int(train.dataset_index[j]), int(train.dataset_sample_index[j])
        sample = train[j]
        assert sample["dataset_id"] == d
        assert sample["tokens"].tolist() == train.datasets[d][k]["tokens"].tolist()


def test_blend_cache_reused_and_keyed(two_corpora, tmp_path):
    a, b = two_corpora
    cfg = config(tmp_path, blend=([a, b], [1.0, 1.0]), split="1,0,0")
    first = BlendedMegatronDatasetBuilder(GPTDataset, [500, 0, 0], lambda: True, cfg).build()[0]
    again = BlendedMegatronDatasetBuilder(GPTDataset, [500, 0, 0], lambda: True, cfg).build()[0]
    assert isinstance(again.dataset_index, np.memmap)
    np.testing.assert_array_equal(first.dataset_index, again.dataset_index)
    other = BlendedMegatronDatasetBuilder(GPTDataset, [501, 0, 0], lambda: True, cfg).build()[0]
    assert other.unique_description_hash != first.unique_description_hash and len(other) == 501


def test_unweighted_blend_mixes_by_length(two_corpora, tmp_path):
    a, b = two_corpora
    cfg = config(tmp_path, blend=([a, b], None), split="1,0,0")
    train = BlendedMegatronDatasetBuilder(GPTDataset, [10**9, 0, 0], lambda: True, cfg).build()[0]
    lengths = [len(d) for d in train.datasets]
    assert len(train) == sum(lengths)  # capped at one epoch of each
    assert np.bincount(np.asarray(train.dataset_index)).tolist() == lengths


def test_blend_per_split(two_corpora, tmp_path):
    a, b = two_corpora
    cfg = config(tmp_path, blend_per_split=[([a], None), ([a, b], [1.0, 3.0]), None])
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [40, 80, 10], lambda: True, cfg).build()
    assert isinstance(train, GPTDataset) and train.indices.tolist() == list(range(80))
    assert isinstance(valid, BlendedDataset) and len(valid) == 80 and test is None
    assert [d.indices.size for d in valid.datasets] == [80, 50]


def test_not_built_on_rank_gives_none(two_corpora, tmp_path):
    a, _ = two_corpora
    cfg = config(tmp_path, blend=([a], None), split="9,1,0")
    assert BlendedMegatronDatasetBuilder(GPTDataset, [10, 5, 0], lambda: False, cfg).build() == [None] * 3


def test_data_path_and_split_parsing():
    assert get_blend_from_list(["0.3", "A", "0.7", "B"]) == (["A", "B"], [0.3, 0.7])
    assert get_blend_from_list(["A", "B"]) == (["A", "B"], None)
    assert get_blend_from_list(["A"]) == (["A"], None)
    assert get_blend_from_list(None) is None
    with pytest.raises(ValueError):
        get_blend_from_list(["0.3", "A", "0.7"])
    assert parse_and_normalize_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_and_normalize_split("90/10") == pytest.approx([0.9, 0.1, 0.0])
    with pytest.raises(ValueError, match="split="):
        parse_and_normalize_split("1,-1,1")


def test_num_samples_per_split():
    # train_iters=1000, gbs=32, eval_interval=100, eval_iters=10
    assert get_num_samples(1000, 32, 100, 10) == [32_000, (1000 // 100 + 1) * 10 * 32, 320]


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_non_finite_weights_rejected_naming_field_and_value(two_corpora, tmp_path, bad):
    a, b = two_corpora
    blend = get_blend_from_list([bad, a, "1", b])  # what --data-path "nan A 1 B" parses to
    with pytest.raises(ValueError, match=rf"blend: weight {bad} of .*a must be a finite number"):
        config(tmp_path, blend=blend, split="1,0,0")
    with pytest.raises(ValueError, match=rf"blend_per_split\[valid\]: weight {bad} of"):
        config(tmp_path, blend_per_split=[([a], None), blend, None])
    with pytest.raises(ValueError, match="must be finite"):
        normalize([float(bad), 1.0])
