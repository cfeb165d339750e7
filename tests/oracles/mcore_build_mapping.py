"""Run megatron-core's compiled ``helpers_cpp.build_mapping`` on given arrays (the index oracle).

Usage: ``python tests/oracles/mcore_build_mapping.py MCORE_DIR IN.npz CASES.json OUT.npz``.
``IN.npz`` holds ``bounds`` (int64 document bounds in sentences) and ``lengths`` (int32 sentence
lengths); each case is ``[num_samples or null, max_seq_length, short_seq_prob, seed, min_num_sent]``
and its rows are written to ``OUT.npz`` under the case's position. The extension module is loaded
from its file, so neither megatron package is imported.
"""

import glob
import importlib.util
import json
import os
import sys

import numpy

INT32_MAX = 2**31 - 1


def load_helpers(mcore_dir):
    """megatron-core's compiled helpers module, loaded by path."""
    found = glob.glob(os.path.join(mcore_dir, "megatron", "core", "datasets", "helpers_cpp*.so"))
    if not found:
        sys.exit(f"no compiled helpers_cpp under {mcore_dir}/megatron/core/datasets")
    spec = importlib.util.spec_from_file_location("helpers_cpp", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(mcore_dir, in_path, cases_path, out_path):
    helpers = load_helpers(mcore_dir)
    arrays = numpy.load(in_path)
    with open(cases_path) as f:
        cases = json.load(f)
    out = {}
    for k, (num_samples, max_len, short_prob, seed, min_sent) in enumerate(cases):
        # As megatron-core calls it: ~all epochs when samples are counted, else one (and no cap).
        epochs = 1 if num_samples is None else INT32_MAX - 1
        cap = 2**63 if num_samples is None else num_samples
        out[str(k)] = helpers.build_mapping(
            arrays["bounds"], arrays["lengths"], epochs, cap, max_len, short_prob, seed, False, min_sent
        )
    numpy.savez(out_path, **out)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(f"usage: {os.path.basename(sys.argv[0])} MCORE_DIR IN.npz CASES.json OUT.npz")
    main(*sys.argv[1:])
