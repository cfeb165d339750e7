"""Out-of-range flag values stop the run with one line naming the flag, the value and the rule.

Table-driven over every flag whose record has ``bounds`` (``megatron/training/flags/``): values
just outside each bound (and nan/inf for float flags) are refused by ``validate_args`` before
anything else reads them, values on or inside the bounds (and every default) pass. One
subprocess run of ``pretrain_gpt.py`` shows what the user sees: exit 1, one line, no traceback.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from typing import List, Tuple

import pytest

from megatron.training import arguments as A
from megatron.training import validation
from megatron.training.flags.record import Bounds
from megatron.training.flags.registry import bounded_flags, flag_names
from tests.functional_tests.gpt_runs import REPO, free_port, mock_flags, tiny_gpt_flags
from tests.unit_tests.training.test_arguments import BASE

_TYPES = {a.dest: a.type for a in A.build_megatron_parser()._actions}


def _outside(bounds: Bounds, kind: type) -> List[float]:
    """Values just outside each bound; nan and inf for a float flag."""
    step = 1 if kind is int else 0.5
    values = []
    if bounds.low is not None:
        values.append(bounds.low if bounds.low_open else bounds.low - step)
    if bounds.high is not None:
        values.append(bounds.high if bounds.high_open else bounds.high + step)
    if kind is float:
        values += [math.nan, math.inf]
    return [kind(v) if math.isfinite(v) else v for v in values]


def _inside(bounds: Bounds, kind: type) -> List[float]:
    """Values on each closed bound, or just inside an open one."""
    step = 1 if kind is int else 0.5
    values = []
    if bounds.low is not None:
        values.append(bounds.low + (step if bounds.low_open else 0))
    if bounds.high is not None:
        values.append(bounds.high - (step if bounds.high_open else 0))
    return [kind(v) for v in values]


def _cases(pick) -> List[Tuple[str, str, float]]:
    names = flag_names()
    return [(dest, names[dest], v) for dest, b in sorted(bounded_flags().items()) for v in pick(b, _TYPES[dest])]


def test_every_bounded_flag_is_numeric_and_its_default_passes():
    assert len(bounded_flags()) >= 40  # the crashes of issue 29 and the flags like them
    for dest in ("kv_channels", "ffn_hidden_size", "eval_iters", "train_iters", "lr", "clip_grad"):
        assert dest in bounded_flags(), dest
    for dest in bounded_flags():
        assert _TYPES[dest] in (int, float), dest
    validation.check_bounds(A.parse_args(BASE))


@pytest.mark.parametrize("dest, flag, value", _cases(_outside), ids=lambda x: str(x))
def test_value_outside_the_bounds_is_refused_naming_flag_value_and_rule(dest, flag, value):
    bounds = bounded_flags()[dest]
    rule = bounds.rule(value)
    assert ("finite" in rule) == (not math.isfinite(value))
    args = A.parse_args(BASE + [flag, str(value)])
    with pytest.raises(A.ArgumentsError) as err:
        A.validate_args(args, 1)
    assert str(err.value) == f"{flag}={value!r} {rule}"


@pytest.mark.parametrize("dest, flag, value", _cases(_inside), ids=lambda x: str(x))
def test_value_on_or_inside_the_bounds_passes_the_check(dest, flag, value):
    validation.check_bounds(A.parse_args(BASE + [flag, str(value)]))


def test_lr_is_reported_as_itself_not_through_min_lr():
    with pytest.raises(A.ArgumentsError, match=r"^--lr=-1.0 must be >= 0$"):
        A.validate_args(A.parse_args(BASE + ["--lr", "-1"]), 1)
    with pytest.raises(A.ArgumentsError, match=r"--min-lr \(0.01\) must be at most --lr \(0.001\)"):
        A.validate_args(A.parse_args(BASE + ["--min-lr", "0.01"]), 1)


def test_pretrain_gpt_exits_with_one_line_and_no_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *tiny_gpt_flags(3), *mock_flags()]
    proc = subprocess.run(
        cmd + ["--kv-channels", "0"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.strip().splitlines() == ["--kv-channels=0 must be >= 1"]
