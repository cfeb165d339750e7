"""docs/API.md tells the truth about our megatron-core 0.16 surface.

The file is regenerated in memory from megatron-core 0.16.1's source (``MCORE_ORACLE``, installed
by scripts/run_tests.sh, read as text) and our imported modules; it must equal the committed file,
so a name that goes missing or a signature that changes fails here until the table says so. Every
row that is neither ``same`` nor ``extended`` needs a hand-written reason.
"""

import os

import pytest

from tools import api_surface

DOC = os.path.join(api_surface.REPO, "docs", "API.md")


def _oracle() -> str:
    path = os.environ.get("MCORE_ORACLE")
    if not path or not os.path.isdir(os.path.join(path, "megatron", "core")):
        pytest.skip(
            "megatron-core 0.16.1 oracle not installed: pip install --no-deps --target DIR "
            "megatron-core==0.16.1 and set MCORE_ORACLE=DIR (scripts/run_tests.sh does both)"
        )
    return path


def test_api_md_matches_the_code_and_upstream():
    expected = api_surface.build(_oracle(), DOC)
    with open(DOC, encoding="utf-8") as fh:
        actual = fh.read()
    fix = "python tools/api_surface.py --oracle $MCORE_ORACLE --write docs/API.md"
    assert actual == expected, f"docs/API.md is stale: {fix}"


def test_every_row_that_is_not_same_says_why():
    with open(DOC, encoding="utf-8") as fh:
        missing = api_surface.unexplained(fh.read())
    assert not missing, f"{len(missing)} rows need a note in docs/API.md: {missing[:20]}"


EMPTY = api_surface.inspect.Parameter.empty


def test_the_comparison_sees_signature_differences():
    up = [api_surface.Param("a", "pos", None), api_surface.Param("b", "pos", "1")]
    same, extended = api_surface.compare_params(up, [("a", "pos", EMPTY), ("b", "pos", 1)])
    assert (same, extended) == ([], False)
    moved, _ = api_surface.compare_params(up, [("b", "pos", 1), ("a", "pos", EMPTY)])
    assert moved and "positional #0" in moved[0]
    wrong_default, _ = api_surface.compare_params(up, [("a", "pos", EMPTY), ("b", "pos", 2)])
    assert wrong_default == ["default of 'b': upstream 1"]
    problems, extended = api_surface.compare_params(up, [("a", "pos", EMPTY), ("b", "pos", 1), ("c", "kw", None)])
    assert (problems, extended) == ([], True)


def test_every_covered_module_path_imports():
    """Issue 38: code written for megatron-core imports the same module paths (no oracle needed)."""
    import importlib

    extra = ("megatron.training.tokenizer", "megatron.training.initialize", "megatron.training.global_vars")
    extra += ("megatron.training.argument_utils", "megatron.core.inference.contexts.static_context")
    for path in [f"megatron.core.{m}" for m in api_surface.MODULES] + list(extra):
        importlib.import_module(path)
