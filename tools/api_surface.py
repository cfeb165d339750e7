"""Compare megatron-core 0.16's public API with ours, module by module; write or check docs/API.md.

    python tools/api_surface.py --oracle DIR --write docs/API.md   # regenerate, keeping the notes
    python tools/api_surface.py --oracle DIR --check docs/API.md   # exit 1 when the file is stale

DIR is a ``pip install --no-deps --target DIR megatron-core==0.16.1`` folder (scripts/run_tests.sh
makes one and exports it as ``MCORE_ORACLE``). Upstream is read as text with ``ast`` and never
imported or executed. Ours is imported and inspected.

A name's status:
- ``same``: present, and for functions and classes every upstream parameter is accepted at the same
  position with the same literal default (dataclasses: every upstream field exists with that default;
  classes: every public upstream method exists);
- ``extended``: the same, plus parameters of ours that have defaults;
- ``differs``: present but a parameter, default, field or method differs (the detail says which);
- ``not supported yet``: absent.
Every row that is not ``same`` or ``extended`` needs a hand-written note in docs/API.md saying why.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Upstream modules under megatron.core whose public names docs/API.md covers (issue 13's list).
MODULES: Tuple[str, ...] = (
    "parallel_state",
    "tensor_parallel",
    "tensor_parallel.mappings",
    "tensor_parallel.random",
    "tensor_parallel.layers",
    "tensor_parallel.data",
    "tensor_parallel.utils",
    "tensor_parallel.cross_entropy",
    "transformer",
    "transformer.transformer_config",
    "transformer.spec_utils",
    "transformer.enums",
    "transformer.module",
    "transformer.attention",
    "transformer.mlp",
    "transformer.transformer_layer",
    "transformer.transformer_block",
    "models.common.embeddings.language_model_embedding",
    "models.gpt",
    "models.gpt.gpt_model",
    "models.gpt.gpt_layer_specs",
    "dist_checkpointing",
    "dist_checkpointing.mapping",
    "dist_checkpointing.serialization",
    "pipeline_parallel.schedules",
    "num_microbatches_calculator",
    "datasets.utils",
    "datasets.indexed_dataset",
    "datasets.megatron_dataset",
    "datasets.blended_dataset",
    "datasets.blended_megatron_dataset_config",
    "datasets.blended_megatron_dataset_builder",
    "datasets.gpt_dataset",
    "distributed",
    "distributed.distributed_data_parallel_config",
    "distributed.distributed_data_parallel",
    "distributed.param_and_grad_buffer",
    "distributed.finalize_model_grads",
    "optimizer",
    "optimizer.optimizer_config",
    "optimizer.optimizer",
    "optimizer.distrib_optimizer",
    "tokenizers",
    "config",
    "process_groups_config",
    "utils",
    "optimizer_param_scheduler",
    "dist_checkpointing.dict_utils",
    "dist_checkpointing.strategies.base",
    "transformer.moe.moe_layer",
    "safe_globals",
    "transformer.pipeline_parallel_layer_layout",
    "optimizer.cpu_offloading",
    "hyper_comm_grid",
    "inference.contexts.dynamic_context",
    "transformer.heterogeneous.heterogeneous_config",
    "transformer.heterogeneous.linear_replacements",
    "models.gpt.heterogeneous.heterogeneous_layer_specs",
)

# Modules too large to cover whole: only these names of theirs are listed (issue 38's list).
SELECTED: Dict[str, Tuple[str, ...]] = {
    "utils": (
        "get_te_version",
        "is_te_min_version",
        "get_torch_version",
        "is_torch_min_version",
        "ExperimentalNotEnabledError",
        "experimental_cls",
        "get_tensor_model_parallel_group_if_none",
        "unwrap_model",
    ),
    "process_groups_config": ("ProcessGroupCollection",),
    "optimizer_param_scheduler": ("get_canonical_lr_for_logging",),
    "dist_checkpointing.strategies.base": ("StrategyAction",),
    "transformer.moe.moe_layer": ("MoELayer",),
    "inference.contexts.dynamic_context": ("DynamicInferenceContext",),
    "transformer.heterogeneous.linear_replacements": ("ColumnParallelLinearGathered",),
    "models.gpt.heterogeneous.heterogeneous_layer_specs": ("get_gpt_heterogeneous_layer_spec",),
}

# Private names that downstream code uses widely enough to be part of the surface.
PRIVATE_KEPT: Dict[str, Tuple[str, ...]] = {
    "num_microbatches_calculator": ("_GLOBAL_NUM_MICROBATCHES_CALCULATOR",),
    "tensor_parallel.mappings": (
        "_CopyToModelParallelRegion",
        "_ReduceFromModelParallelRegion",
        "_ScatterToModelParallelRegion",
        "_GatherFromModelParallelRegion",
        "_ScatterToSequenceParallelRegion",
        "_GatherFromSequenceParallelRegion",
        "_ReduceScatterToSequenceParallelRegion",
    ),
}

# Module-level names that are implementation detail upstream, not API (loggers, import probes).
NOT_API = {"logger", "_logger"}

STATUSES = ("same", "extended", "differs", "not supported yet")


@dataclass
class Param:
    """One parameter: name, kind (``pos``, ``kw``, ``var``) and the default's source text or None."""

    name: str
    kind: str
    default: Optional[str]


@dataclass
class UpstreamName:
    """A public name of an upstream module as read from its source."""

    name: str
    kind: str  # "function", "class", "value", "reexport"
    params: Optional[List[Param]] = None
    fields: Optional[Dict[str, Optional[str]]] = None  # dataclass fields -> default source
    methods: List[str] = field(default_factory=list)
    source: Optional[str] = None  # for re-exports: "module.name" it comes from


@dataclass
class Row:
    """One line of docs/API.md."""

    name: str
    ours: str
    status: str
    detail: str
    note: str = ""


# ----------------------------------------------------------------------------------------------
# Upstream, read as text


def _module_file(oracle: str, module: str) -> str:
    base = os.path.join(oracle, "megatron", "core", *module.split("."))
    return os.path.join(base, "__init__.py") if os.path.isdir(base) else base + ".py"


def _params_of(fn: ast.FunctionDef, drop_self: bool) -> List[Param]:
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = [Param(p.arg, "pos", ast.unparse(d) if d is not None else None) for p, d in zip(positional, defaults)]
    if drop_self and params and params[0].name in ("self", "cls"):
        params = params[1:]
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append(Param(p.arg, "kw", ast.unparse(d) if d is not None else None))
    for var in (a.vararg, a.kwarg):
        if var is not None:
            params.append(Param(var.arg, "var", None))
    return params


def _is_dataclass(node: ast.ClassDef) -> bool:
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if ast.unparse(target).split(".")[-1] == "dataclass":
            return True
    return False


class UpstreamIndex:
    """Every class of the upstream package by name, to follow dataclass bases across files."""

    def __init__(self, oracle: str) -> None:
        self.classes: Dict[str, ast.ClassDef] = {}
        root = os.path.join(oracle, "megatron", "core")
        for dirpath, _, files in os.walk(root):
            for f in files:
                if f.endswith(".py"):
                    with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
                        tree = ast.parse(fh.read())
                    for node in tree.body:
                        if isinstance(node, ast.ClassDef):
                            self.classes.setdefault(node.name, node)

    def fields(self, node: ast.ClassDef) -> Dict[str, Optional[str]]:
        """Dataclass fields of ``node`` and its dataclass bases, base fields first."""
        out: Dict[str, Optional[str]] = {}
        for base in node.bases:
            base_node = self.classes.get(ast.unparse(base).split(".")[-1])
            if base_node is not None and _is_dataclass(base_node):
                out.update(self.fields(base_node))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if "ClassVar" not in ast.unparse(stmt.annotation):
                    out[stmt.target.id] = ast.unparse(stmt.value) if stmt.value is not None else None
        return out


def _describe_class(node: ast.ClassDef, index: UpstreamIndex) -> UpstreamName:
    methods = [s.name for s in node.body if isinstance(s, ast.FunctionDef) and not s.name.startswith("_")]
    if _is_dataclass(node):
        return UpstreamName(node.name, "class", fields=index.fields(node), methods=methods)
    init = next((s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
    params = _params_of(init, drop_self=True) if init is not None else None
    return UpstreamName(node.name, "class", params=params, methods=methods)


def _wanted(module: str, name: str) -> bool:
    if module in SELECTED:
        return name in SELECTED[module]
    return name not in NOT_API and (not name.startswith("_") or name in PRIVATE_KEPT.get(module, ()))


def upstream_names(oracle: str, module: str, index: UpstreamIndex) -> List[UpstreamName]:
    """Public names defined by one upstream module, in source order.

    A package's own names include what its ``__init__`` re-exports from its submodules
    (``from .x import y``); helpers it imports from elsewhere (``from ..utils import z``) are not API.
    """
    path = _module_file(oracle, module)
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    is_package = path.endswith("__init__.py")
    out: Dict[str, UpstreamName] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = UpstreamName(node.name, "function", params=_params_of(node, drop_self=False))
        elif isinstance(node, ast.ClassDef):
            out[node.name] = _describe_class(node, index)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id != "__all__":
                    out[t.id] = UpstreamName(t.id, "value")
        elif is_package and isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                name = alias.asname or alias.name
                out[name] = UpstreamName(name, "reexport", source=f"{node.module}.{alias.name}")
    return [u for n, u in out.items() if _wanted(module, n)]


# ----------------------------------------------------------------------------------------------
# Ours, imported


def _our_params(obj: Any) -> Optional[List[Tuple[str, str, Any]]]:
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: "pos",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "pos",
        inspect.Parameter.KEYWORD_ONLY: "kw",
        inspect.Parameter.VAR_POSITIONAL: "var",
        inspect.Parameter.VAR_KEYWORD: "var",
    }
    params = [(p.name, kinds[p.kind], p.default) for p in sig.parameters.values()]
    if inspect.isclass(obj) and params and params[0][0] == "self":
        params = params[1:]
    return params


def _literal(src: Optional[str]) -> Tuple[bool, Any]:
    if src is None:
        return False, None
    try:
        return True, ast.literal_eval(src)
    except (ValueError, SyntaxError):
        return False, None


def _default_differs(up_src: Optional[str], ours: Any) -> bool:
    if up_src is None:
        return False
    if ours is inspect.Parameter.empty:
        return True
    ok, value = _literal(up_src)
    return ok and not (type(value) is type(ours) and value == ours) and not (value is None and ours is None)


def compare_params(up: List[Param], ours: List[Tuple[str, str, Any]]) -> Tuple[List[str], bool]:
    """Problems calling ours the upstream way, and whether ours adds optional parameters."""
    problems: List[str] = []
    ours_by_name = {n: (k, d) for n, k, d in ours}
    ours_pos = [n for n, k, _ in ours if k == "pos"]
    for i, p in enumerate(x for x in up if x.kind == "pos"):
        if i >= len(ours_pos) or ours_pos[i] != p.name:
            problems.append(f"positional #{i} is {p.name!r} upstream")
            break
    for p in up:
        if p.kind == "var":
            continue
        if p.name not in ours_by_name:
            problems.append(f"no parameter {p.name!r}")
        elif _default_differs(p.default, ours_by_name[p.name][1]):
            problems.append(f"default of {p.name!r}: upstream {p.default}")
    up_names = {p.name for p in up}
    extra = [(n, d) for n, k, d in ours if n not in up_names and k != "var"]
    for n, d in extra:
        if d is inspect.Parameter.empty:
            problems.append(f"ours requires {n!r}")
    return problems, bool(extra)


def _compare_dataclass(up: UpstreamName, obj: Any) -> Tuple[List[str], bool]:
    if not dataclasses.is_dataclass(obj):
        return compare_params([Param(n, "kw", d) for n, d in up.fields.items()], _our_params(obj) or [])
    ours = {f.name: f for f in dataclasses.fields(obj)}
    missing = [n for n in up.fields if n not in ours]
    wrong = []
    for n, src in up.fields.items():
        if n in ours and ours[n].default is not dataclasses.MISSING and _default_differs(src, ours[n].default):
            wrong.append(n)
    problems = []
    if missing:
        problems.append(f"{len(missing)} fields missing: {', '.join(missing)}")
    if wrong:
        problems.append(f"defaults differ: {', '.join(wrong)}")
    return problems, any(n not in up.fields for n in ours)


def compare(up: UpstreamName, obj: Any) -> Tuple[str, str]:
    """(status, detail) of our object against the upstream description."""
    problems: List[str] = []
    extended = False
    if up.fields is not None:
        problems, extended = _compare_dataclass(up, obj)
    elif up.params is not None and callable(obj):
        ours = _our_params(obj)
        if ours is not None:
            problems, extended = compare_params(up.params, ours)
    missing_methods = [m for m in up.methods if not hasattr(obj, m)]
    if missing_methods:
        problems.append(f"methods missing: {', '.join(missing_methods)}")
    if problems:
        return "differs", "; ".join(problems)
    return ("extended" if extended else "same"), ""


def _resolve_reexport(oracle: str, module: str, up: UpstreamName, index: UpstreamIndex) -> UpstreamName:
    """Describe a package re-export by the definition it points at, when that is a plain module."""
    src_module, _, src_name = (up.source or "").rpartition(".")
    target = ".".join([module, src_module]) if src_module else module
    try:
        for u in upstream_names(oracle, target, index):
            if u.name == src_name:
                return UpstreamName(up.name, u.kind, u.params, u.fields, u.methods, up.source)
    except (OSError, SyntaxError):
        pass
    return up


def rows_for(oracle: str, module: str, index: UpstreamIndex) -> List[Row]:
    """One row per upstream public name of ``module``."""
    try:
        ours_mod = importlib.import_module(f"megatron.core.{module}")
    except ImportError as exc:
        ours_mod = None
        why = f"module missing ({exc})"
    rows = []
    for up in upstream_names(oracle, module, index):
        if up.kind == "reexport":
            up = _resolve_reexport(oracle, module, up, index)
        if ours_mod is None or not hasattr(ours_mod, up.name):
            rows.append(Row(up.name, "—", "not supported yet", why if ours_mod is None else ""))
            continue
        obj = getattr(ours_mod, up.name)
        where = getattr(obj, "__module__", None) if (inspect.isclass(obj) or inspect.isfunction(obj)) else None
        ours = f"`{where}`" if where and where != f"megatron.core.{module}" else "same module"
        status, detail = compare(up, obj)
        rows.append(Row(up.name, ours, status, detail))
    return rows


# ----------------------------------------------------------------------------------------------
# docs/API.md


HEADER = """# Megatron Core API: megatron-core 0.16 names and ours

Code written against megatron-core 0.16's public API imports the same module paths here. This file
lists every public name of the modules below (plus a few private names downstream code uses), with
its status against megatron-core 0.16.1:

- **same**: same name, parameters accepted at the same positions with the same literal defaults;
  for dataclasses every field with its default; for classes every public method;
- **extended**: the same, plus optional parameters or fields of ours;
- **differs**: present, but a parameter, default, field or method differs (the *detail* column says
  which; the *note* says why);
- **not supported yet**: absent (the *note* says why).

The status is about names and signatures. A note on a *same* row says how the behaviour differs
(an exception type, a refused value); behaviour that is the same needs no note.

The *status* and *detail* columns are generated by `tools/api_surface.py` from megatron-core's
source (read as text, never imported) and our imported modules; the *note* column is written by
hand and kept when the file is regenerated. `tests/unit_tests/test_api_doc.py` fails when this file
is stale or a row that is neither same nor extended has no note.

    python tools/api_surface.py --oracle "$MCORE_ORACLE" --write docs/API.md

How to run code written for CUDA and NCCL on CPU, and the behaviour differences that are not about
signatures, are described at the end.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(tables: Dict[str, List[Row]], tail: str) -> str:
    """The whole docs/API.md text."""
    out = [HEADER]
    for module, rows in tables.items():
        counts = {s: sum(r.status == s for r in rows) for s in STATUSES}
        summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        out.append(f"\n## megatron.core.{module}\n\n{summary}\n")
        out.append("| name | ours | status | detail | note |")
        out.append("|---|---|---|---|---|")
        for r in rows:
            out.append(f"| `{r.name}` | {r.ours} | {r.status} | {_cell(r.detail)} | {_cell(r.note)} |")
    out.append("\n" + TAIL_MARK + "\n" + tail.strip() + "\n")
    return "\n".join(out)


TAIL_MARK = "<!-- hand-written below this line -->"


def read_notes(path: str) -> Tuple[Dict[Tuple[str, str], str], str]:
    """Notes per (module, name) and the hand-written tail of an existing docs/API.md."""
    notes: Dict[Tuple[str, str], str] = {}
    if not os.path.exists(path):
        return notes, ""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    head, _, tail = text.partition(TAIL_MARK)
    module = None
    for line in head.splitlines():
        if line.startswith("## megatron.core."):
            module = line[len("## megatron.core.") :].strip()
        elif module and line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").replace("\\|", "\0").split("|")]
            if len(cells) == 5 and cells[4]:
                notes[(module, cells[0].strip("`"))] = cells[4].replace("\0", "|")
    return notes, tail


def _inherited_note(notes: Dict[Tuple[str, str], str], module: str, name: str) -> str:
    """A package row without a note of its own takes the note of the same name in a submodule."""
    for (m, n), text in notes.items():
        if n == name and m.startswith(module + ".") and text:
            return text
    return ""


def build(oracle: str, path: str) -> str:
    """Regenerate docs/API.md's text from the oracle and our modules, keeping notes and the tail."""
    notes, tail = read_notes(path)
    index = UpstreamIndex(oracle)
    tables: Dict[str, List[Row]] = {}
    for module in MODULES:
        rows = rows_for(oracle, module, index)
        tables[module] = rows
    for module, rows in tables.items():
        for r in rows:
            r.note = notes.get((module, r.name), "") or _inherited_note(notes, module, r.name)
    return render(tables, tail)


def unexplained(text: str) -> List[str]:
    """Rows that are neither same nor extended and carry no note."""
    bad = []
    module = None
    for line in text.partition(TAIL_MARK)[0].splitlines():
        if line.startswith("## megatron.core."):
            module = line[len("## megatron.core.") :].strip()
        elif module and line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").replace("\\|", "\0").split("|")]
            if cells[2] in ("differs", "not supported yet") and not cells[4]:
                bad.append(f"{module}.{cells[0].strip('`')}: {cells[2]}")
    return bad


def main(argv: Optional[List[str]] = None) -> int:
    """Write or check docs/API.md; exit 1 when --check finds it stale."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--oracle", default=os.environ.get("MCORE_ORACLE"), help="megatron-core --target folder")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="PATH")
    mode.add_argument("--check", metavar="PATH")
    args = parser.parse_args(argv)
    if not args.oracle or not os.path.isdir(os.path.join(args.oracle, "megatron", "core")):
        parser.error(f"--oracle={args.oracle!r}: not a megatron-core install (pip install --target DIR)")
    sys.path.insert(0, REPO)
    path = args.write or args.check
    text = build(args.oracle, path)
    if args.write:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"wrote {path}; rows without a note: {len(unexplained(text))}")
        return 0
    with open(path, encoding="utf-8") as fh:
        stale = fh.read() != text
    if stale:
        print(f"{path} is stale: run python tools/api_surface.py --oracle DIR --write {path}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
