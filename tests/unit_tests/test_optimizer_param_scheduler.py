"""LR / WD schedules against formulas written out independently here."""

import math

import pytest
import torch

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

MAX, MIN, INIT, WARM, DECAY = 3e-4, 3e-5, 1e-6, 100, 1000


def _optimizer():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD([{"params": [a]}, {"params": [b], "lr_mult": 0.5, "wd_mult": 0.0}], lr=1.0)


def _scheduler(style, **kw):
    args = dict(
        init_lr=INIT,
        max_lr=MAX,
        min_lr=MIN,
        lr_warmup_steps=WARM,
        lr_decay_steps=DECAY,
        lr_decay_style=style,
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=DECAY,
        wd_incr_style="constant",
    )
    args.update(kw)
    return OptimizerParamScheduler(_optimizer(), **args)


def _reference_lr(style, n, wsd_steps=None, wsd_style=None):
    """Megatron's schedule, written independently: piecewise by phase."""
    if n <= WARM:
        return INIT + (MAX - INIT) * (n / WARM)
    if style == "constant":
        return MAX
    if n > DECAY:
        return MIN
    if style == "inverse-square-root":
        return max(MIN, MAX * (WARM / n) ** 0.5)
    progress = (n - WARM) / (DECAY - WARM)
    if style == "linear":
        frac = 1 - progress
    elif style == "cosine":
        frac = (1 + math.cos(math.pi * progress)) / 2
    else:  # WSD
        start = DECAY - wsd_steps
        if n <= start:
            frac = 1.0
        else:
            r = (n - start) / wsd_steps
            frac = {
                "exponential": 2 * 0.5**r - 1,
                "linear": 1 - r,
                "cosine": (1 + math.cos(math.pi * r)) / 2,
                "minus_sqrt": 1 - r**0.5,
            }[wsd_style]
    return MIN + (MAX - MIN) * frac


STEPS = [0, 1, 50, 100, 101, 300, 550, 799, 800, 900, 999, 1000, 1001, 5000]


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
def test_lr_styles_follow_formula(style):
    sched = _scheduler(style)
    done = 0
    for n in STEPS:
        sched.step(n - done)
        done = n
        want = _reference_lr(style, n)
        groups = sched.optimizer.param_groups
        assert groups[0]["lr"] == pytest.approx(want, rel=1e-12), (style, n)
        assert groups[1]["lr"] == pytest.approx(0.5 * want, rel=1e-12)


@pytest.mark.parametrize("wsd_style", ["exponential", "linear", "cosine", "minus_sqrt"])
def test_wsd_styles_follow_formula(wsd_style):
    sched = _scheduler("WSD", wsd_decay_steps=200, lr_wsd_decay_style=wsd_style)
    for n in STEPS:
        sched.num_steps = 0
        sched.step(n)
        want = _reference_lr("WSD", n, 200, wsd_style)
        assert sched.get_lr(sched.optimizer.param_groups[0]) == pytest.approx(want, rel=1e-12), (wsd_style, n)


def test_param_group_max_and_min_lr_override():
    sched = _scheduler("linear")
    group = {"max_lr": 1.0, "min_lr": 0.0}
    sched.step(WARM)
    assert sched.get_lr(group) == pytest.approx(1.0)
    sched.step((DECAY - WARM) // 2)
    assert sched.get_lr(group) == pytest.approx(0.5)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_increment(style):
    sched = _scheduler("constant", start_wd=0.0, end_wd=0.2, wd_incr_steps=400, wd_incr_style=style)
    for n in (0, 100, 200, 400, 401):
        sched.num_steps = 0
        sched.step(n)
        r = min(n / 400, 1.0)
        frac = r if style == "linear" else 1 - (1 + math.cos(math.pi * r)) / 2
        want = 0.2 * frac if n <= 400 else 0.2
        assert sched.optimizer.param_groups[0]["weight_decay"] == pytest.approx(want, abs=1e-15)
        assert sched.optimizer.param_groups[1]["weight_decay"] == 0.0


def test_state_dict_round_trip_and_mismatch():
    sched = _scheduler("cosine")
    sched.step(321)
    state = sched.state_dict()
    fresh = _scheduler("cosine")
    fresh.load_state_dict(state)
    assert fresh.num_steps == 321
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(_reference_lr("cosine", 321))
    strict = _scheduler("cosine", max_lr=2 * MAX, use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="max_lr"):
        strict.load_state_dict(state)
    mine = _scheduler(
        "cosine", max_lr=2 * MAX, use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True
    )
    mine.load_state_dict(state)
    assert mine.max_lr == 2 * MAX and mine.num_steps == 321


def test_legacy_keys_load():
    old = {
        "start_lr": MAX,
        "min_lr": MIN,
        "warmup_iter": WARM,
        "end_iter": DECAY,
        "decay_style": "linear",
        "num_iters": 10,
    }
    sched = _scheduler("linear")
    sched.load_state_dict(old)
    assert sched.num_steps == 10


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        _scheduler("linear", lr_warmup_steps=DECAY)
    with pytest.raises(ValueError, match="WSD"):
        _scheduler("WSD")
    with pytest.raises(ValueError, match="start_wd == end_wd"):
        _scheduler("linear", start_wd=0.0)
