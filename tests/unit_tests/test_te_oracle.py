"""The adapter's calls into Transformer Engine, and the fake TE, against TE's real sources (read, never run).

``TE_SOURCE_ORACLE`` names an unpacked ``transformer_engine`` wheel (``scripts/run_tests.sh`` fetches
2.9.0: a download and an unzip); without it these tests skip. Both sides are parsed with ``ast``:

* every keyword the adapter passes to ``te.pytorch.Linear`` (its ``super().__init__``), to
  ``autocast`` / ``fp8_autocast`` and to each recipe class exists in TE's signature or dataclass
  fields; the names it reads (``Format`` members, recipe classes, ``init_fp8_meta_tensors``,
  ``use_bias``, the ``scaling_fwd`` / ``scaling_bwd`` meta keys) exist in TE;
* the fake's ``Linear.__init__``, ``autocast``, ``fp8_autocast`` and recipe dataclasses have only
  parameters / fields TE has, in TE's order, with TE's literal defaults.
"""

import ast
import os
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = ROOT / "megatron/core/extensions/transformer_engine.py"
FAKE = ROOT / "tests/fakes/transformer_engine"
ORACLE = os.environ.get("TE_SOURCE_ORACLE")
RECIPES = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling")

pytestmark = pytest.mark.skipif(
    not ORACLE or not (Path(ORACLE) / "transformer_engine/pytorch/module/linear.py").is_file(),
    reason="TE_SOURCE_ORACLE (an unpacked transformer_engine wheel) not given",
)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _real(relative: str) -> ast.Module:
    return _tree(Path(ORACLE) / "transformer_engine" / relative)


def _function(tree: ast.AST, name: str, cls: str = "") -> ast.FunctionDef:
    scope = tree
    if cls:
        scope = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in ast.walk(scope) if isinstance(n, ast.FunctionDef) and n.name == name)


def _params(fn: ast.FunctionDef) -> List[Tuple[str, str]]:
    """(name, default source or "") of every parameter but ``self``."""
    args = fn.args.posonlyargs + fn.args.args
    defaults = [""] * (len(args) - len(fn.args.defaults)) + [ast.unparse(d) for d in fn.args.defaults]
    pairs = list(zip([a.arg for a in args], defaults))
    pairs += [(a.arg, ast.unparse(d) if d else "") for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults)]
    return [p for p in pairs if p[0] != "self"]


def _fields(tree: ast.AST, cls: str) -> List[Tuple[str, str]]:
    """(field, default source) of a dataclass, the inherited ones first."""
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    out = []
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id != "Recipe":
            out += _fields(tree, base.id)
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            out.append((stmt.target.id, ast.unparse(stmt.value) if stmt.value else ""))
    return out


def _keywords(fn: ast.AST, callee: str) -> List[str]:
    """Keywords of the calls in ``fn`` whose function's source is ``callee``."""
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) == callee]
    assert calls, f"no call of {callee} found in the adapter: this test needs updating"
    return [k.arg for c in calls for k in c.keywords if k.arg]


def _is_literal(source: str) -> bool:
    """A default both sides can be held to (a constant or a ``Format`` member; no default counts)."""
    if not source or source.startswith("Format."):
        return True
    try:
        ast.literal_eval(source)
        return True
    except (ValueError, SyntaxError):
        return False


def test_adapter_keywords_exist_in_te():
    adapter = _tree(ADAPTER)
    linear = {p for p, _ in _params(_function(_real("pytorch/module/linear.py"), "__init__", "Linear"))}
    te_linear_init = _function(adapter, "__init__", "TELinear")
    assert set(_keywords(te_linear_init, "super().__init__")) <= linear
    quantization = _real("pytorch/quantization.py")
    for callee, real in (("te.autocast", "autocast"), ("te.fp8_autocast", "fp8_autocast")):
        assert set(_keywords(adapter, callee)) <= {p for p, _ in _params(_function(quantization, real))}, callee
    recipes = _real("common/recipe/__init__.py")
    delayed = set(_keywords(_function(adapter, "te_recipe"), "recipes.DelayedScaling"))
    assert delayed <= {f for f, _ in _fields(recipes, "DelayedScaling")}
    for cls in ("Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"):  # cls(fp8_format=fmt)
        assert set(_keywords(_function(adapter, "te_recipe"), "cls")) <= {f for f, _ in _fields(recipes, cls)}, cls


def test_names_the_adapter_reads_exist_in_te():
    recipes_src = (Path(ORACLE) / "transformer_engine/common/recipe/__init__.py").read_text()
    for name in ("E4M3", "HYBRID"):
        assert f"    {name} = " in recipes_src
    recipes = _real("common/recipe/__init__.py")
    names = {n.name for n in ast.walk(recipes) if isinstance(n, ast.ClassDef)}
    assert set(RECIPES) <= names
    assert _function(recipes, "delayed", "Recipe")
    base = _real("pytorch/module/base.py")
    assert _params(_function(base, "init_fp8_meta_tensors")) == [("recipe", "")]
    base_src = (Path(ORACLE) / "transformer_engine/pytorch/module/base.py").read_text()
    assert '"scaling_fwd"' in base_src and '"scaling_bwd"' in base_src
    assert "* 3 if fwd else" in base_src and "* 2" in base_src  # 3 forward / 2 backward meta tensors per GEMM
    assert "self.use_bias = bias" in (Path(ORACLE) / "transformer_engine/pytorch/module/linear.py").read_text()
    exported = (Path(ORACLE) / "transformer_engine/pytorch/__init__.py").read_text()
    for name in ("Linear", "autocast", "fp8_autocast"):
        assert f" import {name}\n" in exported, name


def _check_subset(fake: List[Tuple[str, str]], real: List[Tuple[str, str]], what: str) -> None:
    real_map: Dict[str, str] = dict(real)
    names = [n for n, _ in fake]
    assert set(names) <= set(real_map), f"{what}: not in TE: {set(names) - set(real_map)}"
    order = [n for n, _ in real if n in names]
    assert names == order, f"{what}: TE's order is {order}"
    for name, default in fake:
        if _is_literal(real_map[name]):
            assert default == real_map[name], f"{what}.{name}: fake default {default!r}, TE's {real_map[name]!r}"


def test_fake_signatures_are_te_signatures():
    fake_pt = _tree(FAKE / "pytorch/__init__.py")
    real_linear = _params(_function(_real("pytorch/module/linear.py"), "__init__", "Linear"))
    _check_subset(_params(_function(fake_pt, "__init__", "Linear")), real_linear, "Linear.__init__")
    real_forward = _params(_function(_real("pytorch/module/linear.py"), "forward", "Linear"))
    _check_subset(_params(_function(fake_pt, "forward", "Linear")), real_forward, "Linear.forward")
    quantization = _real("pytorch/quantization.py")
    for name in ("autocast", "fp8_autocast"):
        _check_subset(_params(_function(fake_pt, name)), _params(_function(quantization, name)), name)
    fake_recipes, real_recipes = _tree(FAKE / "common/recipe/__init__.py"), _real("common/recipe/__init__.py")
    for cls in RECIPES:
        _check_subset(_fields(fake_recipes, cls), _fields(real_recipes, cls), cls)
