"""Mamba-2 building blocks without processes: the chunked scan against a sequential recurrence, and the
hybrid layer allocation rules. (Models: ``test_mamba_models.py``.)"""

import pytest
import torch

from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols, allocate_layers
from megatron.core.ssm.ssd import ssd_chunked_scan


def _recurrence(x, dt, A, B, C, state):
    """The selective scan one position at a time: S = exp(dt A) S + dt x B^T, y = S C."""
    heads_per_group = x.shape[2] // B.shape[2]
    ys = []
    for t in range(x.shape[1]):
        Bt, Ct = (m[:, t].repeat_interleave(heads_per_group, dim=1) for m in (B, C))  # [b, h, n]
        decay = torch.exp(dt[:, t] * A)[..., None, None]  # [b, h, 1, 1]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * Bt[:, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ct))
    return torch.stack(ys, dim=1), state


@pytest.mark.parametrize("chunk", [5, 7, 64])
def test_chunked_scan_matches_sequential_recurrence(chunk):
    torch.manual_seed(0)
    b, length, h, p, g, n = 2, 23, 4, 3, 2, 5
    f64 = dict(dtype=torch.float64, requires_grad=True)
    inputs = dict(
        x=torch.randn(b, length, h, p, **f64),
        dt=torch.rand(b, length, h, **f64),
        A=(-3 * torch.rand(h, dtype=torch.float64)).requires_grad_(),
        B=torch.randn(b, length, g, n, **f64),
        C=torch.randn(b, length, g, n, **f64),
    )
    initial = torch.randn(b, h, p, n, **f64)
    y, final = ssd_chunked_scan(**inputs, chunk_size=chunk, initial_state=initial)
    y_ref, final_ref = _recurrence(*inputs.values(), initial)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=0, atol=1e-10)
    leaves = [*inputs.values(), initial]
    weights = torch.randn_like(y), torch.randn_like(final)
    grads = torch.autograd.grad((y * weights[0]).sum() + (final * weights[1]).sum(), leaves)
    grads_ref = torch.autograd.grad((y_ref * weights[0]).sum() + (final_ref * weights[1]).sum(), leaves)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


def test_hybrid_allocation_follows_ratios_and_pattern():
    for layers, attention, mlp in ((8, 0.25, 0.25), (12, 1 / 6, 0.5), (5, 0.2, 0.0), (10, 0.0, 0.3)):
        types = allocate_layers(layers, attention, mlp)
        assert types.count(Symbols.ATTENTION) == round(layers * attention)
        assert types.count(Symbols.MLP) == round(layers * mlp)
        if attention:  # attention is spread out between Mamba runs, never first or last
            assert Symbols.ATTENTION not in (types[0], types[-1])
            positions = [i for i, t in enumerate(types) if t == Symbols.ATTENTION]
            assert all(b - a > 1 for a, b in zip(positions, positions[1:]))
    assert allocate_layers(4, 0.25, 0.25, "M*M-") == list("M*M-")
    for bad, message in (("M*M", "has 3 layers"), ("M*MX", "not among"), ("M**-", "as many layers")):
        with pytest.raises(ValueError, match=message):
            allocate_layers(4, 0.25, 0.25, bad)
