"""The data side of a Megatron-core training loop: compile_helpers, from_pretrained, None sizes."""

from __future__ import annotations

import json

import pytest

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import compile_helpers
from megatron.core.tokenizers import MegatronTokenizer, NullTokenizer
from tests.unit_tests.datasets.fixtures import Tokenizer, random_documents, write_dataset


def test_compile_helpers_is_a_no_op():
    assert compile_helpers() is None


@pytest.mark.parametrize("keyword", ["metadata_path", "metdata_path"])
@pytest.mark.parametrize("library", ["null", "null-text"])
def test_from_pretrained_null(keyword, library):
    tokenizer = MegatronTokenizer.from_pretrained(**{keyword: {"library": library}}, vocab_size=64)
    assert isinstance(tokenizer, NullTokenizer)
    assert tokenizer.vocab_size == 65 and tokenizer.eod == 64  # Megatron's null: eod one past the text ids
    assert tokenizer.tokenize("3 5 7") == [3, 5, 7]


def test_from_pretrained_metadata_file(tmp_path):
    (tmp_path / "tokenizer_metadata.json").write_text(json.dumps({"library": "null"}))
    tokenizer = MegatronTokenizer.from_pretrained(str(tmp_path), vocab_size=10)  # metadata beside the path
    assert tokenizer.vocab_size == 11


def test_from_pretrained_refusals(tmp_path):
    with pytest.raises(TypeError, match="vocab_sise"):
        MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_sise=10)
    with pytest.raises(TypeError, match="both metadata_path and metdata_path"):
        MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, metdata_path={"library": "null"})
    with pytest.raises(NotImplementedError, match="library='byte-level'"):
        MegatronTokenizer.from_pretrained(metadata_path={"library": "byte-level"})
    with pytest.raises(FileNotFoundError, match="tokenizer_metadata.json"):
        MegatronTokenizer.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="tokenizer_path or metadata_path"):
        MegatronTokenizer.from_pretrained()


def _mock_config(**kw):
    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=64)
    return GPTDatasetConfig(random_seed=0, sequence_length=16, tokenizer=tokenizer, **kw)


def test_no_blend_means_mock_data_split_evenly():
    config = _mock_config()
    assert config.mock and config.split == "1,1,1"
    train, valid, test = BlendedMegatronDatasetBuilder(MockGPTDataset, [100, None, None], lambda: True, config).build()
    assert len(train) >= 100
    # None: one epoch of the split's documents (valid and test are built, not skipped).
    assert len(valid) > 0 and len(test) > 0 and valid.num_samples is None
    assert _mock_config(split="1,0,0").split == "1,1,1"  # as upstream: no data means an even split


def test_none_size_over_a_weighted_blend_asserts(tmp_path):
    prefixes = [write_dataset(str(tmp_path), name, random_documents(seed=i, n=20)) for i, name in enumerate("ab")]
    config = GPTDatasetConfig(
        random_seed=0, sequence_length=8, blend=(prefixes, [0.3, 0.7]), split="1,1,0", tokenizer=Tokenizer()
    )
    with pytest.raises(AssertionError, match=r"sizes\[1\]=None \(valid\)"):
        BlendedMegatronDatasetBuilder(GPTDataset, [10, None, 0], lambda: True, config)
    unweighted = GPTDatasetConfig(
        random_seed=0, sequence_length=8, blend=(prefixes, None), split="1,1,0", tokenizer=Tokenizer(),
        path_to_cache=str(tmp_path / "cache"),
    )  # fmt: skip
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [10, None, 0], lambda: True, unweighted).build()
    assert len(train) == 10 and len(valid) > 0 and test is None
