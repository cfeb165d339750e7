"""A flag's facts live in its record: no module of the application lists flags apart.

The rule checked: in ``megatron/training`` outside ``flags/`` and in the entry points, no literal
list, tuple, set or dict (its keys) holds two or more flag destinations, unless every string in it
is a field of a dataclass defined in the same module (a config naming its own fields in its own
rules). Facts such as "changes the architecture", "taken by --use-checkpoint-args", "required",
"replaced by" or "names data prefixes" are record attributes the code asks the registry for.
"""

import ast
import dataclasses
import pathlib

import pytest

from megatron.training import arguments as A
from megatron.training.checkpoint_args import architecture_mismatches, taken_from_checkpoint
from megatron.training.flags import registry as R
from megatron.training.flags.record import always

ROOT = pathlib.Path(__file__).resolve().parents[3]
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "2"]
BASE += ["--seq-length", "32", "--train-iters", "10", "--lr", "1e-3"]


def _own_fields(tree: ast.Module) -> set:
    """Field names of the dataclasses a module defines (annotated class attributes of decorated classes)."""
    fields = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.decorator_list:
            fields |= {
                s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    return fields


def flag_lists(source: str, dests: set) -> list:
    """``(line, dests)`` of every literal collection in ``source`` that lists two or more of ``dests`` apart."""
    tree = ast.parse(source)
    own = _own_fields(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        strings = [e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        named = [s for s in strings if s in dests]
        if len(named) >= 2 and not set(strings) <= own:
            found.append((node.lineno, named))
    return found


def _application_files():
    training = ROOT / "megatron" / "training"
    files = [p for p in training.rglob("*.py") if (training / "flags") not in p.parents]
    return files + sorted(ROOT.glob("pretrain_*.py"))


def test_no_module_outside_the_records_lists_flags():
    dests = set(R.RECORDS)
    offenders = {}
    for path in _application_files():
        found = flag_lists(path.read_text(), dests)
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, f"flag lists outside megatron/training/flags/ (make them record attributes): {offenders}"


def test_the_rule_sees_a_planted_list_and_spares_a_config_naming_its_fields():
    dests = set(R.RECORDS)
    planted = 'ARCH = ("num_layers", "hidden_size")\nfor d in {"lr": 1, "min_lr": 2}:\n    pass\n'
    assert [named for _, named in flag_lists(planted, dests)] == [["num_layers", "hidden_size"], ["lr", "min_lr"]]
    config = "@dataclass\nclass C:\n    lr: float = 1.0\n    min_lr: float = 0.0\n    def f(self):\n"
    config += '        return ("lr", "min_lr")\n'
    assert flag_lists(config, dests) == []


def _with(monkeypatch, dest, **changes):
    monkeypatch.setitem(R.RECORDS, dest, dataclasses.replace(R.RECORDS[dest], **changes))


def test_architecture_is_the_record_alone(monkeypatch):
    """Marking a flag as architecture in its record makes checkpoints compare it and --use-checkpoint-args take it."""
    saved, run = {"hidden_dropout": 0.1}, {"hidden_dropout": 0.0}
    assert architecture_mismatches(saved, run) == []
    _with(monkeypatch, "hidden_dropout", architecture=always)
    assert architecture_mismatches(saved, run) == [("hidden_dropout", 0.1, 0.0)]
    _with(monkeypatch, "lr", architecture=always)
    assert "lr" in taken_from_checkpoint()


@pytest.mark.parametrize(
    "dest,changes,message",
    [
        ("train_iters", dict(required=True), "--train-iters is required"),
        ("lr", dict(replaced_by="--a-new-flag"), "--lr=0.001 is no longer valid: use --a-new-flag"),
    ],
)
def test_validation_facts_are_the_record_alone(monkeypatch, dest, changes, message):
    """``required`` and ``replaced_by`` act through the record: no list in validation names the flag."""
    argv = [a for a in BASE if a not in ("--train-iters", "10")] + ["--train-samples", "20"]
    A.validate_args(A.parse_args(argv), 1)
    _with(monkeypatch, dest, **changes)
    with pytest.raises(A.ArgumentsError, match=message):
        A.validate_args(A.parse_args(argv), 1)
