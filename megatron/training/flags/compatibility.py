"""The compatibility matrix on the command line, and ``docs/COMPATIBILITY.md`` generated from it.

The matrix itself is data in ``megatron/core/compatibility.py`` (configs read it too). Here each
setting gets the flag a user writes; :func:`refused_message` is what validation raises for a refused
pair before anything is built; ``python -m megatron.training.flags.compatibility --write
docs/COMPATIBILITY.md`` regenerates the document (``--check`` exits 1 when it is stale).
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Optional

from megatron.core import compatibility
from megatron.core.compatibility import FEATURES, REFUSED, Refused
from megatron.training.flags.registry import CONFIG_TARGETS, fills_of, flag_names

DOC_PATH = "docs/COMPATIBILITY.md"
# Settings validation computes from several flags (no flag fills them one to one).
_COMPUTED = {
    "virtual_pipeline_model_parallel_size": "--num-layers-per-virtual-pipeline-stage"
    " / --num-virtual-stages-per-pipeline-rank",
}


def flag_for(setting: str) -> str:
    """The flag a user writes for ``setting`` (a flag destination, or a config field a flag fills)."""
    names = flag_names()
    if setting in names:
        return names[setting]
    if setting in _COMPUTED:
        return _COMPUTED[setting]
    for target in CONFIG_TARGETS:
        if setting in fills_of(target):
            return names[fills_of(target)[setting][0]]
    raise KeyError(f"no flag sets the matrix setting {setting!r}")


def _args_lookup(args: argparse.Namespace) -> compatibility.Lookup:
    return compatibility.attribute_lookup(args)


def refused_message(args: argparse.Namespace) -> Optional[str]:
    """The error for the first refused pair the validated flags ``args`` turn on, or None.

    The message names each flag with its value, both features and the matrix's reason.
    """
    lookup = _args_lookup(args)
    found = compatibility.refusals(lookup)
    if not found:
        return None
    rule = found[0]
    values = ", ".join(f"{flag_for(s)}={lookup(s)!r}" for s in compatibility.settings_of(rule))
    first, second = FEATURES[rule.first].text, FEATURES[rule.second].text
    return f"{values}: {first} with {second} is not supported: {rule.reason} (see {DOC_PATH})"


def _feature_flags(name: str) -> str:
    return ", ".join(f"`{flag_for(s)}`" for s in FEATURES[name].settings)


def _refused_by_feature() -> Dict[str, List[Refused]]:
    table: Dict[str, List[Refused]] = {}
    for rule in REFUSED:
        table.setdefault(rule.first, []).append(rule)
        table.setdefault(rule.second, []).append(rule)
    return table


def render() -> str:
    """The text of ``docs/COMPATIBILITY.md``: the features, the refused pairs with reasons, per feature."""
    lines = [
        "# Compatibility matrix",
        "",
        "Generated from `megatron/core/compatibility.py` by "
        f"`python -m megatron.training.flags.compatibility --write {DOC_PATH}`; do not edit by hand "
        "(`tests/unit_tests/training/test_compatibility.py` fails when it is stale).",
        "",
        "Every pair of features **not** listed under *Refused pairs* is supported. A refused pair stops "
        "`pretrain_gpt.py` (and the other entry points) during argument validation, before any model is built, "
        "with a message naming both flags and the reason; the configs (`TransformerConfig`, "
        "`DistributedDataParallelConfig`, `OptimizerConfig`) refuse the same pairs for library callers.",
        "",
        "Speed-only flags (overlaps, grouped GEMM, fusions, bucket sizes, dispatchers, recomputation, ...) "
        "combine with each other and with every layout: `tests/unit_tests/training/test_speed_flag_invariance.py` "
        "proves all pairs of them give the same losses and grad norms.",
        "",
        "## Features",
        "",
        "| feature | in use when | flags |",
        "|---|---|---|",
    ]
    lines += [f"| `{f.name}` | {f.text} | {_feature_flags(f.name)} |" for f in FEATURES.values()]
    lines += ["", "## Refused pairs", "", "| feature | with | flags | reason |", "|---|---|---|---|"]
    for rule in REFUSED:
        flags = ", ".join(f"`{flag_for(s)}`" for s in compatibility.settings_of(rule))
        first, second = FEATURES[rule.first].text, FEATURES[rule.second].text
        lines.append(f"| {first} | {second} | {flags} | {rule.reason} |")
    lines += ["", "## By feature", ""]
    by_feature = _refused_by_feature()
    for name, feature in FEATURES.items():
        others = sorted(FEATURES[r.second if r.first == name else r.first].text for r in by_feature.get(name, []))
        lines.append(f"- **{feature.text}** (`{name}`): refused with " + "; ".join(others))
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    """``--write PATH``: write the document; ``--check PATH``: exit 1 if PATH differs from the matrix."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", metavar="PATH")
    group.add_argument("--check", metavar="PATH")
    options = parser.parse_args(argv)
    text = render()
    if options.write:
        with open(options.write, "w", encoding="utf-8") as f:
            f.write(text)
        return 0
    with open(options.check, encoding="utf-8") as f:
        stale = f.read() != text
    if stale:
        print(f"{options.check} is stale: run python -m megatron.training.flags.compatibility --write {options.check}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
