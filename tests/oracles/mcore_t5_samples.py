"""Dump megatron-core's T5MaskedWordPieceDataset samples to an .npz (the parity oracle).

Run with ``PYTHONPATH`` pointing at a ``pip install --no-deps --target DIR megatron-core==0.16.1``::

    PYTHONPATH=DIR python tests/oracles/mcore_t5_samples.py cases.json

The cases and the .npz layout are described in ``mcore_masked_samples.py``; a T5 case's
tokenizer spec also holds ``bos`` and ``sentinels``.
"""

import sys

from mcore_masked_samples import run

FIELDS = ("text_enc", "text_dec", "labels", "loss_mask", "truncated", "enc_mask", "dec_mask")


def load_classes():
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig

    return T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig


if __name__ == "__main__":
    run(sys.argv, load_classes, FIELDS)
