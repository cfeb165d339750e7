"""``HybridDeviceOptimizer`` against plain torch optimizers (host parameters; this machine has no accelerator,
so the host plays it: the offloaded fraction is updated through separate host copies).

The reference runs ``torch.optim.AdamW`` itself, on fp32 master copies where the parameters are bf16.
"""

from __future__ import annotations

import copy

import torch

from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g).to(dtype)) for _ in range(3)]


def _grads(step, params):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _groups(params, lr=0.1):
    return [{"params": params[:2], "lr": lr, "weight_decay": 0.1}, {"params": params[2:], "lr": lr / 2}]


def test_host_parameters_step_like_the_cpu_optimizer_and_follow_lr_changes():
    ours_p, ref_p = _params(), _params()
    ours = HybridDeviceOptimizer(
        _groups(ours_p), cpu_optimizer_cls=torch.optim.AdamW, gpu_optimizer_cls=torch.optim.AdamW
    )
    ref = torch.optim.AdamW(_groups(ref_p))
    # offload_fraction=0.5 of 36 elements: the first two 12-element parameters get host copies.
    assert ours.offloaded_params == ours_p[:2] and len(ours.cpu_optimizers) == 1
    host = [p for g in ours.cpu_optimizers[0].param_groups for p in g["params"]]
    assert all(c.data_ptr() != p.data_ptr() for c, p in zip(host, ours_p[:2]))  # copies, not the parameters
    assert [p for g in ours.gpu_optimizer.param_groups for p in g["params"]] == ours_p[2:]  # in place
    for step in range(3):
        if step == 2:  # a scheduler writes the outer groups; the inner optimizer must see it
            for opt in (ours, ref):
                opt.param_groups[0]["lr"] = 0.01
        for params, opt in ((ours_p, ours), (ref_p, ref)):
            _grads(step, params)
            opt.step()
            opt.zero_grad()
    for a, b in zip(ours_p, ref_p):
        assert torch.equal(a, b)
    assert set(ours.state) == set(ours_p) and torch.equal(
        ours.state[ours_p[0]]["exp_avg"], ref.state[ref_p[0]]["exp_avg"]
    )


def _bf16_reference(params, steps):
    """AdamW on fp32 masters fed the bf16 gradients; the bf16 parameters are the rounded masters."""
    masters = [p.detach().float().requires_grad_() for p in params]
    opt = torch.optim.AdamW(_groups(masters))
    for step in range(steps):
        _grads(step, params)
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
        opt.step()
    return [m.detach().to(torch.bfloat16) for m in masters], masters


def test_bf16_parameters_update_through_fp32_masters_and_reload():
    ours_p = _params(torch.bfloat16)
    ours = HybridDeviceOptimizer(
        _groups(ours_p), offload_fraction=1.0, cpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True
    )
    for step in range(2):
        _grads(step, ours_p)
        ours.step()
    expected, masters = _bf16_reference(_params(torch.bfloat16), 2)
    for p, want, master in zip(ours_p, expected, masters):
        assert p.dtype == torch.bfloat16 and torch.equal(p, want)
        assert torch.equal(ours.state[p]["master_param"], master.detach())  # fp32, not the rounded value
    saved = copy.deepcopy(ours.state_dict())
    # A fresh optimizer over parameters restored from the (bf16) model checkpoint continues exactly.
    restored = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    again = HybridDeviceOptimizer(
        _groups(restored), offload_fraction=1.0, cpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True
    )
    again.load_state_dict(saved)
    assert again.state[restored[0]]["exp_avg"].dtype == torch.float32  # state kept in fp32
    for params, opt in ((ours_p, ours), (restored, again)):
        _grads(7, params)
        opt.step()
    for a, b in zip(ours_p, restored):
        assert torch.equal(a, b)


def test_dummy_step_creates_state_and_leaves_the_parameters():
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = HybridDeviceOptimizer(_groups(params), offload_fraction=1.0, cpu_optimizer_cls=torch.optim.AdamW)
    opt.dummy_step()
    assert all(torch.equal(p, b) and p.grad is None for p, b in zip(params, before))
    assert set(opt.state) == set(params) and "exp_avg" in opt.state[params[0]]


def test_per_parameter_cpu_optimizers():
    params = _params()
    built = HybridDeviceOptimizer.build_cpu_optimizer_list(torch.optim.SGD, _groups(params))
    assert [opt.param_groups[0]["params"][0] is p for opt, p in zip(built, params)] == [True] * 3
    assert [opt.param_groups[0]["lr"] for opt in built] == [0.1, 0.1, 0.05]
