"""The import graph of ``megatron/``, ``tools/`` and the entry points: no cycles, and the layers point one way.

Every module is parsed with ``ast`` (nothing is imported); every ``import`` / ``from ... import``
anywhere in it (module level, inside functions, inside ``try``) and every ``importlib.import_module`` /
``__import__`` of a string becomes an edge to the module it names (an f-string: to the package its
literal prefix names). ``from pkg import name`` points at ``pkg.name`` when that is a module, else at
``pkg`` (its ``__init__``). Rules:

* no cycle between modules, lazy imports included (a function-level import that closes a cycle is
  still one), and none between packages (``PACKAGE_DEPTH``) but the ones ``KNOWN_PACKAGE_CYCLES``
  names with their reason;
* an import never goes up ``LAYERS`` (the one written order of the layers);
* a tool imports the application (``megatron.training``) or an entry point only where
  ``TOOLS_USING_THE_APPLICATION`` says why; the others use ``megatron.core``.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
Graph = Dict[str, Set[str]]

# The layers, top first: a module may import its own layer and those below it, never one above.
# A module's layer is that of the longest prefix listed.
ENTRY_POINTS = "pretrain_*.py"  # the scripts at the repository's root
LAYERS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("tools", ("tools",)),
    ("entry points", (ENTRY_POINTS,)),
    ("application", ("megatron.training",)),
    (
        "models and runtime",
        (
            "megatron.core.models",
            "megatron.core.datasets",
            "megatron.core.pipeline_parallel",
            "megatron.core.distributed",
            "megatron.core.optimizer",
            "megatron.core.inference",
        ),
    ),
    # megatron.core.fp8_utils: Megatron-core's import path of transformer/fp8_utils.py, a re-export.
    # megatron.core.ssm: the Mamba layers, built from the transformer's specs, norms and layers.
    ("transformer", ("megatron.core.transformer", "megatron.core.fp8_utils", "megatron.core.ssm")),
    ("foundations", ("megatron.core",)),  # parallel state, tensor parallelism, quantization, checkpoint I/O, utils
)

# Tools that take the application's flags, configs or checkpoints; any other tool uses megatron.core only.
TOOLS_USING_THE_APPLICATION: Dict[str, str] = {
    "tools.checkpoint": "reads and writes the training checkpoints (directory layout, tracker, common.json) and "
    "checks model flags against their records, as the training run that loads them will",
    "tools.dry_run": "plays pretrain_gpt.py's pretrain() as one rank: the tool is a harness around the application",
    "tools.text_generation": "builds the model the way training does (flags, initialization, checkpoint load)",
    "tools.run_text_generation_server": "the server's entry point: pretrain_gpt's model provider, the run's start-up",
    "tools.plan_parallelism": "evaluates the training flags of a planned run (validation, memory, FLOPs)",
}

# Package cycles left, each with why it is not broken yet.
KNOWN_PACKAGE_CYCLES: Dict[frozenset, str] = {
    frozenset({"megatron.training.flags", "megatron.training.flags_table"}): "flags_table.py builds the Megatron "
    "flag table from the records' types and the records take its type converters: one unit split over two "
    "names; merging them belongs to the flag-record work (issue 28, item 2)",
}

# Nodes of the package graph: megatron.core.X, megatron.training.X, tools.X and each entry point.
PACKAGE_ROOTS = ("megatron.core", "megatron.training", "tools")


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


def _string_load(node: ast.Call) -> Optional[str]:
    """The module an ``importlib.import_module(...)`` / ``__import__(...)`` call names, if its argument is
    a string (an f-string: its literal prefix up to the last dot), else None."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rpartition(".")[0] or None
    return None


def _known_prefix(name: str, known: Set[str]) -> Optional[str]:
    """``name`` or its nearest parent that is a known module."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def imported_modules_of_source(
    source: str, module: str, is_package: bool, known: Set[str], where: str = ""
) -> Set[str]:
    """The known modules a module's ``source`` imports, wherever the statement stands."""
    targets: Set[str] = set()
    for node in ast.walk(ast.parse(source, where or module)):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in known else base)
        elif isinstance(node, ast.Call) and (loaded := _string_load(node)):
            targets.add(_known_prefix(loaded, known) or loaded)
    return {t for t in targets if t in known and t != module}


def imported_modules(path: Path, root: Path, known: Set[str]) -> Set[str]:
    """The known modules the file ``path`` imports."""
    module = module_name(path, root)
    return imported_modules_of_source(path.read_text(), module, path.name == "__init__.py", known, str(path))


def source_files(root: Path = ROOT) -> List[Path]:
    """``megatron/``, ``tools/`` and the ``pretrain_*.py`` entry points."""
    return sorted([*(root / "megatron").rglob("*.py"), *(root / "tools").rglob("*.py"), *root.glob("pretrain_*.py")])


def graph_of_sources(sources: Dict[str, Tuple[str, bool]]) -> Graph:
    """Module -> the modules it imports, for ``sources`` (module -> (source text, is a package))."""
    known = set(sources)
    return {m: imported_modules_of_source(text, m, pkg, known) for m, (text, pkg) in sources.items()}


def import_graph(root: Path = ROOT, files: Optional[Iterable[Path]] = None) -> Graph:
    """Module -> the modules it imports, for every file of ``source_files(root)`` (or ``files``)."""
    paths = list(files) if files is not None else source_files(root)
    return graph_of_sources({module_name(p, root): (p.read_text(), p.name == "__init__.py") for p in paths})


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


def package_of(module: str) -> str:
    """The package-graph node of ``module``: ``megatron.core.X``, ``megatron.training.X``, ``tools.X``, or itself."""
    for root in PACKAGE_ROOTS:
        if module.startswith(root + "."):
            return ".".join(module.split(".")[: root.count(".") + 2])
    return module


def package_graph(graph: Graph) -> Graph:
    """Package -> the packages its modules import (other than itself)."""
    packages: Graph = {}
    for module, targets in graph.items():
        node = package_of(module)
        packages.setdefault(node, set()).update(package_of(t) for t in targets)
        packages[node].discard(node)
    return packages


def package_cycles(graph: Graph, known: Dict[frozenset, str]) -> List[List[str]]:
    """Every package cycle of ``graph`` not in ``known`` (each as ``[a, ..., a]``): ``known`` cycles'
    edges are removed one cycle at a time, so a new cycle through a known one's packages is still found."""
    packages = {k: set(v) for k, v in package_graph(graph).items()}
    found = []
    while (cycle := find_cycle(packages)) is not None:
        if frozenset(cycle) not in known:
            found.append(cycle)
        packages[cycle[-2]].discard(cycle[-1])  # drop the edge that closes it and look again
    return found


def _in(module: str, prefix: str) -> bool:
    if prefix == ENTRY_POINTS:
        return module.startswith("pretrain_") and "." not in module
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` (0: top) of the longest listed prefix of ``module``."""
    matches = [(len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes if _in(module, prefix)]
    if not matches:
        raise AssertionError(f"{module} is in no layer of LAYERS")
    return max(matches)[1]


def upward_imports(graph: Graph) -> List[str]:
    """``a -> b (layer A below layer B)`` for every import that goes up ``LAYERS``."""
    return [
        f"{a} -> {b} ({LAYERS[layer_of(a)][0]} imports {LAYERS[layer_of(b)][0]})"
        for a in sorted(graph)
        for b in sorted(graph[a])
        if layer_of(b) < layer_of(a)
    ]


def tools_using_the_application(graph: Graph, allowed: Dict[str, str]) -> List[str]:
    """Tool modules importing ``megatron.training`` or an entry point outside ``allowed``'s packages."""
    return [
        f"{a} -> {b}"
        for a in sorted(graph)
        if a.startswith("tools.") and package_of(a) not in allowed
        for b in sorted(graph[a])
        if b.startswith("pretrain_") or b == "megatron.training" or b.startswith("megatron.training.")
    ]


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph()


def test_graph_sees_lazy_relative_and_string_imports(tmp_path):
    """The walker must find a function-level import, a relative import, ``from pkg import module`` and
    ``importlib.import_module`` of a string and of an f-string."""
    pkg = tmp_path / "megatron"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__.py", "sub/__init__.py", "sub/b.py", "c.py", "d.py"):
        (pkg / name).write_text("")
    (pkg / "a.py").write_text("import importlib\ndef f():\n    from megatron.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from .. import c\n")
    (pkg / "c.py").write_text("import megatron.a\n")
    (pkg / "d.py").write_text(
        "import importlib\nimportlib.import_module('megatron.c')\n__import__(f'megatron.sub.{x}')\n"
    )
    toy = import_graph(tmp_path, sorted(pkg.rglob("*.py")))
    assert toy["megatron.a"] == {"megatron.sub.b"}
    assert toy["megatron.sub.b"] == {"megatron.c"}
    assert toy["megatron.d"] == {"megatron.c", "megatron.sub"}
    assert find_cycle(toy) == ["megatron.a", "megatron.sub.b", "megatron.c", "megatron.a"]


def test_the_graph_covers_tools_and_entry_points(graph):
    assert {"pretrain_gpt", "pretrain_bert", "pretrain_t5", "tools.checkpoint.convert", "tools.dry_run.runner"} <= set(
        graph
    )
    assert "pretrain_gpt" in graph["tools.dry_run.runner"]  # the dry run's import of the entry point is seen


def test_no_import_cycles(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_package_cycles(graph):
    cycles = package_cycles(graph, KNOWN_PACKAGE_CYCLES)
    assert cycles == [], "package cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_known_package_cycle_still_exists(graph):
    """A cycle broken is taken off the list (the list says what is left, not what was)."""
    gone = [sorted(c) for c in KNOWN_PACKAGE_CYCLES if c not in {frozenset(x) for x in _all_cycles(graph)}]
    assert gone == [], f"no longer a cycle, remove it from KNOWN_PACKAGE_CYCLES: {gone}"


def _all_cycles(graph: Graph) -> List[List[str]]:
    return package_cycles(graph, {})


def test_layers_point_one_way(graph):
    """No import goes up ``LAYERS`` (hence no chain of imports does either)."""
    assert upward_imports(graph) == []


def test_tools_use_the_application_only_where_written_down(graph):
    assert tools_using_the_application(graph, TOOLS_USING_THE_APPLICATION) == []
    stale = [p for p in TOOLS_USING_THE_APPLICATION if p not in {package_of(m) for m in graph}]
    assert stale == [], f"TOOLS_USING_THE_APPLICATION names tools that do not exist: {stale}"


def _planted(graph: Graph, module: str, source: str) -> Graph:
    """``graph`` with ``module``'s imports replaced by those of ``source`` (parsed like a real file)."""
    planted = {k: set(v) for k, v in graph.items()}
    planted[module] = imported_modules_of_source(source, module, False, set(graph))
    return planted


def test_checks_fail_on_planted_upward_imports_and_cycles(graph):
    """Each rule finds a violation fed to it as module source: the checks can fail."""
    tool = _planted(graph, "tools.merge_datasets", "from megatron.training.checkpointing import save_checkpoint\n")
    assert tools_using_the_application(tool, TOOLS_USING_THE_APPLICATION) == [
        "tools.merge_datasets -> megatron.training.checkpointing"
    ]
    loaded = _planted(graph, "tools.merge_datasets", "import importlib\nimportlib.import_module('pretrain_gpt')\n")
    assert tools_using_the_application(loaded, TOOLS_USING_THE_APPLICATION) == ["tools.merge_datasets -> pretrain_gpt"]
    up = _planted(graph, "megatron.core.transformer.enums", "def f():\n    import pretrain_gpt\n")
    assert upward_imports(up) == ["megatron.core.transformer.enums -> pretrain_gpt (transformer imports entry points)"]
    # A package cycle through a lazy import (tensor_parallel -> transformer -> tensor_parallel), no module cycle.
    lazy = "def f():\n    from megatron.core.transformer import enums\n"
    cyc = _planted(graph, "megatron.core.tensor_parallel.utils", lazy)
    assert find_cycle(cyc) is None
    cycles = package_cycles(cyc, KNOWN_PACKAGE_CYCLES)
    assert cycles and all({"megatron.core.tensor_parallel", "megatron.core.transformer"} <= set(c) for c in cycles)
    assert upward_imports(cyc) == [
        "megatron.core.tensor_parallel.utils -> megatron.core.transformer.enums (foundations imports transformer)"
    ]


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
        ("megatron.core.fp8_utils", "attach_quantizers convert_weights_to_fp8 is_layer_in_high_precision"),
        ("megatron.core.pipeline_parallel.layer_layout", "pipeline_layer_assignment stage_layer_counts"),
    ],
)
def test_megatron_import_paths_kept(module, names):
    """Moving code to break cycles keeps the import paths Megatron-core users write."""
    imported = importlib.import_module(module)
    assert [n for n in names.split() if not hasattr(imported, n)] == []
