"""The gated delta rule without processes: the chunked form and the one-step recurrence against a sequential
recurrence written here (outputs, final state and gradients, fp64). (Models: ``test_qwen3_next_models.py``.)"""

import pytest
import torch

from megatron.core.ssm.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_step


def _recurrence(q, k, v, g, beta, state):
    """One position at a time: S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q / sqrt(dk)."""
    rep = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)  # value head i reads key head i // rep
    outs = []
    for t in range(q.shape[1]):
        state = state * torch.exp(g[:, t])[..., None, None]  # [b, h, dk, dv]
        recalled = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * (v[:, t] - recalled))
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]) / q.shape[-1] ** 0.5)
    return torch.stack(outs, dim=1), state


def _inputs(b=2, length=23, hk=2, hv=4, dk=5, dv=3):
    torch.manual_seed(0)
    f64 = dict(dtype=torch.float64, requires_grad=True)
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, dtype=torch.float64), dim=-1).requires_grad_()  # noqa: E731
    return dict(
        query=unit(b, length, hk, dk),
        key=unit(b, length, hk, dk),
        value=torch.randn(b, length, hv, dv, **f64),
        g=(-2 * torch.rand(b, length, hv, dtype=torch.float64)).requires_grad_(),
        beta=torch.rand(b, length, hv, **f64),
    ), torch.randn(b, hv, dk, dv, **f64)


@pytest.mark.parametrize("chunk", [4, 7, 64])
def test_chunked_rule_matches_sequential_recurrence(chunk):
    inputs, initial = _inputs()
    initial.requires_grad_()
    out, final = chunk_gated_delta_rule(**inputs, chunk_size=chunk, initial_state=initial)
    out_ref, final_ref = _recurrence(*inputs.values(), initial)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=0, atol=1e-10)
    leaves = [*inputs.values(), initial]
    weights = torch.randn_like(out), torch.randn_like(final)
    grads = torch.autograd.grad((out * weights[0]).sum() + (final * weights[1]).sum(), leaves)
    grads_ref = torch.autograd.grad((out_ref * weights[0]).sum() + (final_ref * weights[1]).sum(), leaves)
    for name, got, want in zip([*inputs, "initial_state"], grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9, msg=lambda m: f"grad {name}: {m}")


def test_recurrent_steps_match_sequential_recurrence():
    inputs, state = _inputs(length=6)
    out_ref, final_ref = _recurrence(*inputs.values(), state)
    for t in range(6):
        out, state = recurrent_gated_delta_step(state, *(x[:, t] for x in inputs.values()))
        torch.testing.assert_close(out, out_ref[:, t], rtol=0, atol=1e-12)
    torch.testing.assert_close(state, final_ref, rtol=0, atol=1e-12)
