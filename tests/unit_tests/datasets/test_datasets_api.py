"""Megatron-core's dataset surface, ``_NullTokenizer`` and ``tools.preprocess_data.Encoder``, as upstream calls them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import typing

import numpy as np
import pytest

from megatron.core.datasets import helpers
from megatron.core.datasets.blended_megatron_dataset_config import (
    BlendedMegatronDatasetConfig,
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder, get_idx_path
from megatron.core.datasets.megatron_dataset import LowLevelDataset, MegatronDataset
from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer
from megatron.core.datasets.utils import Split
from megatron.training.tokenizer.tokenizer import _NullTokenizer, _vocab_size_with_padding, build_tokenizer
from tools.preprocess_data import Encoder, get_args

DOCS = [[[1, 2, 3], [4, 5]], [[6]], [[7, 8, 9, 10], [11], [12, 13]]]  # documents of sequences


def _write(prefix: str) -> None:
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in DOCS:
        for sequence in doc:
            builder.add_item(np.array(sequence))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))


def test_indexed_dataset_upstream_arguments_and_document_indices(tmp_path):
    prefix = str(tmp_path / "corpus")
    _write(prefix)
    code = DType.code_from_dtype(np.uint16)
    ds = IndexedDataset(prefix, mmap=False, fast_cache_load=True, sequences_per_dataset=(6, 3), dtype_code=code)
    assert len(ds) == 6 and ds.get(3, offset=1, length=2).tolist() == [8, 9]
    assert ds.get_document_indices().tolist() == [0, 2, 3, 6]
    ds.set_document_indices(np.array([0, 3, 6]))
    assert ds.document_indices.tolist() == [0, 3, 6]
    with pytest.raises(ValueError):
        ds.set_document_indices(np.array([0, 4, 2, 6]))
    ds.initialize(prefix, False, True, None)  # upstream's re-open (used by unpickling)
    assert ds.document_indices.tolist() == [0, 2, 3, 6] and ds[0].tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="sequences_per_dataset"):
        IndexedDataset(prefix, sequences_per_dataset=(6, 2))
    with pytest.raises(ValueError, match="dtype_code"):
        IndexedDataset(prefix, dtype_code=DType.code_from_dtype(np.int32))
    with pytest.raises(NotImplementedError):
        IndexedDataset(prefix, s3_config=object())
    assert IndexedDataset in typing.get_args(LowLevelDataset)


class _Squares(MegatronDataset):
    """A mid-level dataset over an in-memory low-level one: only __len__ / __getitem__, as upstream allows."""

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, idx: int):
        return {"text": np.array([self.dataset[self.indices[idx]] ** 2])}


def test_megatron_dataset_subclass_needs_only_len_and_getitem():
    config = BlendedMegatronDatasetConfig(random_seed=1, sequence_length=4, blend=(["prefix"], None), split="1,0,0")
    low_level = list(range(10))
    ds = _Squares(low_level, None, np.arange(2, 5), None, Split.train, config)
    assert len(ds) == 3 and int(ds[1]["text"][0]) == 9
    assert ds.unique_identifiers["class"] == "_Squares" and len(ds.unique_description_hash) > 0
    assert MegatronDataset.numel_low_level_dataset(low_level) == 10
    with pytest.raises(NotImplementedError):
        _Squares.build_low_level_dataset("prefix", config)

    class Incomplete(MegatronDataset):
        def __len__(self) -> int:
            return 0

    with pytest.raises(TypeError):  # __getitem__ stays abstract
        Incomplete(low_level, None, np.arange(2), None, Split.train, config)
    assert parse_and_normalize_split("98,2,0") == pytest.approx([0.98, 0.02, 0.0])
    assert convert_split_vector_to_split_matrix([0.5, 0.5, 0.0]) == [(0, 0.5), (0.5, 1.0), None]


def test_build_sample_idx_upstream_form():
    sizes = np.array([3, 5, 2], dtype=np.int32)
    documents = np.array([2, 0, 1, 0, 1, 2], dtype=np.int32)  # two epochs of 10 tokens
    got = helpers.build_sample_idx(sizes, documents, 4, 2, 10)
    # stream: d2(2) d0(3) d1(5) d0(3) d1(5) d2(2) = 20 tokens; samples of 4 (+1 shared) tokens
    assert got.tolist() == [[0, 0], [1, 2], [2, 3], [3, 2], [4, 3]]
    np.testing.assert_array_equal(got, helpers.build_sample_index(sizes, documents, 4))
    assert len(helpers.build_sample_idx(sizes, documents, 4, 2, 10, drop_last_partial_sequence=False)) == 6
    with pytest.raises(ValueError, match="tokens_per_epoch"):
        helpers.build_sample_idx(sizes, documents, 4, 3, 10)


def test_null_tokenizer_upstream_sentinels():
    tok = _NullTokenizer(100)
    assert isinstance(tok, MegatronLegacyTokenizer)
    assert (tok.vocab_size, tok.eod, tok.cls, tok.sep, tok.mask) == (101, 100, -1, -1, -1)
    assert tok.additional_special_tokens_ids is None
    assert tok.tokenize("5 17 3") == [5, 17, 3] and tok.detokenize([5, 17, 3]) == "5 17 3"
    assert tok.offsets([5, 17, 3], "5 17 3") == [0, 2, 5]
    with pytest.raises(NotImplementedError):
        _ = tok.vocab
    args = argparse.Namespace(
        tokenizer_type="NullTokenizer", vocab_size=100, make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1, padded_vocab_size=None,
        **{k: None for k in ("vocab_file", "merge_file", "tokenizer_model", "tiktoken_pattern")},
    )  # fmt: skip
    for name in ("vocab_extra_ids", "tiktoken_num_special_tokens"):
        setattr(args, name, 0 if name == "vocab_extra_ids" else 1000)
    args.tiktoken_special_tokens, args.trust_remote_code = None, False
    assert build_tokenizer(args).vocab_size == 101 and args.padded_vocab_size == 128
    assert (
        _vocab_size_with_padding(101, argparse.Namespace(make_vocab_size_divisible_by=8, tensor_model_parallel_size=4))
        == 128
    )
    args.padded_vocab_size = 256  # a size from a checkpoint's arguments stays
    build_tokenizer(args)
    assert args.padded_vocab_size == 256


def _encoder_args(*extra: str) -> argparse.Namespace:
    base = ["--input", "in.jsonl", "--output-prefix", "out", "--workers", "1"]
    return get_args(base + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50", *extra])


def test_encoder_encode_and_split_per_line():
    lines = [json.dumps({"text": "1 2 3", "other": "4"}), json.dumps({"text": ["7 8", "9"], "other": "5 6"})]
    encoder = Encoder(_encoder_args("--json-keys", "text", "other", "--append-eod"))
    encoder.initializer()
    ids, lens, size = encoder.encode(lines[1])
    assert ids == {"text": [7, 8, 9, 50], "other": [5, 6, 50]} and lens == {"text": [2, 2], "other": [3]}
    assert size == len(lines[1])
    # As upstream drives it: a pool whose initializer builds the tokenizer in each worker.
    with multiprocessing.get_context("fork").Pool(2, initializer=encoder.initializer) as pool:
        results = list(pool.imap(encoder.encode, lines, 1))
    assert [r[0]["text"] for r in results] == [[1, 2, 3, 50], [7, 8, 9, 50]]
    plain = Encoder(_encoder_args())
    plain.initializer()
    assert plain.encode(lines[0])[0] == {"text": [1, 2, 3]}  # no eod without --append-eod
    assert json.loads(plain.split(lines[0])[0]) == {"text": ["1 2 3"]}
    splitting = Encoder(_encoder_args("--split-sentences"))
    splitting.initializer()
    split, _ = splitting.split(json.dumps({"text": "First one here. Second one there."}))
    assert json.loads(split) == {"text": ["First one here.", "Second one there."]}


def test_gpt_dataset_config_has_upstream_fields_and_mock_without_blend():
    upstream = [
        "random_seed", "sequence_length", "blend", "blend_per_split", "multiple_validation_sets", "full_validation",
        "split", "split_matrix", "num_dataset_builder_threads", "path_to_cache", "mmap_bin_files", "mock",
        "tokenizer", "mid_level_dataset_surplus", "allow_ambiguous_pad_tokens", "fast_cache_load",
        "defer_npy_index_mmap", "reset_position_ids", "reset_attention_mask", "eod_mask_loss",
        "create_attention_mask", "drop_last_partial_validation_sequence", "add_extra_token_to_sequence",
        "object_storage_cache_path", "data_parallel_size", "sequence_parallel_size", "hybrid_context_parallel",
        "sequences_per_dataset", "token_dtype_code", "context_parallel_size",
    ]  # fmt: skip
    assert [f.name for f in dataclasses.fields(GPTDatasetConfig)] == upstream
    config = GPTDatasetConfig(
        random_seed=0, sequence_length=8, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        tokenizer=_NullTokenizer(vocab_size=64),
    )  # fmt: skip
    assert config.mock and config.split == "1,1,1" and config.token_dtype_code == DType.code_from_dtype(np.uint16)
    assert GPTDatasetConfig(random_seed=0, sequence_length=8, tokenizer=_NullTokenizer(70_000)).token_dtype_code == 4
    for refused in ({"full_validation": True}, {"hybrid_context_parallel": True}):
        with pytest.raises(ValueError, match=next(iter(refused))):
            GPTDatasetConfig(random_seed=0, sequence_length=8, **refused)
