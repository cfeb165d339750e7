"""The core names its config fields, never command-line flags; the CLI shows the user the flag.

The rule checked: no string literal under ``megatron/core`` (f-string parts included; docstrings,
which may say which Megatron flag feeds a field, excepted) contains ``--`` followed by the name of a
flag of the parser. The translation lives once, in ``validation.flag_message`` (applied by
``preflight.reported_once`` to every error that reaches the user at start-up).
"""

import ast
import pathlib
import re

import pytest

from megatron.training.flags.registry import flag_specs
from megatron.training.preflight import reported_once
from megatron.training.validation import flag_message

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _docstrings(tree: ast.Module) -> set:
    """The string statements of ``tree``: docstrings of modules, classes, functions and dataclass fields."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def flags_named(source: str, names: set) -> list:
    """``(line, flag)`` for every non-docstring string literal of ``source`` that names one of ``names``."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            for flag in re.findall(r"--[a-z][a-z0-9-]*", node.value):
                if flag in names:
                    found.append((node.lineno, flag))
    return found


def _flag_names() -> set:
    return {option for spec in flag_specs() for option in spec.option_strings if option.startswith("--")}


def test_no_core_string_names_a_flag():
    names = _flag_names()
    offenders = {}
    for path in sorted((ROOT / "megatron" / "core").rglob("*.py")):
        found = flags_named(path.read_text(), names)
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, f"core messages naming flags (name the config field instead): {offenders}"


def test_the_rule_sees_a_planted_flag_and_spares_docstrings():
    names = _flag_names()
    planted = 'def f(n):\n    """Experts (--num-experts)."""\n    raise ValueError(f"--num-experts={n} must be > 0")\n'
    assert flags_named(planted, names) == [(3, "--num-experts")]


@pytest.mark.parametrize(
    "core,shown",
    [
        ("TransformerConfig.num_moe_experts=4 must divide by 3", "--num-experts 4 must divide by 3"),
        ("needs TransformerConfig.pipeline_model_parallel_size > 1", "needs --pipeline-model-parallel-size > 1"),
        ("OptimizerParamScheduler.init_lr=0.5 must not exceed", "--lr-warmup-init 0.5 must not exceed"),
        ("tiktoken_pattern=None: TikTokenizer requires one", "--tiktoken-pattern None: TikTokenizer requires one"),
        ("give bf16=True or fp16=True", "give --bf16 or --fp16"),
        ("dist_ckpt_strictness='strict': must be one of", "--dist-ckpt-strictness 'strict': must be one of"),
        ("verify_checkpoint=False loads it anyway", "--no-verify-checkpoint loads it anyway"),
    ],
)
def test_the_cli_translates_fields_to_flags(core, shown):
    assert flag_message(None, core) == shown


def test_a_core_error_at_start_up_shows_the_flag():
    """An error raised by the core under ``reported_once`` (how ``pretrain`` runs) reaches the user with flags,
    keeping its type (and traceback)."""
    with pytest.raises(ValueError, match="--num-experts 4 is not divisible by --expert-model-parallel-size 3"):
        with reported_once():
            raise ValueError("TransformerConfig.num_moe_experts=4 is not divisible by expert_model_parallel_size=3")
    with pytest.raises(ValueError, match=r"--tiktoken-pattern None: TikTokenizer requires one"):
        with reported_once():
            from megatron.core.tokenizers.tiktoken_tokenizer import TikTokenizer

            TikTokenizer(__file__, None)
