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


def write_sentence_dataset(directory: str, name: str, documents: List[List[np.ndarray]]) -> str:
    """Write sentence-split ``documents`` (lists of sentences) as ``--split-sentences`` does."""
    prefix = os.path.join(directory, name)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    for sentences in documents:
        builder.add_document(np.concatenate(sentences).astype(np.uint16), [len(s) for s in sentences])
    builder.finalize(get_idx_path(prefix))
    return prefix


BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_bert_vocab(directory: str, words: int = 60, pieces: int = 40) -> str:
    """A WordPiece ``vocab.txt``: the special tokens, ``w0..`` words and ``##p0..`` pieces."""
    path = os.path.join(directory, "vocab.txt")
    tokens = BERT_SPECIAL + [f"w{i}" for i in range(words)] + [f"##p{i}" for i in range(pieces)]
    with open(path, "w") as f:
        f.write("\n".join(tokens) + "\n")
    return path


def random_sentence_documents(
    seed: int, n: int, first_id: int, last_id: int, max_sentences: int = 8, max_len: int = 30
) -> List[List[np.ndarray]]:
    """``n`` documents of 1..``max_sentences`` sentences of 1..``max_len`` ids in [first_id, last_id)."""
    rng = np.random.RandomState(seed)
    docs = []
    for _ in range(n):
        count = rng.randint(1, max_sentences + 1)
        docs.append([rng.randint(first_id, last_id, size=rng.randint(1, max_len + 1)) for _ in range(count)])
    return docs
