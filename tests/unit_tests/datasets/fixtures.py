"""Tiny on-disk token datasets and a stand-in tokenizer for the dataset tests."""

import os
from typing import List

import numpy as np

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

EOD = 0
VOCAB = 50


class Tokenizer:
    """Only what the datasets read: eod, pad and the vocabulary size."""

    eod = EOD
    pad = None
    vocab_size = VOCAB


def random_documents(seed: int, n: int, max_len: int = 40) -> List[np.ndarray]:
    """``n`` documents of random tokens in [1, VOCAB), each ending with EOD."""
    rng = np.random.RandomState(seed)
    docs = []
    for _ in range(n):
        doc = rng.randint(1, VOCAB, size=rng.randint(1, max_len + 1))
        doc[-1] = EOD
        docs.append(doc)
    return docs


def write_dataset(directory: str, name: str, docs: List[np.ndarray]) -> str:
    """Write ``docs`` as ``directory/name.{bin,idx}``; returns the path prefix."""
    prefix = os.path.join(directory, name)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    for doc in docs:
        builder.add_item(np.asarray(doc, dtype=np.uint16))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    return prefix
