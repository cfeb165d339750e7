"""Running megatron-core's masked-dataset oracles (tests/oracles/) and comparing with ours.

The oracle runs in a subprocess with ``PYTHONPATH=$MCORE_ORACLE``, the ``--target`` folder of
``pip install --no-deps megatron-core==0.16.1`` (scripts/run_tests.sh installs it); without it
the tests that need it skip.
"""

import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Sequence

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SPLITS = ("train", "valid", "test")


def oracle_script(name: str) -> str:
    return os.path.join(REPO, "tests", "oracles", name)


def oracle_dir() -> str:
    """The megatron-core install named by ``MCORE_ORACLE``; skips the test without one."""
    path = os.environ.get("MCORE_ORACLE")
    if not path or not os.path.isdir(os.path.join(path, "megatron", "core", "datasets")):
        pytest.skip(
            "megatron-core oracle not installed: run `pip install --no-deps --target DIR megatron-core==0.16.1` "
            "and set MCORE_ORACLE=DIR (scripts/run_tests.sh does both)"
        )
    return path


def run_oracle(script: str, cases: List[Dict[str, Any]], root: str) -> Dict[str, Dict[str, np.ndarray]]:
    """Run ``script`` once on all ``cases`` (each with ``out`` = ``root/<name>.npz``); name -> arrays."""
    oracle_path = oracle_dir()
    cases_path = os.path.join(root, "cases.json")
    with open(cases_path, "w") as f:
        json.dump(cases, f)
    env = dict(os.environ, PYTHONPATH=oracle_path)
    proc = subprocess.run(
        [sys.executable, script, cases_path], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"oracle failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return {os.path.basename(case["out"])[:-4]: dict(np.load(case["out"])) for case in cases}


def stacked_samples(dataset: Any, global_seed: int, fields: Sequence[str]) -> Dict[str, np.ndarray]:
    """Every sample's ``fields`` stacked, read after seeding NumPy's global RandomState (as the oracle)."""
    np.random.seed(global_seed)
    samples = [dataset[i] for i in range(len(dataset))]
    return {field: np.array([s[field] for s in samples]) for field in fields}


def assert_splits_equal(
    name: str, datasets: Sequence[Any], expected: Dict[str, np.ndarray], fields: Sequence[str], global_seed: int
) -> int:
    """Sample index and every field of every sample equal (values and dtypes); returns the samples compared."""
    compared = 0
    for split, dataset in zip(SPLITS, datasets):
        if dataset is None:
            assert f"{split}_{fields[0]}" not in expected
            continue
        theirs_index = expected[f"{split}_sample_index"]
        np.testing.assert_array_equal(np.asarray(dataset.sample_index), theirs_index)
        assert np.asarray(dataset.sample_index).dtype == theirs_index.dtype
        ours = stacked_samples(dataset, global_seed, fields)
        for field in fields:
            theirs = expected[f"{split}_{field}"]
            assert ours[field].dtype == theirs.dtype, (name, split, field)
            np.testing.assert_array_equal(ours[field], theirs, err_msg=f"{name} {split} {field}")
        compared += len(dataset)
    return compared
