"""A small sentence-split BERT corpus and the helpers the BERT dataset tests share."""

import os
from typing import Any, Dict, List, Optional

import numpy as np

from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.tokenizers.wordpiece import BertWordPieceTokenizer
from tests.unit_tests.datasets.fixtures import random_sentence_documents, write_bert_vocab, write_sentence_dataset

FIELDS = ("text", "types", "labels", "is_random", "padding_mask", "loss_mask", "truncated")


def write_bert_corpus(directory: str, seed: int = 0, vocab_extra_ids: int = 0) -> Dict[str, Any]:
    """~50 documents of 1-8 sentences over a vocab with ``##`` pieces, plus two long-sentence ones.

    Returns ``prefix`` and ``tokenizer`` (our BertWordPieceTokenizer of that vocab, with
    ``vocab_extra_ids`` T5 sentinels).
    """
    vocab = write_bert_vocab(directory)
    tokenizer = BertWordPieceTokenizer(vocab, lower_case=False, vocab_extra_ids=vocab_extra_ids)
    first = 5  # after [PAD] [UNK] [CLS] [SEP] [MASK]
    last = tokenizer.vocab["[BOS]"]  # words and pieces only
    docs = random_sentence_documents(seed, 50, first, last)
    rng = np.random.RandomState(seed + 1)
    # A sentence over 512 tokens: its 2-sentence document is skipped, the 1-sentence one is not.
    docs.insert(7, [rng.randint(first, last, size=600), rng.randint(first, last, size=5)])
    docs.insert(30, [rng.randint(first, last, size=520)])
    return {"prefix": write_sentence_dataset(directory, "corpus", docs), "tokenizer": tokenizer}


def bert_config(tokenizer: Any, prefix: str, cache: str, **overrides: Any) -> BERTMaskedWordPieceDatasetConfig:
    """The test config: 64-token samples, an 80/20 split, ``overrides`` on top."""
    kwargs = dict(random_seed=1234, sequence_length=64, split="80,20,0", path_to_cache=cache)
    kwargs.update(overrides)
    return BERTMaskedWordPieceDatasetConfig(blend=([prefix], None), tokenizer=tokenizer, **kwargs)


def build_bert_datasets(config: BERTMaskedWordPieceDatasetConfig, sizes: List[Optional[int]]) -> List[Any]:
    """Train, valid and test datasets through our BlendedMegatronDatasetBuilder."""
    return BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, sizes, lambda: True, config).build()


def tokenizer_spec(tokenizer: Any) -> Dict[str, Any]:
    """What the oracle's stand-in tokenizer needs: token strings in id order and special ids."""
    inv = tokenizer.inv_vocab
    spec = {name: getattr(tokenizer, name) for name in ("cls", "sep", "mask", "pad", "eos")}
    spec["inv_vocab"] = [inv[i] for i in range(len(inv))]
    if tokenizer.additional_special_tokens_ids:  # T5: sentinels and bos
        spec.update(bos=tokenizer.bos, sentinels=list(tokenizer.additional_special_tokens_ids))
    assert list(inv.keys()) == list(range(len(inv))), "the oracle rebuilds inv_vocab in id order"
    return spec


def cache_dir(root: str, name: str) -> str:
    return os.path.join(root, "cache", name)
