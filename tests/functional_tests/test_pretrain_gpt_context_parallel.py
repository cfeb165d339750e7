"""pretrain_gpt.py with --context-parallel-size 2 prints the CP=1 losses under every --cp-comm-type, running
the chosen scheme; its checkpoint resumes under CP=1.

Mock data, CPU initialization, dropout off, ``--eod-mask-loss`` (so the two CP ranks count
different numbers of tokens). CP=2 on 2 ranks trains the first 3 iterations and saves; CP=1 on
one rank loads that checkpoint and trains 3 more. Every printed ``lm loss`` (and the validation
loss) equals the straight CP=1 run's to the printed 7 digits but for last-digit float noise
(relative 2e-6). The first half runs Megatron's default scheme (``p2p``); ``a2a`` and ``all_gather``
runs train the first iteration too. Each rank counts its collectives (``count_collectives.py``):
the ring posts point-to-point batches and nothing else, Ulysses all-to-alls only, all_gather
all-gathers only. Full tier: ``a2a+p2p`` on CP=4 (``--hierarchical-context-parallel-sizes 2 2``)
prints the CP=1 loss of its first iteration and calls all-to-alls and point-to-point batches only.
"""

import math
import os

import pytest

from tests.functional_tests import count_collectives
from tests.functional_tests.gpt_runs import REPO, assert_ok, mock_flags, run_gpt, tiny_gpt_flags

ITERS = 6
REL_TOL = 2e-6
COUNTING = [count_collectives.__file__, os.path.join(REPO, "pretrain_gpt.py")]
USES = {  # the collectives each scheme's attention calls (no other part of this run calls them)
    "p2p": {"p2p"},
    "a2a": {"all-to-all"},
    "all_gather": {"all-gather"},
    "a2a+p2p": {"all-to-all", "p2p"},
}


def _check_collectives(result, scheme, world_size=2):
    counts = count_collectives.parse(result.output)
    assert sorted(counts) == list(range(world_size)), result.output[-2000:]
    for rank, calls in counts.items():
        used = {name for name, n in calls.items() if n}
        assert used == USES[scheme], f"{scheme} rank {rank}: called {calls}"


def _check_same_losses(result, single, scheme, world_size=2):
    _check_collectives(result, scheme, world_size)
    assert result.losses(), f"{scheme}: no loss printed"
    for i, (x, y) in enumerate(zip(result.losses(), single.losses())):
        assert math.isclose(x, y, rel_tol=REL_TOL), f"{scheme} iteration {i + 1}: CP={world_size} {x} vs CP=1 {y}"


@pytest.mark.full
def test_cp4_a2a_p2p_prints_the_cp1_loss(tmp_path):
    base = tiny_gpt_flags(ITERS) + mock_flags() + ["--eod-mask-loss", "--exit-interval", "1"]
    single = run_gpt(1, base, str(tmp_path))
    nested = ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes"]
    result = run_gpt(4, base + nested + ["2", "2"], str(tmp_path), script=COUNTING)
    assert_ok(single, "CP=1")
    assert_ok(result, "a2a+p2p")
    _check_same_losses(result, single, "a2a+p2p", world_size=4)


def test_cp2_prints_the_cp1_losses_and_resumes_under_cp1(tmp_path):
    base = tiny_gpt_flags(ITERS) + mock_flags() + ["--eod-mask-loss", "--eval-interval", "3"]
    ckpt = str(tmp_path / "ckpt")
    single = run_gpt(1, base, str(tmp_path))
    cp2 = base + ["--context-parallel-size", "2"]
    first = run_gpt(
        2, cp2 + ["--save", ckpt, "--save-interval", "3", "--exit-interval", "3"], str(tmp_path), script=COUNTING
    )
    others = {
        s: run_gpt(2, cp2 + ["--exit-interval", "1", "--cp-comm-type", s], str(tmp_path), script=COUNTING)
        for s in ("a2a", "all_gather")
    }
    resumed = run_gpt(1, base + ["--load", ckpt], str(tmp_path))
    for name, result in (("CP=1", single), ("CP=2 first half", first), ("CP=1 resumed", resumed), *others.items()):
        assert_ok(result, name)
    for scheme, result in (("p2p", first), *others.items()):
        _check_same_losses(result, single, scheme)
    assert [line["iteration"] for line in resumed.lines] == [4, 5, 6]
    expected = single.losses()
    got = first.losses() + resumed.losses()
    assert len(got) == len(expected) == ITERS
    for i, (x, y) in enumerate(zip(got, expected)):
        assert math.isclose(x, y, rel_tol=REL_TOL), f"iteration {i + 1}: CP=2 / resumed {x} vs CP=1 {y}"

    # Evaluation at iteration 3 (forward only, the same CP slicing and loss reduction).
    def validation_at_3(result):
        return next(
            e["lm loss value"] for e in result.evaluations if e["prefix"] == "validation" and e["iteration"] == 3
        )

    assert math.isclose(validation_at_3(first), validation_at_3(single), rel_tol=REL_TOL)
