"""Concatenate Megatron indexed datasets into one.

    python tools/merge_datasets.py --input DIR --output-prefix OUT        # every dataset in DIR
    python tools/merge_datasets.py --input A B C --output-prefix OUT      # these prefixes, in order

Documents keep their order and boundaries; all inputs must share one dtype. NumPy only.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
    publish_dataset,
    remove_dataset,
    temporary_prefix,
)


def find_prefixes(inputs: Sequence[str]) -> List[str]:
    """Dataset prefixes from one directory (sorted by name) or from a list of prefixes."""
    if len(inputs) == 1 and os.path.isdir(inputs[0]):
        names = sorted(n[: -len(".idx")] for n in os.listdir(inputs[0]) if n.endswith(".idx"))
        prefixes = [os.path.join(inputs[0], n) for n in names]
        if not prefixes:
            raise ValueError(f"--input {inputs[0]}: directory has no .idx files")
    else:
        prefixes = list(inputs)
    for p in prefixes:
        if not IndexedDataset.exists(p):
            raise ValueError(f"{p}: needs both {get_idx_path(p)} and {get_bin_path(p)}")
    return prefixes


def write_merged(prefixes: Sequence[str], output_prefix: str, multimodal: bool = False) -> None:
    """Write the concatenation of ``prefixes`` at ``output_prefix`` itself (removed again on failure).

    Raises:
        ValueError: an input is unreadable or the dtypes differ.
    """
    if not prefixes:
        raise ValueError("no datasets to merge")
    # Open every input first so a bad or mismatched one fails before anything is written.
    dtypes = {p: IndexedDataset(p, multimodal=multimodal).dtype for p in prefixes}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{p}: {d.__name__}" for p, d in dtypes.items())
        raise ValueError(f"datasets have different dtypes ({listing})")
    builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=dtypes[prefixes[0]], multimodal=multimodal)
    try:
        for p in prefixes:
            builder.add_index(p)
        builder.finalize(get_idx_path(output_prefix))
    except BaseException:
        builder.close()
        remove_dataset(output_prefix)
        raise


def merge_datasets(prefixes: Sequence[str], output_prefix: str, multimodal: bool = False) -> None:
    """Write the concatenation of ``prefixes`` to ``output_prefix``.

    The result is written under a temporary prefix and published only once complete
    (``publish_dataset``): an existing dataset at ``output_prefix`` survives any failure or kill.

    Raises:
        ValueError: an input is unreadable, the dtypes differ, or the output is also an input.
    """
    out = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == out for p in prefixes):
        raise ValueError(f"--output-prefix {output_prefix} is also an input")
    tmp = temporary_prefix(output_prefix)
    write_merged(prefixes, tmp, multimodal)
    try:
        publish_dataset(tmp, output_prefix)
    finally:
        remove_dataset(tmp)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the tool; returns the process exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="a directory of datasets, or dataset prefixes")
    p.add_argument("--output-prefix", required=True, help="prefix of the merged dataset")
    p.add_argument("--multimodal", action="store_true", help="the datasets carry sequence modes")
    args = p.parse_args(argv)
    try:
        prefixes = find_prefixes(args.input)
        merge_datasets(prefixes, args.output_prefix, args.multimodal)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
