"""After start-up the training loop reads configs, never the parsed flags; megatron/core never reads a Namespace.

The checks parse the source (``ast``): a read of ``args`` (or of an ``.args`` attribute) outside the
start-up functions of ``training.py``, or any ``args`` / ``argparse`` in the modules the loop calls for
logging, FLOPs, data and its configs, fails naming the function and line.
"""

import ast
import pathlib

import pytest

from megatron.training import arguments as A

ROOT = pathlib.Path(__file__).resolve().parents[3]
TRAINING = ROOT / "megatron" / "training"
START_UP = {"pretrain", "_build_loop"}  # parse flags, build the tokenizer and RunConfigs, hand args to providers
CONFIG_ONLY_MODULES = ("training_log.py", "flops.py", "data.py", "training_config.py")


def _reads_of_args(node: ast.AST):
    """(line, text) of every use of the name ``args`` or of an ``.args`` attribute under ``node``."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id == "args":
            yield sub.lineno, "args"
        elif isinstance(sub, ast.Attribute) and sub.attr == "args":
            yield sub.lineno, f"{ast.unparse(sub.value)}.args"
        elif isinstance(sub, ast.arg) and sub.arg == "args":
            yield sub.lineno, "parameter args"


def loop_reads_of_args(source: str, start_up=START_UP):
    """``['function:line: text']`` for every read of the flags in ``source`` outside ``start_up`` functions."""
    tree = ast.parse(source)
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in start_up:
            continue
        name = getattr(node, "name", type(node).__name__)
        found += [f"{name}:{line}: {text}" for line, text in _reads_of_args(node)]
    return found


def test_the_loop_reads_no_flags_after_start_up():
    found = loop_reads_of_args((TRAINING / "training.py").read_text())
    assert not found, f"training.py reads the parsed flags after start-up (read RunConfigs instead): {found}"


def test_the_check_finds_a_planted_read():
    planted = "def pretrain(args):\n    return args.seed\n\ndef train(loop):\n    return loop.args.train_iters\n"
    assert loop_reads_of_args(planted) == ["train:5: loop.args"]
    assert loop_reads_of_args("class Loop:\n    args: object\n") == ["Loop:2: args"]


@pytest.mark.parametrize("module", CONFIG_ONLY_MODULES)
def test_logging_flops_and_data_take_configs(module):
    tree = ast.parse((TRAINING / module).read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [n.lineno for n in imports if any(a.name == "argparse" for a in n.names)], f"{module} imports argparse"
    found = [f"{line}: {text}" for line, text in _reads_of_args(tree)]
    assert not found, f"{module} reads the parsed flags: {found}"


def _namespace_uses(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
            yield node.lineno, "import argparse"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "argparse":
            yield node.lineno, "from argparse import"
        elif isinstance(node, (ast.Name, ast.Attribute)) and getattr(node, "id", getattr(node, "attr", "")) in (
            "Namespace",
            "get_args",
        ):
            yield node.lineno, ast.unparse(node)


# The one module of core that may name the class: it puts ``argparse.Namespace`` on torch's weights-only
# load allow-list (upstream does the same, for checkpoints that pickle the run's arguments); it reads none.
NAMESPACE_AS_A_CLASS = {"megatron/core/safe_globals.py"}


def test_core_reads_no_argparse_namespace():
    core = sorted(
        p for p in (ROOT / "megatron" / "core").rglob("*.py") if str(p.relative_to(ROOT)) not in NAMESPACE_AS_A_CLASS
    )
    assert len(core) > 100
    found = [f"{p.relative_to(ROOT)}:{line}: {text}" for p in core for line, text in _namespace_uses(p)]
    assert not found, f"megatron/core takes typed configs, not parsed flags: {found}"


BASE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--micro-batch-size", "2"]
BASE += ["--seq-length", "8", "--lr", "1e-3"]


def _config(extra, world_size=1):
    return A.training_config_from_args(A.validate_args(A.parse_args(BASE + extra), world_size))


def test_training_length_is_derived_not_written_back():
    """--train-samples: the iterations are counted by hand here; validate_args no longer writes them into the flags."""
    assert _config(["--train-iters", "7"]).train_iters == 7
    cfg = _config(["--train-samples", "100", "--global-batch-size", "8"])
    assert (cfg.train_iters, cfg.train_samples) == (13, 100)  # ceil(100 / 8)
    # Ramp-up from 2 by 2 to 6 over 12 samples (micro 2, DP 1): 2 more every 6 samples, then 6, until 30 samples.
    ramp = _config(["--train-samples", "30", "--global-batch-size", "6", "--rampup-batch-size", "2", "2", "12"])
    sizes, consumed = [], 0
    while consumed < 30:
        size = 6 if consumed >= 12 else 2 + 2 * (consumed // (12 // 2))  # 2 steps of 2 over 12 samples
        sizes.append(size)
        consumed += size
    assert ramp.train_iters == len(sizes)
    assert _config(["--skip-train"]).train_iters == 0


def test_eval_interval_default_is_derived():
    args = A.validate_args(A.parse_args(BASE + ["--train-iters", "5"]), 1)
    assert args.eval_interval is None and A.training_config_from_args(args).eval_interval == 1000
