"""Dump megatron-core's BERTMaskedWordPieceDataset samples to an .npz (the parity oracle).

Run with ``PYTHONPATH`` pointing at a ``pip install --no-deps --target DIR megatron-core==0.16.1``::

    PYTHONPATH=DIR python tests/oracles/mcore_bert_samples.py cases.json

The cases and the .npz layout are described in ``mcore_masked_samples.py``.
"""

import sys

from mcore_masked_samples import run

FIELDS = ("text", "types", "labels", "is_random", "padding_mask", "loss_mask", "truncated")


def load_classes():
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig

    return BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig


if __name__ == "__main__":
    run(sys.argv, load_classes, FIELDS)
