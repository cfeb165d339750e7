"""Our T5MaskedWordPieceDataset against megatron-core 0.16.1's, sample for sample.

The oracle (tests/oracles/mcore_t5_samples.py) runs in a subprocess with ``PYTHONPATH=$MCORE_ORACLE``;
without it these tests skip. Every field of every sample of the train and valid splits must be
equal (values and dtypes), and so must the sample index, for each case below.
"""

import os

import pytest

from tests.unit_tests.datasets.bert_corpus import cache_dir, tokenizer_spec
from tests.unit_tests.datasets.masked_oracle import assert_splits_equal, oracle_script, run_oracle
from tests.unit_tests.datasets.t5_corpus import T5_FIELDS, build_t5_datasets, t5_config, t5_settings, write_t5_corpus

SIZES = [240, 40, 0]

# (case id, config overrides on pretrain_t5.py's settings, NumPy global seed)
CASES = [
    ("pretrain_t5", {}, 0),
    ("pretrain_t5_seed7", {"random_seed": 7}, 0),
    ("long_encoder_seed99", {"random_seed": 99, "sequence_length": 128, "sequence_length_decoder": 48}, 0),
    ("all_short_dense", {"short_sequence_probability": 1.0, "masking_probability": 0.3,
                         "sequence_length_decoder": 48}, 0),
    ("pieces_1_over_n", {"masking_do_full_word": False, "masking_use_geometric_distribution": False}, 0),
    ("longer_ngrams3", {"masking_max_ngram": 3, "masking_use_geometric_distribution": False,
                        "masking_use_longer_ngrams": True}, 0),
    ("permutation", {"masking_do_permutation": True, "masking_use_geometric_distribution": False,
                     "masking_max_ngram": 2}, 5),
    ("megatron_lengths", {"sequence_length": 512, "sequence_length_decoder": 128}, 0),
    ("pad_is_eos", {"random_seed": 3}, 0),
]  # fmt: skip


class _PadIsEos:
    """The corpus tokenizer with pad = eos: both datasets then pad with -1 (and make it 0)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @property
    def pad(self):
        return self._inner.eos


def _tokenizer(name, tokenizer):
    return _PadIsEos(tokenizer) if name == "pad_is_eos" else tokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_t5_corpus(str(tmp_path_factory.mktemp("t5_corpus")))


@pytest.fixture(scope="module")
def oracle(corpus, tmp_path_factory):
    """Run the oracle once for all cases; case id -> its .npz contents."""
    root = str(tmp_path_factory.mktemp("t5_oracle"))
    cases = []
    for name, overrides, global_seed in CASES:
        config = t5_settings(cache_dir(root, name), **overrides)
        out = os.path.join(root, f"{name}.npz")
        spec = {"prefix": corpus["prefix"], "tokenizer": tokenizer_spec(_tokenizer(name, corpus["tokenizer"]))}
        cases.append(dict(spec, config=config, sizes=SIZES, global_seed=global_seed, out=out))
    return run_oracle(oracle_script("mcore_t5_samples.py"), cases, root)


@pytest.mark.parametrize("name,overrides,global_seed", CASES, ids=[c[0] for c in CASES])
def test_samples_equal_megatron_core(corpus, oracle, tmp_path, name, overrides, global_seed):
    config = t5_config(_tokenizer(name, corpus["tokenizer"]), corpus["prefix"], str(tmp_path), **overrides)
    datasets = build_t5_datasets(config, SIZES)
    assert datasets[2] is None
    compared = assert_splits_equal(name, datasets, oracle[name], T5_FIELDS, global_seed)
    assert compared >= sum(SIZES)
    if name == "pad_is_eos":  # the -1 pad path was taken: labels pad with 0, not -1
        assert datasets[0]._pad_token_id == -1 and (oracle[name]["train_labels"] != -1).all()
