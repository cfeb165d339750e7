"""Router variants against plain-PyTorch references written here, token by token (not our code).

Each variant (score function, pre-softmax, scaling, group-limited routing, expert bias, the
balance-loss types, router dtype, input jitter, forced balancing) is checked twice: its result
equals the reference, and differs from what the router gives with the variant off (so a
router that ignored the setting fails). float64 logits: the routing map is exact, weights and
losses within rtol 1e-6 (softmaxes run in fp32, as Megatron).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.distributed.finalize_model_grads import finish_router_step
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.routing import random_logits_straight_through, route
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.dist_harness import run_distributed

E, H = 8, 16


def _ref_route(logits, k, score="softmax", pre=False, groups=None, group_k=None, scale=None, bias=None):
    """One token at a time: (weights [T, E], chosen mask [T, E]) as Megatron defines the routing."""
    weights, chosen_mask = torch.zeros_like(logits), torch.zeros_like(logits, dtype=torch.bool)
    for t, row in enumerate(logits.tolist()):
        if score == "softmax":
            top = max(row)
            s = [math.exp(x - top) for x in row]
            s = [x / sum(s) for x in s]
        elif score == "sqrtsoftplus":
            s = [math.sqrt(math.log1p(math.exp(x))) for x in row]
        else:
            s = [1.0 / (1.0 + math.exp(-x)) for x in row]
        # What the top-k compares: logits (softmax after top-k), probabilities, or biased sigmoid scores.
        key = row if (score == "softmax" and not pre) else list(s)
        if bias is not None:
            key = [x + b for x, b in zip(key, bias.tolist())]
        allowed = list(range(len(row)))
        if groups:
            size = len(row) // groups
            sums = [sum(sorted(key[g * size : (g + 1) * size], reverse=True)[: k // group_k]) for g in range(groups)]
            best = sorted(range(groups), key=lambda g: -sums[g])[:group_k]
            allowed = [e for e in allowed if e // size in best]
        chosen = sorted(allowed, key=lambda e: -key[e])[:k]
        w = [s[e] for e in chosen]
        if not (score == "softmax" and pre) and k > 1:
            w = [x / sum(w) for x in w]
        for e, x in zip(chosen, w):
            weights[t, e] = x * (scale or 1.0)
            chosen_mask[t, e] = True
    return weights, chosen_mask


VARIANTS = {
    "softmax_topk_then_softmax": dict(),
    "softmax_pre": dict(pre=True),
    "softmax_scaled": dict(pre=True, scale=2.5),
    "sigmoid": dict(score="sigmoid"),
    "sigmoid_scaled": dict(score="sigmoid", scale=2.5),
    "softmax_groups": dict(groups=4, group_k=1),  # both experts from the group with the best top-2 sum
    "softmax_pre_groups": dict(pre=True, groups=4, group_k=1),
    "sigmoid_groups": dict(score="sigmoid", groups=4, group_k=1),
    "sigmoid_bias": dict(score="sigmoid", bias=torch.linspace(-0.3, 0.3, E, dtype=torch.float64)),
    "sigmoid_groups_bias": dict(score="sigmoid", groups=2, group_k=1, bias=torch.linspace(0.3, -0.3, E)),
    "sqrtsoftplus_bias": dict(score="sqrtsoftplus", scale=1.5, bias=torch.linspace(-0.3, 0.3, E, dtype=torch.float64)),
}


def _ours(logits, k, score="softmax", pre=False, groups=None, group_k=None, scale=None, bias=None):
    return route(logits, k, score, pre, groups, group_k, scale, bias)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_routing_matches_token_by_token_reference(name):
    logits = torch.randn(64, E, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 2
    kw = VARIANTS[name]
    probs, routing_map = _ours(logits, 4 if kw.get("groups") == 2 else 2, **kw)
    ref_probs, ref_map = _ref_route(logits, 4 if kw.get("groups") == 2 else 2, **kw)
    assert torch.equal(routing_map, ref_map)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=1e-7)  # softmax runs in fp32
    plain, plain_map = _ours(logits, 4 if kw.get("groups") == 2 else 2)
    assert not torch.equal(probs, plain) or name == "softmax_topk_then_softmax"  # the variant is not ignored


def test_sqrtsoftplus_matches_transformers_deepseek_v4_router():
    """``sqrtsoftplus`` with the expert bias and scaling equals ``transformers``' ``DeepseekV4TopKRouter``
    (its default scoring); sigmoid scores on the same logits do not."""
    import transformers

    config = transformers.DeepseekV4Config(
        hidden_size=H, n_routed_experts=E, num_experts_per_tok=3, num_hidden_layers=1
    )
    assert config.scoring_func == "sqrtsoftplus"
    hf = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4TopKRouter(config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(E, H, generator=generator))
        hf.e_score_correction_bias.copy_(0.3 * torch.randn(E, generator=generator))
    tokens = torch.randn(64, H, generator=generator)  # [T, h]
    with torch.no_grad():
        logits, weights, chosen = hf(tokens)
        expected = torch.zeros_like(logits).scatter(1, chosen, weights)  # [T, E]
        scale, bias = config.routed_scaling_factor, hf.e_score_correction_bias
        probs, routing_map = route(logits, 3, "sqrtsoftplus", scaling_factor=scale, expert_bias=bias)
        sigmoid, _ = route(logits, 3, "sigmoid", scaling_factor=scale, expert_bias=bias)
    assert torch.equal(routing_map, expected != 0)
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-7)
    assert (sigmoid - expected).abs().max() > 1e-2


def _config(**kw):
    base = dict(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=4,
        num_moe_experts=E,
        moe_router_topk=2,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return TransformerConfig(**{**base, **kw})


def _router(groups, tp_dp_cp_group=None, **kw):
    torch.manual_seed(0)
    router = TopKRouter(_config(**kw), groups.tp, tp_dp_cp_group=tp_dp_cp_group)
    router.set_layer_number(1)
    router.aux_loss_tracker = moe_utils.AuxLossTracker()
    return router


def _tracked(router, name):
    return router.aux_loss_tracker.values[name][0].item()


def _switch_ref(scores, chosen, k, num_tokens=None):
    """Switch loss without the coefficient: E / (k T^2) sum_e (sum_t p) * count."""
    t = num_tokens or scores.shape[0]
    return (scores.sum(0) * chosen.sum(0)).sum().item() * scores.shape[1] / (k * t * t)


def _aux_scores(logits, k, score):
    per_expert = {"sigmoid": torch.sigmoid, "sqrtsoftplus": lambda x: F.softplus(x).sqrt()}
    s = torch.softmax(logits.double(), -1) if score == "softmax" else per_expert[score](logits.double())
    s = s / s.sum(-1, keepdim=True)
    top = torch.zeros_like(s, dtype=torch.bool).scatter(1, s.topk(k, -1).indices, True)
    return s, top


def _module_body(rank, world_size):
    """The config fields reach the router: each variant's module output equals the reference."""
    groups = ps.initialize_model_parallel(1, 1)
    tokens = torch.randn(32, H, generator=torch.Generator().manual_seed(1))
    out = {}
    for name, kw in dict(
        sigmoid=dict(moe_router_score_function="sigmoid"),
        groups=dict(moe_router_num_groups=4, moe_router_group_topk=1, moe_router_pre_softmax=True),
        scaled=dict(moe_router_topk_scaling_factor=3.0, moe_router_pre_softmax=True),
    ).items():
        router = _router(groups, **kw).eval()
        logits = tokens @ router.weight.t()
        ref_kw = dict(
            score=kw.get("moe_router_score_function", "softmax"),
            pre=kw.get("moe_router_pre_softmax", False),
            groups=kw.get("moe_router_num_groups"),
            group_k=kw.get("moe_router_group_topk"),
            scale=kw.get("moe_router_topk_scaling_factor"),
        )
        probs, routing_map = router(tokens)
        ref_probs, ref_map = _ref_route(logits.double(), 2, **ref_kw)
        out[name] = bool(torch.equal(routing_map, ref_map)) and torch.allclose(probs.double(), ref_probs, atol=1e-6)
    return out


def test_router_module_uses_the_config():
    for name, ok in run_distributed(_module_body, 1)[0].items():
        assert ok, name


def _loss_body(rank, world_size):
    """aux_loss, seq_aux_loss (per sequence) and global_aux_loss (counts over DP=2, averaged over
    microbatches) equal references computed from every rank's tokens; the loss reaches the weight's grad."""
    groups = ps.initialize_model_parallel(1, 1)
    s, b, k = 6, 3, 2

    def tokens_of(r, mb):
        return torch.randn(s * b, H, generator=torch.Generator().manual_seed(10 * r + mb))

    out = {}
    for score in ("softmax", "sigmoid", "sqrtsoftplus"):
        for kind in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
            kw = dict(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=0.1, moe_router_score_function=score)
            router = _router(groups, tp_dp_cp_group=groups.tp_dp_cp, **kw).train()
            name = moe_utils.BALANCE_LOSS_NAMES[kind]
            counts = torch.zeros(E, dtype=torch.float64)
            refs = []
            for mb in range(2):
                probs, _ = router(tokens_of(rank, mb), batch_size=b)
                probs.sum().backward()
                with torch.no_grad():
                    scores, top = _aux_scores(tokens_of(rank, mb) @ router.weight.t(), k, score)
                    if kind == "aux_loss":
                        refs.append(_switch_ref(scores, top, k))
                    elif kind == "seq_aux_loss":  # [s, b] order: sequence j is rows j, j+b, ...
                        refs.append(sum(_switch_ref(scores[j::b], top[j::b], k) for j in range(b)) / b)
                    else:
                        for r in range(world_size):
                            counts += _aux_scores(tokens_of(r, mb) @ router.weight.t(), k, score)[1].sum(0)
                        mean = counts / (mb + 1)
                        t = s * b * world_size
                        refs.append((scores.sum(0) * mean).sum().item() * E / (k * t * t))
            out[f"{score}_{kind}"] = (_tracked(router, name), sum(refs))
            out[f"{score}_{kind}_grad"] = router.weight.grad.abs().sum().item()
    return out


def test_balance_losses_match_reference():
    for result in run_distributed(_loss_body, 2):
        for name, value in result.items():
            if name.endswith("_grad"):
                assert value > 0, name
            else:
                ours, ref = value
                assert math.isclose(ours, ref, rel_tol=1e-6), f"{name}: {ours} vs reference {ref}"


def _bias_body(rank, world_size):
    """The expert bias steers the choice (weights stay unbiased) and is updated from the token counts
    of both data-parallel ranks, identically on each; it is a checkpointed buffer."""
    groups = ps.initialize_model_parallel(1, 1)
    kw = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01)
    router = _router(groups, tp_dp_cp_group=groups.tp_dp_cp, **kw).train()
    tokens = [torch.randn(24, H, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    router(tokens[rank])[0].sum().backward()
    finish_router_step([router], groups)
    with torch.no_grad():
        counts = sum(
            _ref_route((t @ router.weight.t()).double(), 2, score="sigmoid")[1].sum(0).double() for t in tokens
        )
    expected = torch.sign(counts.mean() - counts) * 0.01
    out = {"bias_update": torch.equal(router.expert_bias, expected.float())}
    out["counts_cleared"] = bool((router.local_tokens_per_expert == 0).all())
    out["in_state_dict"] = "expert_bias" in router.state_dict() and "local_tokens_per_expert" not in router.state_dict()
    gathered = [torch.zeros(E) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, router.expert_bias)
    out["same_on_every_rank"] = all(torch.equal(g, gathered[0]) for g in gathered)
    router.eval()
    with torch.no_grad():
        probs, routing_map = router(tokens[0])
        ref_probs, ref_map = _ref_route((tokens[0] @ router.weight.t()).double(), 2, score="sigmoid", bias=expected)
        _, unbiased_map = _ref_route((tokens[0] @ router.weight.t()).double(), 2, score="sigmoid")
    out["biased_routing"] = torch.equal(routing_map, ref_map) and torch.allclose(probs.double(), ref_probs, atol=1e-6)
    out["bias_changes_routing"] = not torch.equal(ref_map, unbiased_map)
    out["eval_does_not_count"] = bool((router.local_tokens_per_expert == 0).all())
    # A bf16 model (Float16Module's cast) keeps the bias and counts fp32, values exact (Megatron's rule).
    router.expert_bias.add_(1e-3 * torch.arange(E))  # not representable in bf16 next to 0.01
    before = router.expert_bias.clone()
    router.bfloat16()
    out["fp32_under_bf16"] = router.weight.dtype == torch.bfloat16 and torch.equal(router.expert_bias, before)
    out["counts_fp32_under_bf16"] = router.local_tokens_per_expert.dtype == torch.float32
    return out


def test_expert_bias():
    for result in run_distributed(_bias_body, 2):
        for name, ok in result.items():
            assert ok, name


def _numerics_body(rank, world_size):
    """moe_router_dtype fp32 with bf16 weights, input jitter, z-loss, forced balancing."""
    groups = ps.initialize_model_parallel(1, 1)
    tokens = torch.randn(64, H, generator=torch.Generator().manual_seed(5))
    out = {}
    for dtype in (None, "fp32"):
        router = _router(groups, params_dtype=torch.bfloat16, bf16=True, moe_router_dtype=dtype)
        logits = router.gating(tokens.bfloat16())
        exact = F.linear(tokens.bfloat16().float(), router.weight.float())
        out[f"dtype_{dtype}"] = (logits.dtype, (logits.float() - exact).abs().max().item())
    router = _router(groups, moe_input_jitter_eps=0.1).eval()
    ratio = router.jitter(tokens) / tokens
    out["jitter_bounds"] = bool(((ratio >= 0.9 - 1e-6) & (ratio <= 1.1 + 1e-6)).all()) and ratio.std().item() > 0.03
    torch.manual_seed(7)
    jittered_probs, _ = router(tokens)
    torch.manual_seed(7)
    ref_probs, _ = _ref_route((router.jitter(tokens) @ router.weight.t()).double(), 2)
    plain_probs, _ = _ref_route((tokens @ router.weight.t()).double(), 2)
    out["jitter_reference"] = torch.allclose(jittered_probs.double(), ref_probs, atol=1e-6)
    out["jitter_not_ignored"] = not torch.allclose(ref_probs, plain_probs, atol=1e-6)
    router = _router(groups, moe_z_loss_coeff=0.01).train()
    router(tokens)[0].sum().backward()
    z_ref = (torch.logsumexp((tokens @ router.weight.t()).double(), -1) ** 2).mean().item()
    out["z_loss"] = (_tracked(router, moe_utils.Z_LOSS), z_ref)
    logits = (tokens @ router.weight.t()).detach().requires_grad_()
    forced = random_logits_straight_through(logits)
    forced.mul(torch.arange(E, dtype=torch.float32)).sum().backward()
    out["forced_straight_through"] = torch.equal(logits.grad, torch.arange(E).float().expand(64, E))
    router = _router(groups, moe_router_force_load_balancing=True).eval()
    _, forced_map = router(torch.cat([tokens] * 16))
    _, normal_map = _router(groups).eval()(torch.cat([tokens] * 16))
    out["forced_differs"] = not torch.equal(forced_map, normal_map)
    per_expert = forced_map.sum(0).float()
    out["forced_balanced"] = (per_expert.max() / per_expert.mean()).item() < 1.2
    return out


def test_router_numerics():
    out = run_distributed(_numerics_body, 1)[0]
    assert out["dtype_None"][0] == torch.bfloat16 and out["dtype_None"][1] > 1e-4  # bf16 logits are rounded
    assert out["dtype_fp32"][0] == torch.float32 and out["dtype_fp32"][1] < 1e-5
    ours, ref = out.pop("z_loss")
    assert math.isclose(ours, ref, rel_tol=1e-5), (ours, ref)
    for name, ok in out.items():
        if not name.startswith("dtype"):
            assert ok, name


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(moe_router_enable_expert_bias=True), "score_function='softmax': the router's expert bias"),
        (dict(moe_router_num_groups=4), "needs both"),
        (dict(moe_router_num_groups=3, moe_router_group_topk=1), "num_moe_experts=8 must be divisible"),
        (dict(moe_router_num_groups=4, moe_router_group_topk=3), "moe_router_topk=2 must be divisible"),
        (dict(moe_router_score_function="tanh"), "moe_router_score_function"),
        (dict(moe_router_dtype="fp16"), "moe_router_dtype"),
        (dict(moe_input_jitter_eps=1.5), "moe_input_jitter_eps"),
        (
            dict(moe_router_load_balancing_type="sinkhorn", moe_router_topk_scaling_factor=2.0),
            "moe_router_topk_scaling_factor=2.0 does not apply with moe_router_load_balancing_type='sinkhorn'",
        ),
    ],
)
def test_config_refuses(kw, message):
    with pytest.raises(ValueError, match=message):
        _config(**kw)


def _checkpoint_body(rank, world_size, directory):
    """The expert bias is saved and loaded with the model's sharded state, bit for bit."""
    from megatron.core import dist_checkpointing as dc
    from tests.model_utils import build_gpt, llama_style

    groups = ps.initialize_model_parallel(1, 1)
    kw = llama_style(num_moe_experts=4, moe_router_topk=2, moe_router_score_function="sigmoid")
    kw.update(moe_router_enable_expert_bias=True)
    model = build_gpt(kw, groups)
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.mlp.router.expert_bias.copy_(torch.randn(4))
    dc.save(dc.model_sharded_state_dict([model], pg_collection=groups), directory)
    fresh = build_gpt(kw, groups, seed=99)
    dc.load(dc.model_sharded_state_dict([fresh], pg_collection=groups), directory)
    pairs = [
        (a.mlp.router.expert_bias, b.mlp.router.expert_bias) for a, b in zip(model.decoder.layers, fresh.decoder.layers)
    ]
    return all(torch.equal(a, b) for a, b in pairs) and not torch.equal(pairs[0][1], torch.zeros(4))


def test_expert_bias_checkpoint_round_trip(tmp_path):
    assert run_distributed(_checkpoint_body, 1, str(tmp_path / "ckpt"))[0]
