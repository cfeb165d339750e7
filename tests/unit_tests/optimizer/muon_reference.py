"""The single-process Muon reference (plain torch on the full matrices) and the TP-sharded toy module that
``test_muon`` and ``test_muon_distributed`` compare the optimizer with.

The reference: the EMA momentum, the quintic Newton–Schulz iteration, the shape scale and decoupled weight
decay on the 2-D weights; torch's AdamW for the output layer and the bias.
"""

import math
from types import SimpleNamespace

import torch

from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

LR, WD, MU = 0.05, 0.1, 0.9
# Megatron's (emerging-optimizers') quintic Newton–Schulz coefficients, one triple per step.
COEFFS = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]
# name -> (full shape, TP partition dim or None for replicated); "qkv" is a fused QKV weight of 2 query groups
# of 2 heads of size 2 ([2 * (4 + 2 + 2), 8]), "out" the output layer (AdamW's, like the bias).
SHAPES = {
    "col": ((12, 8), 0),
    "row": ((6, 12), 1),
    "rep": ((5, 7), None),
    "bias": ((6,), None),
    "qkv": ((16, 8), 0),
    "out": ((10, 8), None),
}
QKV_ROWS = (4, 2, 2)  # q, k, v rows per query group


def seeded(seed, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def seed_of(name, step=None):
    return list(SHAPES).index(name) + (0 if step is None else 100 * (step + 1))


def grad_of(name, step, dp_rank=0):
    """The full gradient DP rank ``dp_rank`` contributes to ``name`` at ``step``."""
    return seeded(seed_of(name, step) + 1000 * dp_rank, SHAPES[name][0])


def ref_orth(g, scale_mode="spectral"):
    """Plain quintic Newton–Schulz of the full matrix g [r, c], times Megatron's shape scale."""
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / x.norm().clamp_min(1e-7)
    for a, b, c in COEFFS:
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    x = x.T if g.shape[0] > g.shape[1] else x
    r, c = g.shape
    scale = {"spectral": math.sqrt(max(r, c)), "unit_rms_norm": math.sqrt(r / c)}[scale_mode]
    return x * scale


def ref_update(name, upd, scale_mode, split_qkv):
    """Orthogonalised ``upd``; the fused QKV weight's Q, K and V rows (of every group) each on their own."""
    if name != "qkv" or not split_qkv:
        return ref_orth(upd, scale_mode)
    groups = upd.view(-1, sum(QKV_ROWS), upd.shape[1])  # [groups, q + k + v, in]
    parts = [ref_orth(p.reshape(-1, upd.shape[1]), scale_mode) for p in groups.split(QKV_ROWS, dim=1)]
    return torch.cat([p.view(groups.shape[0], -1, upd.shape[1]) for p in parts], dim=1).view_as(upd)


def reference(steps, nesterov, scale_mode, blockwise_tp=1, split_qkv=False, dp=1):
    """Full parameters after ``steps`` steps (grads seeded per step, averaged over ``dp`` ranks as data
    parallelism averages them); ``blockwise_tp`` orthogonalises shards."""
    params = {n: seeded(seed_of(n), s) for n, (s, _) in SHAPES.items()}
    adam_names = ("bias", "out")
    for n in adam_names:
        params[n].requires_grad_()
    # Biases (1-D) are not decayed (Megatron's default); the output layer is.
    adam = torch.optim.AdamW(
        [{"params": [params["bias"]], "weight_decay": 0.0}, {"params": [params["out"]]}], lr=LR, weight_decay=WD
    )
    bufs = {n: torch.zeros_like(p) for n, p in params.items() if n not in adam_names}
    for step in range(steps):
        for n, p in params.items():
            p.grad = sum(grad_of(n, step, r) * (1.0 / dp) for r in range(dp))
        with torch.no_grad():
            for n, buf in bufs.items():
                p, dim = params[n], SHAPES[n][1]
                buf.mul_(MU).add_(p.grad, alpha=1 - MU)
                upd = p.grad + MU * (buf - p.grad) if nesterov else buf
                shards = upd.chunk(blockwise_tp, dim) if dim is not None else [upd]
                orth = torch.cat([ref_update(n, u, scale_mode, split_qkv) for u in shards], dim or 0)
                p.mul_(1 - LR * WD).sub_(LR * orth)
        adam.step()
    return {n: p.detach() for n, p in params.items()}


def ref_name(name):
    return {"attn.linear_qkv.weight": "qkv", "output_layer.weight": "out"}.get(name, name)


class Toy(torch.nn.Module):
    """The SHAPES parameters sharded over TP: an attention-like module with a fused QKV weight and the
    ``TransformerConfig`` fields that describe it, and an output layer."""

    def __init__(self, tp_rank, tp):
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.config = SimpleNamespace(
            num_attention_heads=4, num_query_groups=2, kv_channels=2, attention_output_gate=False
        )
        self.attn.linear_qkv = torch.nn.Module()
        self.output_layer = torch.nn.Module()
        owners = {"qkv": (self.attn.linear_qkv, "weight"), "out": (self.output_layer, "weight")}
        for name, (shape, dim) in SHAPES.items():
            full = seeded(seed_of(name), shape)
            param = torch.nn.Parameter(full if dim is None else full.chunk(tp, dim)[tp_rank].clone())
            set_tensor_model_parallel_attributes(param, dim is not None, 0 if dim is None else dim, 1)
            owner, attr = owners.get(name, (self, name))
            owner.register_parameter(attr, param)

    def _local_grads(self, step, tp_rank, tp, dp_rank=0):
        for name, param in self.named_parameters():
            full, dim = grad_of(ref_name(name), step, dp_rank), SHAPES[ref_name(name)][1]
            yield param, full if dim is None else full.chunk(tp, dim)[tp_rank].clone()

    def set_grads(self, step, tp_rank, tp):
        for param, grad in self._local_grads(step, tp_rank, tp):
            param.grad = grad

    def forward(self, step, tp_rank, tp, dp_rank):
        """A loss linear in the parameters whose gradient is ``_grad`` (this rank's TP slice of it)."""
        return sum((param * grad).sum() for param, grad in self._local_grads(step, tp_rank, tp, dp_rank))


def check_against(module, expected, tp_rank, tp, **tol):
    for name, param in module.named_parameters():
        name = ref_name(name)
        dim = SHAPES[name][1]
        want = expected[name] if dim is None else expected[name].chunk(tp, dim)[tp_rank]
        torch.testing.assert_close(param.detach(), want, **tol, msg=f"{name} differs")
