"""Hash routing (DeepSeek-V4 ``hash_moe``): ``HashRouter`` in ``MoELayer`` against transformers.

One spawn of 2 gloo ranks. On each rank, a one-rank ``MoELayer`` with ``MoESubmodules(router=
HashRouter)``, shared experts and the clamped SwiGLU equals ``DeepseekV4SparseMoeBlock`` (a
``hash_moe`` layer) on the same weights, table and token ids at 1e-5 (fp32), with sigmoid and
sqrtsoftplus scores (softmax scores, which transformers' V4 lacks, against the softmax of the chosen logits); the
same weights under the learned ``TopKRouter`` do not (the table decides).
Under EP=2 (alltoall) the layer's output and input gradient equal the one-rank layer's (rtol 1e-5).
The config refuses a non-positive table size, and the router refuses a call without token ids.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

from megatron.core.parallel_state import ParallelLayout, build_process_groups
from megatron.core.transformer.moe import HashRouter, MoELayer, MoESubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.dist_harness import run_distributed
from tests.model_utils import single_rank_groups

E, K, H, FFN, VOCAB, LIMIT, SCALE = 4, 2, 16, 8, 11, 3.0, 1.5
B, S = 2, 5


def _config(score="sigmoid", **kw):
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=FFN, gated_linear_unit=True)
    base.update(activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0)
    base.update(init_method_std=0.5)  # outputs of order 1, so 1e-5 is a real tolerance
    base.update(num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=FFN, moe_router_score_function=score)
    base.update(moe_shared_expert_intermediate_size=FFN, moe_router_topk_scaling_factor=SCALE)
    base.update(
        moe_hash_router_vocab_size=VOCAB, activation_func_clamp_value=LIMIT, moe_router_load_balancing_type="none"
    )
    return TransformerConfig(**dict(base, **kw))


def _layer(config, groups, router=HashRouter, seed=0):
    torch.manual_seed(seed)
    return MoELayer(config, MoESubmodules(router=router), layer_number=1, pg_collection=groups)


def _hf_block(ours, score):
    cfg = transformers.DeepseekV4Config(
        hidden_size=H, moe_intermediate_size=FFN, n_routed_experts=E, num_experts_per_tok=K, vocab_size=VOCAB,
        scoring_func=score, routed_scaling_factor=SCALE, swiglu_limit=LIMIT, hidden_act="silu",
        n_shared_experts=1, num_hidden_layers=1, mlp_layer_types=["hash_moe"],
    )  # fmt: skip
    hf = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4SparseMoeBlock(cfg, 0)
    with torch.no_grad():
        hf.gate.weight.copy_(ours.router.weight)
        hf.gate.tid2eid.copy_(ours.router.tid2eid)
        for e, expert in enumerate(ours.experts.local_experts):
            hf.experts.gate_up_proj[e].copy_(expert.linear_fc1.weight)  # [2F, h]: gate rows, then up
            hf.experts.down_proj[e].copy_(expert.linear_fc2.weight)
        gate, up = ours.shared_experts.linear_fc1.weight.chunk(2)
        hf.shared_experts.gate_proj.weight.copy_(gate)
        hf.shared_experts.up_proj.weight.copy_(up)
        hf.shared_experts.down_proj.weight.copy_(ours.shared_experts.linear_fc2.weight)
    return hf


def _check_softmax_scores(ids, x):
    """softmax: the chosen experts' weights are the softmax of their logits alone (renormalised), times SCALE."""
    router = _layer(_config("softmax"), single_rank_groups()).router
    tokens, flat_ids = x.reshape(-1, H), ids.t().reshape(-1)  # [T, h], [T] in [s, b] order
    with torch.no_grad():
        probs, routing_map = router(tokens, token_ids=flat_ids)
        chosen = router.tid2eid[flat_ids]  # [T, k]
        expected = SCALE * torch.softmax((tokens @ router.weight.t()).gather(1, chosen), dim=-1)
    torch.testing.assert_close(probs.gather(1, chosen), expected, rtol=1e-5, atol=1e-6)
    assert routing_map.sum() == routing_map.gather(1, chosen).sum() == chosen.numel()


def _check_transformers(ids, x):
    for score in ("sigmoid", "sqrtsoftplus"):  # transformers' V4 scores elementwise, no softmax
        ours = _layer(_config(score), single_rank_groups())
        hf = _hf_block(ours, score)
        with torch.no_grad():
            expected = hf(x.transpose(0, 1).contiguous(), ids).transpose(0, 1)  # [s, b, h]
            got, _ = ours(x, token_ids=ids)
            learned = _layer(_config(score), single_rank_groups(), router=type(ours.router).__mro__[1])
            learned.load_state_dict({k: v for k, v in ours.state_dict().items() if "tid2eid" not in k})
            learned_out, _ = learned(x)
        assert expected.abs().mean() > 0.1  # the routed experts' part alone:
        assert (expected - ours.shared_experts(x)[0]).abs().mean() > 0.1
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert (learned_out - expected).abs().max() > 0.1, "the learned top-k router would pass too"


def _check_expert_parallel(ids, x):
    ref = _layer(_config(moe_token_dispatcher_type="alltoall"), single_rank_groups())
    groups = build_process_groups(ParallelLayout(world_size=2, expert_model_parallel_size=2))
    ep = _layer(_config(moe_token_dispatcher_type="alltoall"), groups, seed=1)
    start = groups.rank_in("ep") * (E // 2)
    with torch.no_grad():
        for name, p in ep.named_parameters():
            if ".local_experts." in name:
                head, tail = name.split(".local_experts.")
                i, rest = tail.split(".", 1)
                name = f"{head}.local_experts.{start + int(i)}.{rest}"
            p.copy_(ref.get_parameter(name))
    outs = []
    for layer in (ref, ep):
        xi = x.clone().requires_grad_()
        out, _ = layer(xi, token_ids=ids)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append((out.detach(), xi.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _body(rank, world_size):
    torch.manual_seed(3)  # the same tokens on both ranks
    ids = torch.randint(0, VOCAB, (B, S))
    x = torch.randn(S, B, H)  # [s, b, h]
    _check_transformers(ids, x)
    _check_softmax_scores(ids, x)
    _check_expert_parallel(ids, x)
    with pytest.raises(ValueError, match="token_ids"):
        _layer(_config(), single_rank_groups())(x)
    dist.barrier()


def test_hash_router_matches_deepseek_v4_and_expert_parallel():
    run_distributed(_body, 2)


def test_hash_router_refusals():
    with pytest.raises(ValueError, match="moe_hash_router_vocab_size"):
        _config(moe_hash_router_vocab_size=0)
