"""CrossAttention alone: against plain PyTorch attention written here, and under TP=2 (and TP=2 with
sequence parallelism) against the one-process module.

The reference reads the projections' full weights: queries ``x Wq^T + bq``, keys and values from
``ctx Wkv^T + bkv`` with rows laid out per head (``[k_h, v_h]``), ``softmax(q k^T / sqrt(d))`` with
the blocked positions at -inf, then ``Wo`` and its bias. Under TP each rank gets the contiguous
row blocks of the column-parallel weights (whole heads: that is the layout's promise) and the column
block of ``linear_proj``; its output and the gradients of the inputs and of every weight must equal
the one-process module's. fp32; rtol=1e-5, atol=1e-6.
"""

import math

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.cross_attention import CrossAttention
from tests.dist_harness import run_distributed
from tests.model_utils import gather_tp, single_rank_groups

RTOL, ATOL = 1e-5, 1e-6
HEADS, D, H, SQ, SK, B = 4, 8, 32, 6, 10, 3


def _config(tp: int = 1, **overrides) -> TransformerConfig:
    kw = dict(num_layers=1, hidden_size=H, num_attention_heads=HEADS, kv_channels=D, attention_dropout=0.0)
    kw.update(overrides)
    return TransformerConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True, **kw)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, ctx = torch.randn(SQ, B, H, generator=g), torch.randn(SK, B, H, generator=g)  # [sq, b, h], [sk, b, h]
    keys_only = torch.zeros(B, 1, 1, SK, dtype=torch.bool)
    keys_only[1, ..., 7:] = True  # sample 1: its last 3 encoder positions are padding
    keys_only[2, ..., 4:] = True
    full = torch.rand(B, 1, SQ, SK, generator=g) < 0.4  # [b, 1, sq, sk]
    full[..., 0] = False  # every query sees at least one key
    return x, ctx, {"none": None, "keys": keys_only, "full": full}


def _reference(module: CrossAttention, x, ctx, mask):
    """Plain attention from the module's full (TP=1) weights: ``[sq, b, h]``."""
    q = (x @ module.linear_q.weight.T + module.linear_q.bias).view(SQ, B, HEADS, D)
    kv = (ctx @ module.linear_kv.weight.T + module.linear_kv.bias).view(SK, B, HEADS, 2, D)
    k, v = kv[..., 0, :], kv[..., 1, :]  # [sk, b, heads, d]
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(D)
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    out = torch.einsum("bhqk,kbhd->qbhd", torch.softmax(scores, dim=-1), v).reshape(SQ, B, HEADS * D)
    return out @ module.linear_proj.weight.T + module.linear_proj.bias


def _output(module, x, ctx, mask):
    out, bias = module(x, mask, key_value_states=ctx)
    return out + bias


def _reference_body(rank, world_size):
    groups = single_rank_groups()
    x, ctx, masks = _inputs()
    for backend in ("auto", "unfused"):
        torch.manual_seed(0)
        module = CrossAttention(_config(attention_backend=backend), pg_collection=groups)
        for name, mask in masks.items():
            torch.testing.assert_close(
                _output(module, x, ctx, mask), _reference(module, x, ctx, mask), rtol=RTOL, atol=ATOL, msg=name
            )
        # The mask matters: padding keys change the outputs of the padded samples.
        assert not torch.allclose(_output(module, x, ctx, masks["keys"]), _output(module, x, ctx, None), atol=1e-3)
    with pytest.raises(ValueError, match="grouped-query attention"):
        CrossAttention(_config(num_query_groups=2), pg_collection=groups)
    with pytest.raises(ValueError, match="key_value_states"):
        module(x, None)


def _shard(full: CrossAttention, module: CrossAttention, rank: int, tp: int) -> None:
    """Copy this rank's blocks of the full module's weights: column-parallel rows, ``linear_proj`` columns."""
    with torch.no_grad():
        for name in ("linear_q", "linear_kv"):
            for p in ("weight", "bias"):
                source = getattr(getattr(full, name), p)
                getattr(getattr(module, name), p).copy_(torch.chunk(source, tp, dim=0)[rank])
        module.linear_proj.weight.copy_(torch.chunk(full.linear_proj.weight, tp, dim=1)[rank])
        module.linear_proj.bias.copy_(full.linear_proj.bias)


def _run(module, x, ctx, mask, tp_group, weights):
    """Output, input gradients and full weight gradients of ``sum(out * weights)``."""
    x, ctx = x.clone().requires_grad_(True), ctx.clone().requires_grad_(True)
    out = _output(module, x, ctx, mask)
    (out * weights).sum().backward()
    allreduce_sequence_parallel_grads([module], tp_group)
    grads = {n: gather_tp(p.grad, p, tp_group) for n, p in module.named_parameters()}
    return out.detach(), x.grad, ctx.grad, grads


def _tp_body(rank, world_size):
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    x, ctx, masks = _inputs()
    weights = torch.linspace(-1, 1, SQ * B * H).view(SQ, B, H)  # of the loss: different for every output
    torch.manual_seed(0)
    alone = single_rank_groups()
    full = CrossAttention(_config(), pg_collection=alone)
    for sp in (False, True):
        module = CrossAttention(_config(world_size, sequence_parallel=sp), pg_collection=groups)
        _shard(full, module, rank, world_size)
        for name, mask in masks.items():
            where = f"sp={sp} mask={name}"
            ref_out, ref_dx, ref_dctx, ref_grads = _run(full, x, ctx, mask, alone.tp, weights)
            shard = (lambda t: torch.chunk(t, world_size, dim=0)[rank]) if sp else (lambda t: t)
            out, dx, dctx, grads = _run(module, shard(x), shard(ctx), mask, groups.tp, shard(weights))
            for got, want, what in ((out, ref_out, "out"), (dx, ref_dx, "dx"), (dctx, ref_dctx, "dctx")):
                torch.testing.assert_close(got, shard(want), rtol=RTOL, atol=ATOL, msg=f"{where} {what}")
            for n in ref_grads:
                torch.testing.assert_close(grads[n], ref_grads[n], rtol=RTOL, atol=ATOL, msg=f"{where} {n}")
            full.zero_grad(), module.zero_grad()


def test_cross_attention_equals_plain_attention():
    run_distributed(_reference_body, 1)


def test_cross_attention_tensor_and_sequence_parallel_equal_one_process():
    run_distributed(_tp_body, 2)
