"""Megatron's command-line flags as data, and the argparse parser built from them.

``megatron_flags.tsv`` (beside this file) lists every flag of Megatron-LM's
GPT/BERT/T5 entry points: group, option strings, destination, default, choices,
nargs and action kind: Megatron's facts, compared with the shared copy by the
CLI-parity tests. Our facts about each flag (value type where the default does
not tell, help, status, config fields) are its record in ``flags/``;
``build_parser`` generates the parser and ``--help`` from the table and those
records. The value converters the records name live here.
"""

from __future__ import annotations

import argparse
import ast
import functools
import os
import shlex
import signal
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from megatron.core.transformer.enums import AttnBackend
from megatron.training.flags.record import Flag, NoOp, NotSupportedYet

FLAGS_TSV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_flags.tsv")


# Defaults the table writes as reprs that are not Python literals.
SPECIAL_DEFAULTS: Dict[str, Any] = {
    "<AttnBackend.auto: 5>": AttnBackend.auto,
    "<Signals.SIGTERM: 15>": signal.SIGTERM,
}


def str_to_bool(text: str) -> bool:
    """'true'/'1'/'yes' -> True, 'false'/'0'/'no' -> False."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "y"):
        return True
    if lowered in ("0", "false", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def attn_backend(text: str) -> AttnBackend:
    """Accept 'flash' as well as 'AttnBackend.flash'."""
    try:
        return AttnBackend[text.split(".")[-1]]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown attention backend {text!r}") from None


def exit_signal(text: str) -> signal.Signals:
    return signal.Signals(int(text))


def int_tuple(text: str) -> Tuple[int, ...]:
    """'4096,0' or '(4096, 0)' -> (4096, 0): Megatron's tuple flags (``--window-size``).

    The number of entries is checked where the value is used (``TransformerConfig``).
    """
    try:
        return tuple(int(p) for p in text.strip().strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 4096,0, got {text!r}") from None


def moe_layer_freq(text: str) -> Any:
    """'2' -> 2 (every 2nd layer is MoE); '[1,0,1]' or '([1]*3+[0])*2' -> a 0/1 list (Megatron's forms)."""
    return _layer_freq(text, "--moe-layer-freq")


def linear_attention_freq(text: str) -> Any:
    """'4' -> 4 (every 4th layer is full attention, the rest GDN); or a 0/1 list as ``moe_layer_freq``."""
    return _layer_freq(text, "--linear-attention-freq")


def _layer_freq(text: str, flag: str) -> Any:
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        pattern = _list_expression(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as err:
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: {err}") from None
    if not isinstance(pattern, list) or any(p not in (0, 1) for p in pattern):
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected an integer or a list of 0/1")
    return pattern


def _list_expression(node: ast.AST) -> Any:
    """Evaluate integer/list literals joined by + and * (nothing else)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_list_expression(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _list_expression(node.left), _list_expression(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("only integers, lists, + and * are allowed")


@dataclass(frozen=True)
class FlagSpec:
    """One row of the flag table."""

    group: str
    option_strings: Tuple[str, ...]
    dest: str
    default: Any
    choices: Optional[Tuple[str, ...]]  # as the table prints them: str() of each choice
    nargs: Optional[str]
    action: str  # store | storetrue | storefalse

    @property
    def name(self) -> str:
        """The flag as users write it (its first option string)."""
        return self.option_strings[0]


def parse_default(text: str) -> Any:
    """The table's default column (a repr) back to a value."""
    if text in SPECIAL_DEFAULTS:
        return SPECIAL_DEFAULTS[text]
    return ast.literal_eval(text)


def load_flag_specs(path: str = FLAGS_TSV) -> List[FlagSpec]:
    """Read the flag table: '#' lines are comments, the first other line is the header."""
    specs = []
    with open(path, encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip() and not line.startswith("#")]
    for group, flags, dest, default, choices, nargs, action in rows[1:]:
        specs.append(
            FlagSpec(
                group=group,
                option_strings=tuple(flags.split()),
                dest=dest,
                default=parse_default(default),
                choices=tuple(ast.literal_eval(choices)) if choices else None,
                nargs=nargs or None,
                action=action,
            )
        )
    return specs


@functools.lru_cache(maxsize=1)
def megatron_flag_specs() -> List[FlagSpec]:
    """The table shipped with this package, read once."""
    return load_flag_specs()


def value_type(spec: FlagSpec, record: Flag) -> Callable[[str], Any]:
    """The type that converts one command-line word of a store flag: the record's, else the default's."""
    if record.type is not None:
        return record.type
    sample = spec.default[0] if isinstance(spec.default, list) and spec.default else spec.default
    if isinstance(sample, bool) or sample is None:
        return str
    return type(sample) if isinstance(sample, (int, float)) else str


def flag_choices(spec: FlagSpec, record: Flag) -> Optional[Tuple[str, ...]]:
    """The choices the parser accepts: the record's (a superset of the table's), else the table's."""
    if record.choices is None:
        return spec.choices
    missing = [c for c in spec.choices or () if c not in record.choices]
    if spec.choices is None or missing:
        raise ValueError(f"{spec.name}: the record's choices {record.choices} must extend the table's {spec.choices}")
    return record.choices


def typed_choices(spec: FlagSpec, record: Flag) -> Optional[List[Any]]:
    """Choices converted to the flag's type, so that argparse compares like with like."""
    choices = flag_choices(spec, record)
    if choices is None:
        return None
    if spec.dest == "attention_backend":
        return list(AttnBackend)
    # Signals compare equal to their numbers, and the table prints the numbers.
    convert = int if spec.dest == "exit_signal" else value_type(spec, record)
    return [convert(c) if convert in (int, float) else c for c in choices]


NO_OP_NOTE = "[accepted; no effect here: {reason}]"
PROJECT_NOTE = "[this project's flag; not in Megatron-LM]"


def help_text(spec: FlagSpec, record: Flag) -> str:
    """Help line: the record's text (or the dest in words), then its status note; argparse adds the default."""
    text = record.help or spec.dest.replace("_", " ").capitalize() + "."
    status = record.status
    if isinstance(status, NoOp):
        text += " " + NO_OP_NOTE.format(reason=status.reason)
    elif isinstance(status, NotSupportedYet):
        text += f" [not supported yet; accepted only: {', '.join(map(repr, status.harmless))}]"
    if record.project is not None:
        text += " " + PROJECT_NOTE
    return text.replace("%", "%%")


def metavar(spec: FlagSpec, record: Flag) -> str:
    """Short value placeholder for --help: the choices as typed, or the kind of value."""
    choices = flag_choices(spec, record)
    if choices:
        return "{" + ",".join(c.split(".")[-1] for c in choices) + "}"
    kind = value_type(spec, record)
    return {int: "N", float: "X", str_to_bool: "BOOL"}.get(kind, "STR")


def add_flag(group: argparse._ArgumentGroup, spec: FlagSpec, record: Flag) -> None:
    """Add one table row to an argparse group with Megatron's option strings, dest and default."""
    kwargs: Dict[str, Any] = {"dest": spec.dest, "default": spec.default, "help": help_text(spec, record)}
    if spec.action == "storetrue":
        kwargs["action"] = "store_true"
    elif spec.action == "storefalse":
        kwargs["action"] = "store_false"
    elif spec.action == "store":
        kwargs["type"] = value_type(spec, record)
        kwargs["choices"] = typed_choices(spec, record)
        if spec.nargs is not None:
            kwargs["nargs"] = int(spec.nargs) if spec.nargs.isdigit() else spec.nargs
        kwargs["metavar"] = metavar(spec, record)
    else:
        raise ValueError(f"{spec.name}: unknown action kind {spec.action!r} in the flag table")
    group.add_argument(*spec.option_strings, **kwargs)


class FlagFileParser(argparse.ArgumentParser):
    """Reads ``@path`` arguments as flag files written like a launch script.

    Each line holds any number of shell-quoted words; ``#`` starts a comment and a
    trailing backslash is ignored, so the flag block of an existing ``torchrun ...``
    script can be pasted as is. Flags after ``@path`` on the command line win.
    """

    def convert_arg_line_to_args(self, arg_line: str) -> List[str]:
        line = arg_line.rstrip()
        if line.endswith("\\"):
            line = line[:-1]
        try:
            return shlex.split(line, comments=True)
        except ValueError as err:
            self.error(f"flags file line {arg_line.strip()!r}: {err}")


def build_parser(
    specs: List[FlagSpec],
    records: Mapping[str, Flag],
    prog: Optional[str] = None,
    description: Optional[str] = None,
) -> argparse.ArgumentParser:
    """An argparse parser with one argument group per Megatron group, in table order.

    Each row's type, help and status note come from its record in ``records`` (by dest).
    """
    parser = FlagFileParser(
        prog=prog,
        description=description,
        allow_abbrev=False,
        usage="%(prog)s [options | @flags-file]  (see the groups below)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        fromfile_prefix_chars="@",
    )
    groups: Dict[str, argparse._ArgumentGroup] = {}
    for spec in specs:
        if spec.group not in groups:
            groups[spec.group] = parser.add_argument_group(spec.group)
        add_flag(groups[spec.group], spec, records[spec.dest])
    return parser
