"""The import graph of ``megatron/``: no cycles, and the layers point one way.

Every module is parsed with ``ast`` (nothing is imported); every ``import`` / ``from ... import``
anywhere in it (module level, inside functions, inside ``try``) becomes an edge to the megatron
module it names. ``from pkg import name`` points at ``pkg.name`` when that is a module, else at
``pkg`` (its ``__init__``). Rules:

* no cycle, lazy imports included (a function-level import that closes a cycle is still one);
* ``megatron.core.transformer`` never reaches ``megatron.core.models`` (models are built from
  transformer blocks, not the reverse);
* ``megatron.core`` never reaches ``megatron.training`` (the library does not know the application).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest

ROOT = Path(__file__).resolve().parents[2]
Graph = Dict[str, Set[str]]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module of ``from <node.module> import ...`` written in ``module``."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(path: Path, root: Path, known: Set[str]) -> Set[str]:
    """The megatron modules ``path`` imports, wherever the import statement stands."""
    module = module_name(path, root)
    targets: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, path.name == "__init__.py")
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in known else source)
    return {t for t in targets if t in known and t != module}


def import_graph(root: Path = ROOT, package: str = "megatron") -> Graph:
    """Module -> the modules of ``package`` it imports, for every ``.py`` file under ``root/package``."""
    paths = sorted((root / package).rglob("*.py"))
    known = {module_name(p, root) for p in paths}
    return {module_name(p, root): imported_modules(p, root, known) for p in paths}


def find_cycle(graph: Graph) -> Optional[List[str]]:
    """One import cycle as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def path_between(graph: Graph, source: str, target_prefix: str) -> Optional[List[str]]:
    """A chain of imports from ``source`` to a module under ``target_prefix`` (breadth first), or None."""
    parents: Dict[str, Optional[str]] = {source: None}
    queue = [source]
    while queue:
        node = queue.pop(0)
        if node == target_prefix or node.startswith(target_prefix + "."):
            chain = [node]
            while parents[chain[-1]] is not None:
                chain.append(parents[chain[-1]])
            return chain[::-1]
        for nxt in sorted(graph[node]):
            if nxt not in parents:
                parents[nxt] = node
                queue.append(nxt)
    return None


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph()


def test_graph_sees_lazy_and_relative_imports(tmp_path):
    """The walker must find a function-level import, a relative import and a ``from pkg import module``."""
    pkg = tmp_path / "megatron"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__.py", "sub/__init__.py", "sub/b.py", "c.py"):
        (pkg / name).write_text("")
    (pkg / "a.py").write_text("def f():\n    from megatron.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from .. import c\n")
    (pkg / "c.py").write_text("import megatron.a\n")
    toy = import_graph(tmp_path)
    assert toy["megatron.a"] == {"megatron.sub.b"}
    assert toy["megatron.sub.b"] == {"megatron.c"}
    assert find_cycle(toy) == ["megatron.a", "megatron.sub.b", "megatron.c", "megatron.a"]


def test_no_import_cycles(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    "importer, forbidden",
    [("megatron.core.transformer", "megatron.core.models"), ("megatron.core", "megatron.training")],
)
def test_layers_point_one_way(graph, importer, forbidden):
    """No module under ``importer`` reaches ``forbidden``, directly or through other modules."""
    for module in sorted(m for m in graph if m == importer or m.startswith(importer + ".")):
        chain = path_between(graph, module, forbidden)
        assert chain is None, f"{importer} must not import {forbidden}: " + " -> ".join(chain)


@pytest.mark.parametrize(
    "module, names",
    [
        (
            "megatron.core.pipeline_parallel.schedules",
            "forward_step backward_step get_forward_backward_func forward_backward_no_pipelining "
            "forward_backward_pipelining_with_interleaving forward_backward_pipelining_without_interleaving "
            "get_model_config",
        ),
        ("megatron.core.models.gpt", "GPTModel get_gpt_layer_local_spec"),
        ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding apply_rotary_pos_emb"),
        ("megatron.core.utils", "unwrap_model"),
        ("megatron.training.utils", "unwrap_model"),
    ],
)
def test_megatron_import_paths_kept(module, names):
    """Moving code to break cycles keeps the import paths Megatron-core users write."""
    imported = importlib.import_module(module)
    assert [n for n in names.split() if not hasattr(imported, n)] == []
