"""Capacity dropping and grouped GEMM under EP=2 and TP=2 with SP equal one rank.

Capacity is Megatron's: computed and applied on the tokens each rank routes on its own. So the
one-rank reference (a TP=1, EP=1 ``SequentialMLP`` layer, dropless or not as the case) runs on each
rank's own tokens separately: under EP=2 each rank's batch half (EP ranks are data-parallel
ranks); under TP=2 + SP each rank's sequence shard (TP without SP is refused in training).
Outputs and input gradients equal the reference's on the same piece; weight gradients equal the
reference's summed over the pieces (EP: the router's summed over ranks, each expert's on its
owner; TP: shards gathered). The balance and z losses are on except under SP, where each rank's
are its share of the sequence's (test_moe.py checks them against one rank). A distributed
checkpoint saved by the grouped EP=2 layer loads into the sequential one-rank layer and back.
fp32; rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.serialization import load, save
from megatron.core.dist_checkpointing.state_dict import sharded_state_dict
from megatron.core.parallel_state import ParallelLayout, build_process_groups
from megatron.core.transformer.moe import MoEAuxLossAutoScaler, MoELayer
from tests.dist_harness import run_distributed
from tests.model_utils import gather_tp, single_rank_groups
from tests.unit_tests.transformer.test_moe import _config
from tests.unit_tests.transformer.test_moe_expert_parallel import global_name

RTOL, ATOL = 1e-5, 1e-6
CAP = dict(moe_expert_capacity_factor=1.0)
PAD = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
LAYOUTS = [  # (name, tp, ep, sp, layer kwargs)
    ("ep2 probs", 1, 2, False, CAP),
    ("ep2 grouped", 1, 2, False, dict(moe_grouped_gemm=True)),
    ("ep2 grouped position pad", 1, 2, False, dict(PAD, moe_grouped_gemm=True, moe_token_drop_policy="position")),
    ("tp2 sp grouped probs", 2, 1, True, dict(CAP, moe_grouped_gemm=True)),
    ("tp2 sp position", 2, 1, True, dict(CAP, moe_token_drop_policy="position")),
    ("tp2 sp grouped probs pad", 2, 1, True, dict(PAD, moe_grouped_gemm=True)),
]
LOSSES = dict(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)


def _layer(kw, groups, seed=1):
    torch.manual_seed(seed)
    layout = dict(tensor_model_parallel_size=groups.size_of("tp"), expert_model_parallel_size=groups.size_of("ep"))
    return MoELayer(_config(**kw, **layout), pg_collection=groups)


def _pieces(x, tp, ep, sp):
    """Each rank's own tokens ``[s', b', h]``, indexed by rank (the reference runs each alone)."""
    if ep > 1:
        return [x[:, r : r + 1] for r in range(ep)]  # batch halves
    if sp:
        return list(x.chunk(tp, dim=0))  # sequence shards
    return [x]


def _reference(ref, xs, dys):
    """Per piece (output, input grad); parameter grads summed over the pieces."""
    ref.zero_grad(set_to_none=True)
    outs = []
    for x, dy in zip(xs, dys):
        x = x.detach().requires_grad_(True)
        out, _ = ref(x)
        out.backward(dy)
        outs.append((out.detach(), x.grad))
    return outs, {n: p.grad for n, p in ref.named_parameters()}


def _parallel_grads(layer, groups):
    """Full gradients by global name: router's summed over EP (data-parallel) ranks, TP shards gathered."""
    grads = {}
    for name, p in layer.named_parameters():
        grad = gather_tp(p.grad, p, groups.tp)
        if "local_experts" not in name and groups.size_of("ep") > 1:
            grad = grad.clone()
            dist.all_reduce(grad, group=groups.ep)
        grads[global_name(name, groups)] = grad
    return grads


def _check_layout(name, tp, ep, sp, kw, x, dy):
    groups = build_process_groups(
        ParallelLayout(world_size=dist.get_world_size(), tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    )
    kw = dict(kw, **({} if sp else LOSSES))
    layer = _layer(dict(kw, sequence_parallel=sp), groups)
    ref = _layer({k: v for k, v in kw.items() if k != "moe_grouped_gemm"}, single_rank_groups())
    xs, dys = _pieces(x, tp, ep, sp), _pieces(dy, tp, ep, sp)
    ref_outs, ref_grads = _reference(ref, xs, dys)
    mine = dist.get_rank() if len(xs) > 1 else 0
    x_mine = xs[mine].detach().requires_grad_(True)
    out, _ = layer(x_mine)
    out.backward(dys[mine])
    torch.testing.assert_close(out, ref_outs[mine][0], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} output: {m}")
    torch.testing.assert_close(x_mine.grad, ref_outs[mine][1], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} dx: {m}")
    if "moe_expert_capacity_factor" in kw:  # the case drops pairs: dropless gives another output
        dropless = {k: v for k, v in kw.items() if not k.startswith(("moe_expert_cap", "moe_pad", "moe_grouped"))}
        assert not torch.allclose(_layer(dropless, single_rank_groups())(xs[mine])[0], out), name
    grads = _parallel_grads(layer, groups)
    for pname, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[pname], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} {pname}: {m}")
    return groups, layer, ref, (out - ref_outs[mine][0]).abs().max().item()


def _check_checkpoint(ckpt_dir, groups, grouped, sequential):
    """Grouped EP=2 -> sequential one-rank -> grouped EP=2, through the distributed checkpoint."""
    ref_groups = single_rank_groups()
    save(sharded_state_dict(grouped, pg_collection=groups), f"{ckpt_dir}/grouped")
    fresh = _layer({}, ref_groups, seed=7)
    load(sharded_state_dict(fresh, pg_collection=ref_groups), f"{ckpt_dir}/grouped")
    for key, value in sequential.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    save(sharded_state_dict(fresh, pg_collection=ref_groups), f"{ckpt_dir}/sequential")
    back = _layer(dict(moe_grouped_gemm=True), groups, seed=7)
    load(sharded_state_dict(back, pg_collection=groups), f"{ckpt_dir}/sequential")
    for key, value in grouped.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


def _body(rank, world_size, ckpt_dir):
    MoEAuxLossAutoScaler.set_loss_scale(1.0)
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(8, 2, 32, generator=g), torch.randn(8, 2, 32, generator=g)
    worst = 0.0
    for name, tp, ep, sp, kw in LAYOUTS:
        groups, layer, ref, err = _check_layout(name, tp, ep, sp, kw, x, dy)
        worst = max(worst, err)
        if name == "ep2 grouped":
            _check_checkpoint(ckpt_dir, groups, layer, ref)
    return worst


def test_capacity_and_grouped_gemm_under_ep2_and_tp2_equal_one_rank(tmp_path):
    assert max(run_distributed(_body, 2, str(tmp_path))) <= 1e-5
