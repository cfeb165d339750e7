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
]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_t5_corpus(str(tmp_path_factory.mktemp("t5_corpus")))


@pytest.fixture(scope="module")
def oracle(corpus, tmp_path_factory):
    """Run the oracle once for all cases; case id -> its .npz contents."""
    root = str(tmp_path_factory.mktemp("t5_oracle"))
    spec = {"prefix": corpus["prefix"], "tokenizer": tokenizer_spec(corpus["tokenizer"])}
    cases = []
    for name, overrides, global_seed in CASES:
        config = t5_settings(cache_dir(root, name), **overrides)
        out = os.path.join(root, f"{name}.npz")
        cases.append(dict(spec, config=config, sizes=SIZES, global_seed=global_seed, out=out))
    return run_oracle(oracle_script("mcore_t5_samples.py"), cases, root)


@pytest.mark.parametrize("name,overrides,global_seed", CASES, ids=[c[0] for c in CASES])
def test_samples_equal_megatron_core(corpus, oracle, tmp_path, name, overrides, global_seed):
    config = t5_config(corpus["tokenizer"], corpus["prefix"], str(tmp_path), **overrides)
    datasets = build_t5_datasets(config, SIZES)
    assert datasets[2] is None
    compared = assert_splits_equal(name, datasets, oracle[name], T5_FIELDS, global_seed)
    assert compared >= sum(SIZES)
