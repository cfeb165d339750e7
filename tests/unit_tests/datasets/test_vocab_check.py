"""Token ids of the data against the padded vocabulary: builder level, cache, ranks, and pretrain_gpt.py."""

import json
import os

import numpy as np
import pytest

from megatron.core.datasets import vocab_check
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatron.core.datasets.vocab_check import TokenIdOutOfVocabularyError, check_token_ids_in_vocabulary
from tests.dist_harness import run_distributed
from tests.unit_tests.datasets.fixtures import Tokenizer, random_documents, write_dataset


def write_tokens(directory, name, docs, dtype=np.uint16):
    """``docs`` (lists of ids) as one dataset, written with the plain builder."""
    prefix = os.path.join(directory, name)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    for doc in docs:
        builder.add_item(np.asarray(doc, dtype=dtype))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    return prefix


def big_id_documents(big, n=40):
    """Random documents below the fixture vocabulary, one of which holds ``big``."""
    docs = [d.tolist() for d in random_documents(3, n)]
    docs[n // 2] = docs[n // 2][:-1] + [big, 0]
    return docs


def build(tmp_path, blend):
    cfg = GPTDatasetConfig(
        random_seed=1,
        sequence_length=8,
        blend=blend,
        split="8,1,1",
        tokenizer=Tokenizer(),
        path_to_cache=str(tmp_path / "cache"),
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, [30, 5, 5], lambda: True, cfg).build()


def test_blend_names_the_prefix_and_both_numbers(tmp_path):
    good = write_dataset(str(tmp_path), "good", random_documents(1, 40))
    bad_docs = big_id_documents(700)
    bad = write_tokens(str(tmp_path), "bad", bad_docs)
    datasets = build(tmp_path, ([good, bad], [0.5, 0.5]))
    largest = max(max(d) for d in bad_docs)  # independent of the scan: the ids written
    assert largest == 700
    with pytest.raises(TokenIdOutOfVocabularyError) as err:
        check_token_ids_in_vocabulary(datasets, 640, "--tokenizer-type X padded to 640")
    message = str(err.value)
    assert (
        f"data prefix {bad} holds token id 700 but the padded vocabulary (--tokenizer-type X padded to 640) "
        "has 640 entries" in message
    )
    assert good not in message
    check_token_ids_in_vocabulary(datasets, largest + 1)  # the largest id is the last one allowed
    with pytest.raises(TokenIdOutOfVocabularyError):
        check_token_ids_in_vocabulary(datasets, largest)


def test_negative_ids_and_mock_data(tmp_path):
    prefix = write_tokens(str(tmp_path), "neg", [[1, 2, -3, 4]] * 10, dtype=np.int32)
    with pytest.raises(TokenIdOutOfVocabularyError, match="neg holds the negative token id -3"):
        check_token_ids_in_vocabulary([IndexedDataset(prefix)], 50)
    cfg = GPTDatasetConfig(random_seed=3, sequence_length=8, mock=True, tokenizer=Tokenizer())
    mock = BlendedMegatronDatasetBuilder(MockGPTDataset, [10, 2, 0], lambda: True, cfg).build()
    assert vocab_check.collect_indexed_datasets(mock) == []
    check_token_ids_in_vocabulary(mock, 1)  # nothing to scan


def test_range_cached_beside_the_indices_and_never_stale(tmp_path, monkeypatch):
    docs = [d.tolist() for d in random_documents(4, 40)]
    prefix = write_tokens(str(tmp_path), "corpus", docs)
    datasets = build(tmp_path, ([prefix], None))
    check_token_ids_in_vocabulary(datasets, 50)
    cache_file = vocab_check.token_range_cache_path(str(tmp_path / "cache"), prefix)
    with open(cache_file) as f:
        entry = json.load(f)
    assert (entry["min"], entry["max"]) == (min(min(d) for d in docs), max(max(d) for d in docs))

    def no_scan(self, *args, **kwargs):
        raise AssertionError("scanned although the cache is valid")

    real_scan = IndexedDataset.token_range
    monkeypatch.setattr(IndexedDataset, "token_range", no_scan)
    check_token_ids_in_vocabulary(datasets, 50)
    # Same prefix, same lengths (so the same .idx bytes), one token changed to an id out of range.
    docs[7][0] = 60
    write_tokens(str(tmp_path), "corpus", docs)
    monkeypatch.setattr(IndexedDataset, "token_range", real_scan)
    with pytest.raises(TokenIdOutOfVocabularyError, match="holds token id 60"):
        check_token_ids_in_vocabulary([IndexedDataset(prefix)] + list(build(tmp_path, ([prefix], None))), 50)


def _check_on_two_ranks(rank, world_size, prefix, fail_on_rank0):
    def scanned_here(self, *args, **kwargs):
        if rank != 0:
            raise AssertionError("rank 1 scanned the .bin")
        if fail_on_rank0:
            raise OSError("disk unreadable")
        return (0, 900)

    IndexedDataset.token_range = scanned_here
    try:
        check_token_ids_in_vocabulary([IndexedDataset(prefix)], 512, "padded")
    except Exception as err:  # noqa: BLE001 - the test compares what each rank raised
        return type(err).__name__, str(err)
    return None


def test_rank_zero_scans_and_every_rank_raises(tmp_path):
    prefix = write_tokens(str(tmp_path), "corpus", big_id_documents(900))
    results = run_distributed(_check_on_two_ranks, 2, prefix, False, timeout=120)
    assert results[0] == results[1]
    assert results[0][0] == "TokenIdOutOfVocabularyError" and "holds token id 900" in results[0][1]
    failed = run_distributed(_check_on_two_ranks, 2, prefix, True, timeout=120)
    assert failed[0] == ("OSError", "disk unreadable")
    assert failed[1] == ("RuntimeError", "the token id check failed on rank 0: OSError: disk unreadable")
