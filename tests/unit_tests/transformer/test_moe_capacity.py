"""Expert capacity (``moe_expert_capacity_factor``): the kept (token, expert) pairs against a
token-by-token reference written here, the MoE layer with dropping against a per-token
reference, padding (same result, every expert's input exactly the capacity), and the order
Megatron applies it in (after routing, before the balance losses; expert-bias counts of the
kept map).

Reference semantics, per expert and per block of tokens one rank routes alone: capacity
``ceil(T_block * k / E * factor)``; ``probs`` keeps the routed tokens with the largest probs
(ties: the earlier token), ``position`` the earliest routed tokens; padding adds unrouted
tokens (earliest first, weight 0) up to ``min(capacity, T_block)``. fp32; rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.transformer.moe import MoEAuxLossAutoScaler, MoELayer, get_aux_loss_tracker
from megatron.core.transformer.moe.routing import drop_to_capacity, route
from megatron.training import arguments as A
from tests.dist_harness import run_distributed
from tests.unit_tests.datasets.masked_oracle import oracle_dir, oracle_script
from tests.unit_tests.training.test_arguments import BASE
from tests.unit_tests.transformer.test_moe import _config, _expert_ref

RTOL, ATOL = 1e-5, 1e-6
E, K = 4, 2


def keep_ref(probs, routing_map, topk, factor, policy, pad, blocks=1):
    """Bool ``[T, E]``: the pairs each expert keeps, expert by expert, token by token."""
    T, num_experts = probs.shape
    size = T // blocks
    capacity = math.ceil(size * topk / num_experts * factor)
    keep = torch.zeros(T, num_experts, dtype=torch.bool)
    for block in range(blocks):
        rows = range(block * size, (block + 1) * size)
        for e in range(num_experts):
            routed = [t for t in rows if routing_map[t, e]]
            if policy == "probs":
                routed.sort(key=lambda t: (-float(probs[t, e]), t))
            kept = routed[:capacity]
            if pad:
                kept += [t for t in rows if not routing_map[t, e]][: max(0, min(capacity, size) - len(kept))]
            for t in kept:
                keep[t, e] = True
    return keep


CASES = [  # (topk, factor, policy, pad, blocks, route kwargs)
    (2, 1.0, "probs", False, 1, {}),
    (2, 0.5, "position", False, 1, {}),
    (2, 0.75, "probs", True, 2, {}),
    (2, 1.0, "position", True, 1, {}),
    (1, 1.0, "probs", False, 1, {}),  # top-1 after softmax: every prob is 1, ties go to the earlier token
    (2, 3.0, "probs", True, 1, {}),  # capacity > T: nothing dropped, padding takes every token
    (4, 0.5, "probs", False, 2, dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.0)),
]


@pytest.mark.parametrize("topk, factor, policy, pad, blocks, kw", CASES)
def test_kept_pairs_are_those_the_policy_names(topk, factor, policy, pad, blocks, kw):
    g = torch.Generator().manual_seed(topk * 10 + blocks)
    experts = 8 if kw else E
    logits = torch.randn(24, experts, generator=g)
    probs, routing_map = route(logits, topk, **kw)
    got_probs, got_map = drop_to_capacity(probs, routing_map, topk, factor, policy, pad, blocks)
    keep = keep_ref(probs, routing_map, topk, factor, policy, pad, blocks)
    assert torch.equal(got_map, keep)
    assert torch.equal(got_probs, probs * keep)
    if not pad and factor < 3.0:
        assert got_map.sum() < routing_map.sum(), "the case should drop something"


def _moe_ref(layer, x, policy, pad, blocks=1):
    """Output ``[s, b, h]`` of ``layer``'s weights: softmax top-k per token, the pairs ``keep_ref`` keeps."""
    config, flat = layer.config, x.reshape(-1, x.shape[-1])
    logits = flat @ layer.router.weight.t()  # [T, E]
    scores = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
    top = scores.topk(config.moe_router_topk, dim=1)
    weights = top.values / top.values.sum(dim=1, keepdim=True)  # [T, k]
    probs = torch.zeros_like(logits).scatter(1, top.indices, weights)
    chosen = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top.indices, True)
    keep = keep_ref(
        probs.detach(), chosen, config.moe_router_topk, config.moe_expert_capacity_factor, policy, pad, blocks
    )
    rows = []
    for t in range(flat.shape[0]):
        out = torch.zeros(flat.shape[-1])
        for e in range(E):
            if keep[t, e] and chosen[t, e]:
                out = out + probs[t, e] * _expert_ref(flat[t], layer.experts.local_experts[e], config)
        rows.append(out)
    return torch.stack(rows).view_as(x)


def _run(layer, x, dy):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out, _ = layer(x)
    out.backward(dy)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _expert_inputs(layer):
    """Record each local expert's input row count on the next forward."""
    rows = []
    for expert in layer.experts.local_experts:
        expert.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[0]))
    return rows


def _one_rank_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    MoEAuxLossAutoScaler.set_loss_scale(1.0)
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(8, 2, 32, generator=g), torch.randn(8, 2, 32, generator=g)
    results = {}
    for policy, pad in (("probs", False), ("position", False), ("probs", True), ("position", True)):
        torch.manual_seed(1)
        layer = MoELayer(
            _config(
                moe_expert_capacity_factor=0.75,
                moe_token_drop_policy=policy,
                **(dict(moe_pad_expert_input_to_capacity=True) if pad else {}),
            ),
            pg_collection=groups,
        )
        rows = _expert_inputs(layer)
        results[policy, pad] = _run(layer, x, dy)
        assert rows == [math.ceil(16 * K / E * 0.75)] * E if pad else sum(rows) < 16 * K, (policy, pad, rows)
        xr = x.detach().requires_grad_(True)
        ref = _moe_ref(layer, xr, policy, pad)
        layer.zero_grad(set_to_none=True)
        ref.backward(dy)
        out, dx, grads = results[policy, pad]
        torch.testing.assert_close(out, ref.detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(dx, xr.grad, rtol=RTOL, atol=ATOL)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, layer.get_parameter(name).grad, rtol=RTOL, atol=ATOL, msg=name)
    for policy in ("probs", "position"):  # padding: the same result
        for a, b in zip(results[policy, False][:2], results[policy, True][:2]):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    _check_order(groups, x)
    return True


def _check_order(groups, x):
    """The balance and z losses see the logits before dropping; expert-bias counts the kept map."""
    tracker = get_aux_loss_tracker()
    values = {}
    for factor in (None, 0.5):
        torch.manual_seed(1)
        layer = MoELayer(
            _config(
                moe_expert_capacity_factor=factor,
                moe_aux_loss_coeff=1e-2,
                moe_z_loss_coeff=1e-3,
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
            ),
            pg_collection=groups,
        )
        layer.set_layer_number(1)
        tracker.clear()
        tokens = x.reshape(-1, x.shape[-1])
        probs, routing_map = layer.router(tokens, batch_size=x.shape[1])
        values[factor] = {name: v.clone() for name, v in tracker.values.items()}
        assert torch.equal(layer.router.local_tokens_per_expert, routing_map.sum(dim=0).float())
        if factor is not None:
            logits = F.linear(tokens, layer.router.weight)
            full_probs, full_map = route(logits, K, "sigmoid", expert_bias=layer.router.expert_bias)
            keep = keep_ref(full_probs.detach(), full_map, K, factor, "probs", False)
            assert torch.equal(routing_map, keep) and routing_map.sum() < full_map.sum()
    tracker.clear()
    assert values[None].keys() == values[0.5].keys() and len(values[None]) == 2
    for name in values[None]:
        torch.testing.assert_close(values[None][name], values[0.5][name], rtol=0, atol=0)


def test_moe_layer_with_capacity_equals_token_reference_and_padding_changes_only_shapes():
    assert run_distributed(_one_rank_body, 1) == [True]


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            dict(moe_pad_expert_input_to_capacity=True),
            "moe_pad_expert_input_to_capacity=True, moe_expert_capacity_factor=None: expert inputs padded",
        ),
        (dict(moe_expert_capacity_factor=0.0), "moe_expert_capacity_factor=0"),
        (dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="random"), "moe_token_drop_policy='random'"),
    ],
)
def test_config_refuses_bad_capacity_settings(kw, message):
    with pytest.raises(ValueError, match=message):
        _config(**kw)


def test_flags_fill_the_config_and_errors_name_the_flags():
    def config_of(extra):
        args = A.parse_args(BASE + ["--num-experts", "4"] + extra, entry_point="gpt")
        return A.core_transformer_config_from_args(A.validate_args(args, 1))

    flags = ["--moe-expert-capacity-factor", "1.5", "--moe-token-drop-policy", "position"]
    cfg = config_of(flags + ["--moe-pad-expert-input-to-capacity", "--moe-grouped-gemm"])
    assert (cfg.moe_expert_capacity_factor, cfg.moe_token_drop_policy) == (1.5, "position")
    assert cfg.moe_pad_expert_input_to_capacity and cfg.moe_grouped_gemm
    with pytest.raises(
        A.ArgumentsError, match="--moe-pad-expert-input-to-capacity=True, --moe-expert-capacity-factor=None: "
    ):
        config_of(["--moe-pad-expert-input-to-capacity"])


def test_negative_capacity_factor_means_dropless_as_megatron():
    assert _config(moe_expert_capacity_factor=-1.0).moe_expert_capacity_factor is None


ORACLE_CASES = [(2, 1.0, "probs", False), (2, 0.5, "probs", False), (2, 0.75, "probs", True), (1, 0.5, "probs", True)]
ORACLE_CASES += [(2, 0.5, "position", False), (2, 1.0, "position", True)]


def test_kept_pairs_match_megatron_core(tmp_path):
    """megatron-core 0.16.1's ``apply_router_token_dropping`` (skips without ``MCORE_ORACLE``): the same
    number of tokens per expert; with ``probs`` the same kept routed pairs and probs (softmax-then-top-k
    of random logits: no ties among routed probs). Megatron picks ``position``'s tokens and the padding
    tokens with ``torch.topk`` among equal values, whose choice is unspecified (on a CPU it keeps
    tokens from the middle or end); we keep the earliest, as its docs say ("tokens at the end of each
    batch will be dropped"), so those are compared by count only."""
    root = oracle_dir()
    g = torch.Generator().manual_seed(11)
    cases = []
    for topk, factor, policy, pad in ORACLE_CASES:
        probs, routing_map = route(torch.randn(32, E, generator=g), topk, pre_softmax=True)
        cases.append(dict(probs=probs, routing_map=routing_map, topk=topk, factor=factor, policy=policy, pad=pad))
    torch.save(cases, tmp_path / "cases.pt")
    script = oracle_script("mcore_token_dropping.py")
    proc = subprocess.run(
        [sys.executable, script, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
        env=dict(os.environ, PYTHONPATH=root),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case, (their_probs, their_map) in zip(cases, torch.load(tmp_path / "out.pt")):
        args = [case[k] for k in ("probs", "routing_map", "topk", "factor", "policy", "pad")]
        probs, new_map = drop_to_capacity(*args)
        routed = case["routing_map"]
        where = {k: case[k] for k in ("topk", "factor", "policy", "pad")}
        assert torch.equal(new_map.sum(dim=0), their_map.sum(dim=0)), where
        if case["policy"] == "probs":
            assert torch.equal(new_map & routed, their_map & routed), where
            assert torch.equal(probs, their_probs), where
