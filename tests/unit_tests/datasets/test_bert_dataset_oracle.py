"""Our BERTMaskedWordPieceDataset against megatron-core 0.16.1's, sample for sample.

The oracle runs in a subprocess (tests/oracles/mcore_bert_samples.py) with ``PYTHONPATH=$MCORE_ORACLE``,
the ``--target`` folder of ``pip install --no-deps megatron-core==0.16.1`` (scripts/run_tests.sh
installs it). Every field of every sample of the train and valid splits must be equal, and so must
the sample index, for each case below.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.core.datasets.sentence_mapping import build_mapping
from tests.unit_tests.datasets.bert_corpus import (
    FIELDS,
    bert_config,
    build_bert_datasets,
    cache_dir,
    tokenizer_spec,
    write_bert_corpus,
)
from tests.unit_tests.datasets.masked_oracle import assert_splits_equal, oracle_dir, oracle_script, run_oracle

SIZES = [240, 40, 0]

# (case id, config overrides, NumPy global seed)
CASES = [
    ("default", {}, 0),
    ("no_head", {"classification_head": False}, 0),
    ("short_seq", {"short_sequence_probability": 0.4}, 0),
    ("ngram3_word_geometric", {"masking_max_ngram": 3, "masking_use_geometric_distribution": True}, 0),
    ("permutation", {"masking_do_permutation": True, "masking_max_ngram": 2}, 5),
    ("pieces_longer_ngrams", {"masking_do_full_word": False, "masking_use_longer_ngrams": True}, 0),
    ("seed7_all_short", {"random_seed": 7, "short_sequence_probability": 1.0, "masking_probability": 0.3}, 0),
    ("seed99_no_head_short", {"random_seed": 99, "classification_head": False, "short_sequence_probability": 0.5}, 0),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_bert_corpus(str(tmp_path_factory.mktemp("bert_corpus")))


@pytest.fixture(scope="module")
def oracle(corpus, tmp_path_factory):
    """Run the oracle once for all cases; case id -> its .npz contents."""
    root = str(tmp_path_factory.mktemp("bert_oracle"))
    cases = []
    for name, overrides, global_seed in CASES:
        config = dict(random_seed=1234, sequence_length=64, split="80,20,0", path_to_cache=cache_dir(root, name))
        config.update(
            masking_probability=0.15, short_sequence_probability=0.1, masking_max_ngram=3, masking_do_full_word=True,
            masking_do_permutation=False, masking_use_longer_ngrams=False, masking_use_geometric_distribution=False,
            classification_head=True,
        )  # fmt: skip
        config.update(overrides)
        out = os.path.join(root, f"{name}.npz")
        spec = {"prefix": corpus["prefix"], "tokenizer": tokenizer_spec(corpus["tokenizer"]), "config": config}
        cases.append(dict(spec, sizes=SIZES, global_seed=global_seed, out=out))
    return run_oracle(oracle_script("mcore_bert_samples.py"), cases, root)


@pytest.mark.parametrize("name,overrides,global_seed", CASES, ids=[c[0] for c in CASES])
def test_samples_equal_megatron_core(corpus, oracle, tmp_path, name, overrides, global_seed):
    expected = oracle[name]
    config = bert_config(corpus["tokenizer"], corpus["prefix"], str(tmp_path), **overrides)
    datasets = build_bert_datasets(config, SIZES)
    compared = assert_splits_equal(name, datasets, expected, FIELDS, global_seed)
    assert compared >= sum(SIZES)


def test_sample_index_equals_build_mapping_at_scale(tmp_path):
    """Our build_mapping against the compiled one on 20k documents (empty, one-sentence and
    long-sentence ones included), for 8 combinations of its parameters in which every pair of two
    parameters' values appears (of the 64 combinations, which took 8x as long)."""
    oracle_path = oracle_dir()
    rng = np.random.RandomState(0)
    bounds = np.concatenate([[0], np.cumsum(rng.randint(0, 10, 20000))]).astype(np.int64)
    lengths = rng.randint(1, 80, bounds[-1]).astype(np.int32)
    lengths[rng.randint(0, bounds[-1], 50)] = 700
    cases = [  # [num_samples, max_seq_length, short_seq_prob, seed, min_num_sent]
        [None, 61, 0.0, 1, 1],
        [50000, 509, 0.0, 1234, 2],
        [None, 61, 0.1, 1234, 2],
        [50000, 509, 0.1, 1, 1],
        [None, 509, 0.4, 1, 2],
        [50000, 61, 0.4, 1234, 1],
        [None, 509, 0.33, 1234, 1],
        [50000, 61, 0.33, 1, 2],
    ]
    np.savez(tmp_path / "in.npz", bounds=bounds, lengths=lengths)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    script = oracle_script("mcore_build_mapping.py")
    args = [sys.executable, script, oracle_path, "in.npz", "cases.json", "out.npz"]
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = np.load(tmp_path / "out.npz")
    for k, (n, length, p, seed, m) in enumerate(cases):
        ours = build_mapping(bounds, lengths, n, length, p, seed, m)
        assert ours.dtype == expected[str(k)].dtype, cases[k]
        np.testing.assert_array_equal(ours, expected[str(k)], err_msg=str(cases[k]))
