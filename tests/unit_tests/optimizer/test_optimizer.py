"""Single-rank optimizer checks: param groups, Adam/SGD against torch.optim, loss scaling, precision.

Process groups of size 1 are built once in this process (gloo, file store). References are
torch.optim.AdamW / SGD and clip_grad_norm_ on a copy of the same model with the same grads.
"""

import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.optimizer import (
    DynamicGradScaler,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
    get_param_groups,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from tests.model_utils import batch, build_gpt, gpt2_style


@pytest.fixture(scope="module")
def groups():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield ps.build_process_groups(ps.ParallelLayout(world_size=1))
        finally:
            dist.destroy_process_group()


def _no_decay_names(model):
    return {n for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1}


def test_param_groups_no_decay_on_bias_and_norm(groups):
    model = build_gpt(gpt2_style(), groups)
    config = OptimizerConfig(lr=1e-3, min_lr=1e-5, weight_decay=0.1, decoupled_lr=5e-4)
    param_groups = get_param_groups([model], config)
    names = {id(p): n for n, p in model.named_parameters()}
    for group in param_groups:
        for key in ("wd_mult", "lr_mult", "is_decoupled_lr", "max_lr", "min_lr", "is_expert_parallel"):
            assert key in group, key
        group_names = {names[id(p)] for p in group["params"]}
        if group["wd_mult"] == 0.0:
            assert group_names <= _no_decay_names(model)
        else:
            assert not group_names & _no_decay_names(model)
        assert group["max_lr"] == (5e-4 if group["is_decoupled_lr"] else 1e-3)
    decoupled = {names[id(p)] for g in param_groups if g["is_decoupled_lr"] for p in g["params"]}
    assert decoupled == {"embedding.word_embeddings.weight"}  # tied: the output layer reuses it
    all_params = [p for g in param_groups for p in g["params"]]
    assert len(all_params) == len(list(model.parameters())) == len({id(p) for p in all_params})


def test_scheduler_writes_lr_and_weight_decay(groups):
    model = build_gpt(gpt2_style(), groups)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, min_lr=0.0, weight_decay=0.1), [model], pg_collection=groups)
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1e-3,
        min_lr=0.0,
        lr_warmup_steps=10,
        lr_decay_steps=100,
        lr_decay_style="linear",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=100,
        wd_incr_style="constant",
    )
    sched.step(5)
    for group in opt.param_groups:
        assert group["lr"] == pytest.approx(sched.get_lr(group))
        assert group["weight_decay"] == pytest.approx(0.1 * group["wd_mult"])


def _random_grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) * 0.1 for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind,clip", [("adam", 0.0), ("adam", 0.3), ("sgd", 0.0), ("sgd", 0.3)])
def test_step_equals_torch_optimizer(groups, kind, clip):
    model = build_gpt(gpt2_style(), groups)
    ref = build_gpt(gpt2_style(), groups)  # same seed: same weights
    config = OptimizerConfig(optimizer=kind, lr=1e-2, weight_decay=0.1, clip_grad=clip)
    opt = get_megatron_optimizer(config, [model], pg_collection=groups)
    assert isinstance(opt, FP32Optimizer)
    decay = [p for n, p in ref.named_parameters() if n not in _no_decay_names(ref)]
    no_decay = [p for n, p in ref.named_parameters() if n in _no_decay_names(ref)]
    ref_groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    ref_opt = (
        torch.optim.AdamW(ref_groups, lr=1e-2) if kind == "adam" else torch.optim.SGD(ref_groups, lr=1e-2, momentum=0.9)
    )
    for step in range(3):
        grads = _random_grads(model, step)
        for m in (model, ref):
            for n, p in m.named_parameters():
                p.grad = grads[n].clone()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip > 0 else float("inf"))
        ref_opt.step()
        ok, norm, zeros = opt.step()
        assert ok and zeros is None
        assert norm == pytest.approx(float(ref_norm), rel=1e-6)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m: f"{kind} clip={clip} {n}: {m}")


def test_dynamic_scaler_rule():
    scaler = DynamicGradScaler(initial_scale=2.0**10, min_scale=1.0, growth_interval=3, hysteresis=2)
    scale = 2.0**10
    expected = []
    tracker, growth = 2, 0
    # Drive the scaler and an independent model of Megatron's rule with the same events.
    for found_inf in (True, False, True, True, False, False, False, True, True, True):
        scaler.update(found_inf)
        if found_inf:
            growth, tracker = 0, tracker - 1
            if tracker <= 0:
                scale = max(scale / 2, 1.0)
        else:
            growth += 1
            if growth == 3:
                growth, tracker, scale = 0, 2, scale * 2
        expected.append(scale)
        assert float(scaler.scale) == expected[-1]
    assert expected[0] == 2.0**10 and expected[2] == 2.0**9  # halved only at the second overflow


def _tiny_linear(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(dtype)


def test_fp16_inf_skips_exactly_that_step_and_halves_after_hysteresis(groups):
    model = _tiny_linear(torch.float16)
    config = OptimizerConfig(
        lr=1e-2, fp16=True, params_dtype=torch.float16, initial_loss_scale=2.0**8, hysteresis=2, loss_scale_window=1000
    )
    opt = get_megatron_optimizer(config, [model], pg_collection=groups)
    assert isinstance(opt, Float16OptimizerWithFloat16Params)
    x = torch.randn(4, 8).half()
    history = []
    for step in range(6):
        opt.zero_grad()
        scale_before = float(opt.get_loss_scale())
        opt.scale_loss(model(x).float().pow(2).mean()).backward()
        if step in (2, 4):
            next(model.parameters()).grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        ok, norm, _ = opt.step()
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        history.append((ok, changed, scale_before, float(opt.get_loss_scale())))
    for step, (ok, changed, _before, _after) in enumerate(history):
        assert ok == (step not in (2, 4)) and changed == ok, (step, history)
    assert history[2][3] == history[2][2]  # first overflow: hysteresis 2 -> 1, scale kept
    assert history[4][3] == history[4][2] / 2  # second overflow: scale halved
    assert history[5][0]  # training continues


@pytest.mark.parametrize("dtype,flag,tol", [(torch.bfloat16, "bf16", 0.03), (torch.float16, "fp16", 0.01)])
def test_half_precision_follows_fp32_loss_curve(groups, dtype, flag, tol):
    """30 Adam steps on one fixed batch; |loss - fp32 loss| <= tol * fp32 loss at every step
    (bf16 keeps 8 mantissa bits, fp16 11; the fp32 main weights keep errors from accumulating).
    fp16 starts at loss scale 2**12: from the default 2**32 the first ~20 steps would be skipped."""
    curves = {}
    half = {"params_dtype": dtype, flag: True}
    for name, kw in (("fp32", {}), (flag, half)):
        model = build_gpt(gpt2_style(**kw), groups)
        scale = {"initial_loss_scale": 2.0**12} if name == "fp16" else {}
        opt = get_megatron_optimizer(
            OptimizerConfig(lr=3e-3, clip_grad=1.0, **kw, **scale), [model], pg_collection=groups
        )
        tokens, labels = batch(seed=0, b=4)
        losses = []
        for _ in range(30):
            opt.zero_grad()
            loss = model(tokens, None, None, labels=labels).float().mean()
            opt.scale_loss(loss).backward()
            assert opt.step()[0], f"{name}: step skipped"
            losses.append(float(loss.detach()))
        curves[name] = torch.tensor(losses)
    ref = curves["fp32"]
    assert ref[-1] < ref[0] - 0.5  # it learns
    torch.testing.assert_close(curves[flag], ref, rtol=tol, atol=0)


def test_state_dict_by_param_name_round_trip(groups):
    for kw in ({}, {"params_dtype": torch.bfloat16, "bf16": True}):
        model = build_gpt(gpt2_style(**kw), groups)
        config = OptimizerConfig(lr=1e-2, **kw)
        opt = get_megatron_optimizer(config, [model], pg_collection=groups)
        for step in range(2):
            for n, p in model.named_parameters():
                p.grad = _random_grads(model, step)[n].to(p.dtype)
            opt.step()
        state = opt.state_dict_by_param_name([model])
        assert state["step"] == 2 and state["loss_scaler"] is None
        for name, param in model.named_parameters():
            assert state[name]["exp_avg"].shape == param.shape
            assert ("main_param" in state[name]) == (param.dtype != torch.float32)
        clone = build_gpt(gpt2_style(**kw), groups)
        clone.load_state_dict(model.state_dict())
        opt2 = get_megatron_optimizer(config, [clone], pg_collection=groups)
        opt2.load_state_dict_by_param_name([clone], state)
        for m, o in ((model, opt), (clone, opt2)):
            for n, p in m.named_parameters():
                p.grad = _random_grads(m, 7)[n].to(p.dtype)
            o.step()
        for (n, p), q in zip(model.named_parameters(), clone.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda m: f"{kw} {n}: {m}")


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("optimizer", "lamb", "optimizer='lamb'"),
        ("adam_beta2", 1.0, "adam_beta2=1.0"),
        ("hysteresis", 0, "hysteresis=0"),
        ("overlap_param_gather", True, "use_distributed_optimizer"),
    ],
)
def test_config_errors_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(lr=1e-3, **{field: value})
