"""Mixture of experts: the MoE layer against a token-by-token reference, its aux losses, and
TP / SP / PP parity of a GPT with MoE layers.

The reference below is written independently of the implementation: for each token, an
explicit softmax over all experts, its top k renormalised (Mixtral's rule), and each chosen
expert's MLP computed from its full weights. fp32; rtol=1e-5, atol=1e-6 (only the order of
float additions differs).
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.context_parallel import cp_chunk_positions, get_batch_on_this_cp_rank
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.parallel_state import ParallelLayout, build_process_groups
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.moe import MoEAuxLossAutoScaler, MoELayer, aux_loss_pairs, get_aux_loss_tracker
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter, topk_softmax
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, gather_tp, gpt2_style, llama_style, single_rank_groups, tp_group_of
from tests.unit_tests.pipeline_parallel.pipeline_parity import check_parity
from tests.unit_tests.transformer.test_moe_expert_parallel import global_name

RTOL, ATOL = 1e-5, 1e-6
E, K, H, FFN = 4, 2, 32, 48


def _config(**kw):
    base = dict(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=4,
        ffn_hidden_size=64,
        num_moe_experts=E,
        moe_router_topk=K,
        moe_ffn_hidden_size=FFN,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    base.update(kw)
    return TransformerConfig(**base)


# ----------------------------------------------------------------------------------
# Independent reference.
# ----------------------------------------------------------------------------------
def _expert_ref(x, expert, config):
    """One expert's MLP from its weights: x [h] -> [h]."""
    w1, w2 = expert.linear_fc1.weight, expert.linear_fc2.weight
    b1 = expert.linear_fc1.bias if expert.linear_fc1.bias is not None else 0.0
    b2 = expert.linear_fc2.bias if expert.linear_fc2.bias is not None else 0.0
    a = w1 @ x + b1
    if config.gated_linear_unit:
        gate, up = a[: config.moe_ffn_hidden_size], a[config.moe_ffn_hidden_size :]
        a = config.activation_func(gate) * up
    else:
        a = config.activation_func(a)
    return w2 @ a + b2


def _routing_ref(logits_t, config):
    """(chosen experts, their weights) of one token from its logits [E]."""
    probs = torch.exp(logits_t - logits_t.max())
    probs = probs / probs.sum()
    chosen = sorted(range(E), key=lambda e: -float(probs[e]))[: config.moe_router_topk]
    if config.moe_router_pre_softmax:
        weights = [probs[e] for e in chosen]
    else:
        total = sum(probs[e] for e in chosen)
        weights = [probs[e] / total for e in chosen]
    factor = config.moe_router_topk_scaling_factor or 1.0
    return chosen, [w * factor for w in weights]


def _moe_ref(layer, x):
    """MoE output [s, b, h] of ``layer``'s weights, token by token."""
    config, flat = layer.config, x.reshape(-1, x.shape[-1])
    rows = []
    for t in range(flat.shape[0]):
        chosen, weights = _routing_ref(layer.router.weight @ flat[t], config)
        rows.append(
            sum(w * _expert_ref(flat[t], layer.experts.local_experts[e], config) for e, w in zip(chosen, weights))
        )
    return torch.stack(rows).view_as(x)


def _aux_ref(layer, x, coeff):
    """coeff * E / (k T^2) * sum_e (sum_t softmax_t[e]) * (times e is among token t's top k)."""
    flat = x.reshape(-1, x.shape[-1])
    logits = flat @ layer.router.weight.t()  # [T, E]
    probs = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
    probs = probs / probs.sum(dim=1, keepdim=True)
    counts = torch.zeros(E)
    for t in range(flat.shape[0]):
        for e in _routing_ref(logits[t].detach(), layer.config)[0]:
            counts[e] += 1
    T = flat.shape[0]
    return coeff * E / (K * T * T) * (probs.sum(0) * counts).sum(), logits


def _z_ref(logits, coeff):
    m = logits.max(dim=1, keepdim=True).values
    lse = m.squeeze(1) + torch.log(torch.exp(logits - m).sum(dim=1))
    return coeff * (lse**2).mean()


# ----------------------------------------------------------------------------------
# The layer on one rank.
# ----------------------------------------------------------------------------------
def _grads(module, x, out_grad):
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = module(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(out_grad)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def _layer_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    MoEAuxLossAutoScaler.set_loss_scale(1.0)
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(8, 2, H, generator=g), torch.randn(8, 2, H, generator=g)
    variants = {
        "swiglu": {},
        "gelu_bias_pre_softmax": dict(
            gated_linear_unit=False,
            activation_func=F.gelu,
            add_bias_linear=True,
            moe_router_pre_softmax=True,
            moe_router_topk_scaling_factor=2.5,
        ),
    }
    for name, kw in variants.items():
        torch.manual_seed(1)
        layer = MoELayer(_config(**kw), pg_collection=groups)
        if layer.config.add_bias_linear:  # non-zero biases, so their use is checked
            with torch.no_grad():
                for p in layer.parameters():
                    if p.dim() == 1:
                        p.normal_()
        out, dx, grads = _grads(layer, x, dy)
        layer.zero_grad(set_to_none=True)
        xr = x.detach().requires_grad_(True)
        ref_out = _moe_ref(layer, xr)
        ref_out.backward(dy)
        ref_out, ref_dx = ref_out.detach(), xr.grad
        ref_grads = {n: p.grad for n, p in layer.named_parameters()}
        torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} output: {m}")
        torch.testing.assert_close(dx, ref_dx, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} input grad: {m}")
        for pname, grad in grads.items():
            torch.testing.assert_close(
                grad, ref_grads[pname], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} grad {pname}: {m}"
            )
    _custom_router_check(groups, x)
    return (out - ref_out).abs().max().item()


class RoundRobinRouter(TopKRouter):
    """A routing rule plugged through the spec: token t goes to expert t mod E alone, with weight 1."""

    def forward(self, tokens, batch_size=1):
        experts = torch.arange(tokens.shape[0]) % self.config.num_moe_experts  # [T]
        routing_map = F.one_hot(experts, self.config.num_moe_experts).bool()  # [T, E]
        return routing_map.to(tokens.dtype), routing_map


def _custom_router_check(groups, x):
    """``MoESubmodules.router`` is the router the layer builds and calls (as a class and as a spec)."""
    for router in (RoundRobinRouter, ModuleSpec(module=RoundRobinRouter)):
        layer = MoELayer(_config(), MoESubmodules(router=router), pg_collection=groups)
        assert type(layer.router) is RoundRobinRouter
        flat = x.reshape(-1, H)
        ref = [_expert_ref(flat[t], layer.experts.local_experts[t % E], layer.config) for t in range(flat.shape[0])]
        torch.testing.assert_close(layer(x)[0], torch.stack(ref).view_as(x), rtol=RTOL, atol=ATOL)
    assert type(MoELayer(_config(), pg_collection=groups).router) is TopKRouter  # the default


def test_moe_layer_equals_token_loop_reference():
    """The default TopKRouter against the token loop; a custom router from the spec against its own rule."""
    assert run_distributed(_layer_body, 1)[0] <= 1e-5


def _aux_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(6, 2, H, generator=g), torch.randn(6, 2, H, generator=g)
    coeff, z_coeff, scale = 1e-2, 1e-3, 0.25
    MoEAuxLossAutoScaler.set_loss_scale(scale)
    torch.manual_seed(2)
    plain = MoELayer(_config(), pg_collection=groups)
    plain.set_layer_number(2)
    torch.manual_seed(2)
    aux = MoELayer(_config(moe_aux_loss_coeff=coeff, moe_z_loss_coeff=z_coeff), pg_collection=groups)
    aux.set_layer_number(2)
    tracker = get_aux_loss_tracker()
    tracker.clear()
    out_plain, dx_plain, g_plain = _grads(plain, x, dy)
    assert not tracker.values, "coefficient 0 and no z-loss track nothing"
    out_aux, dx_aux, g_aux = _grads(aux, x, dy)
    assert torch.equal(out_plain, out_aux), "the aux losses must not change the output"
    # Independent values (the tracker holds loss / coeff, per global layer).
    xr = x.detach().requires_grad_(True)
    aux_ref, logits = _aux_ref(aux, xr, coeff)
    z_ref = _z_ref(logits, z_coeff)
    torch.testing.assert_close(tracker.values["load_balancing_loss"][1] * coeff, aux_ref.detach(), rtol=RTOL, atol=0)
    torch.testing.assert_close(tracker.values["z_loss"][1] * z_coeff, z_ref.detach(), rtol=RTOL, atol=0)
    assert tracker.values["load_balancing_loss"][0] == 0
    # Gradients: those of the output plus scale x those of the two aux losses.
    aux.zero_grad(set_to_none=True)
    (scale * (aux_ref + z_ref)).backward()
    router_extra = aux.router.weight.grad
    assert router_extra.abs().max() > 0
    torch.testing.assert_close(g_aux["router.weight"], g_plain["router.weight"] + router_extra, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(dx_aux, dx_plain + xr.grad, rtol=RTOL, atol=ATOL)
    for name in g_plain:
        if name != "router.weight":
            torch.testing.assert_close(g_aux[name], g_plain[name], rtol=0, atol=0)
    # Logging: mean over the MoE layers (both layers are MoE: the sum / 2), per microbatch.
    total, count = aux_loss_pairs(aux.config, groups, num_microbatches=1)["load_balancing_loss"].tolist()
    assert count == 2 and abs(total / count - aux_ref.item() / coeff / 2) < 1e-6 * aux_ref.item() / coeff
    assert not tracker.values
    # Evaluation (no grad) tracks and attaches nothing.
    aux.eval()
    with torch.no_grad():
        aux(x)
    assert not tracker.values


def test_aux_and_z_loss_values_and_gradients():
    run_distributed(_aux_body, 1)


def test_topk_softmax_variants_sum_and_select():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, -2.0, 1.0]])
    probs, rmap = topk_softmax(logits, 2, pre_softmax=False, scaling_factor=None)
    assert rmap.tolist() == [[True, True, False, False], [False, True, False, True]]
    torch.testing.assert_close(probs.sum(1), torch.ones(2))
    full = torch.softmax(logits, dim=-1)
    pre, _ = topk_softmax(logits, 2, pre_softmax=True, scaling_factor=3.0)
    torch.testing.assert_close(pre[0, :2], 3.0 * full[0, :2])
    assert pre[0, 2:].abs().sum() == 0


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(moe_router_topk=5), "moe_router_topk=5 must be <= num_moe_experts=4"),
        (dict(moe_router_load_balancing_type="balanced"), "moe_router_load_balancing_type='balanced'"),
        (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type='flex'"),
        (dict(moe_layer_freq=[1, 0, 1]), "moe_layer_freq=[1, 0, 1]"),
        (dict(moe_aux_loss_coeff=-1.0), "moe_aux_loss_coeff=-1.0"),
        (dict(expert_model_parallel_size=3), "num_moe_experts=4 must be divisible by expert_model_parallel_size=3"),
        (dict(expert_tensor_parallel_size=0), "expert_tensor_parallel_size=0"),
        (
            dict(expert_tensor_parallel_size=5),
            "moe_ffn_hidden_size=48 must be divisible by expert_tensor_parallel_size=5",
        ),
        (dict(moe_ffn_hidden_size=0), "moe_ffn_hidden_size=0"),
    ],
)
def test_config_refuses_bad_moe_settings(kw, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _config(**kw)


def test_moe_layer_freq_pattern_and_specs():
    assert [_config(num_layers=5, moe_layer_freq=2).is_moe_layer(n) for n in range(1, 6)] == [1, 0, 1, 0, 1]
    cfg = _config(num_layers=3, moe_layer_freq=[0, 1, 1])
    specs = get_gpt_decoder_block_spec(cfg).layer_specs
    assert [s.submodules.mlp.module is MoELayer for s in specs] == [False, True, True]
    assert not dataclasses.replace(cfg, num_moe_experts=None).is_moe_layer(1)


# ----------------------------------------------------------------------------------
# GPT with MoE: tensor / sequence parallelism and pipeline parallelism.
# ----------------------------------------------------------------------------------
MOE = dict(num_moe_experts=E, moe_router_topk=K, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)


def _loss_and_grads(model, tokens, labels, tp_group):
    loss = model(tokens, None, None, labels=labels)  # [b, s]
    loss.mean().backward()
    allreduce_sequence_parallel_grads([model], tp_group)
    grads = {n: gather_tp(p.grad, p, tp_group) for n, p in model.named_parameters()}
    return loss.detach(), grads


# TP=2 + SP on 2 ranks (DP=1, so the balance loss too equals one rank's): (EP, expert-TP, dispatcher).
TP_SP_LAYOUTS = [(1, 2, "allgather"), (1, 2, "alltoall"), (2, 1, "alltoall"), (2, 1, "allgather"), (1, 1, "alltoall")]


class _MoEForwardGathers:
    """Inside every MoE layer's forward: the router's input shapes, and the floating-point all-gathers and
    reduce-scatters (``tensor_parallel.mappings``) issued over the ranks of ``ranks``."""

    def __init__(self, model, ranks):
        self.model, self.ranks, self.router_inputs, self.gathers, self.inside = model, ranks, [], [], False

    def _wrap(self, name, original):
        def recorded(out, x, group=None, **kw):
            if self.inside and x.is_floating_point() and dist.get_process_group_ranks(group) == self.ranks:
                self.gathers.append((name, tuple(x.shape)))
            return original(out, x, group=group, **kw)

        return recorded

    def __enter__(self):
        self.saved = (mappings.all_gather_into_tensor, mappings.reduce_scatter_tensor)
        mappings.all_gather_into_tensor = self._wrap("all_gather", self.saved[0])
        mappings.reduce_scatter_tensor = self._wrap("reduce_scatter", self.saved[1])
        self.hooks = []
        for module in self.model.modules():
            if isinstance(module, MoELayer):
                self.hooks.append(module.register_forward_pre_hook(lambda *_: setattr(self, "inside", True)))
                self.hooks.append(module.register_forward_hook(lambda *_: setattr(self, "inside", False)))
                self.hooks.append(
                    module.router.register_forward_pre_hook(lambda m, args: self.router_inputs.append(args[0].shape))
                )
        return self

    def __exit__(self, *exc):
        mappings.all_gather_into_tensor, mappings.reduce_scatter_tensor = self.saved
        for hook in self.hooks:
            hook.remove()


def _logged(config, groups):
    """This step's logged aux losses (sums over MoE layers and TP x CP shares), clearing the tracker."""
    return {k: v[0] for k, v in aux_loss_pairs(config, groups, num_microbatches=1).items()}


def _check_against(where, loss, grads, logged, ref):
    """Loss, every gradient (by global name; EP: this rank's experts) and logged aux losses against one rank."""
    ref_loss, ref_grads, ref_logged = ref
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} loss: {m}")
    assert set(logged) == set(ref_logged) == {"load_balancing_loss", "z_loss"}, (where, logged)
    for name, value in logged.items():
        torch.testing.assert_close(value, ref_logged[name], rtol=RTOL, atol=0, msg=lambda m: f"{where} {name}: {m}")
    dense = {n for n in ref_grads if "local_experts" not in n}
    assert dense <= set(grads) <= set(ref_grads) and any("local_experts" in n for n in grads), where  # EP: half
    worst = 0.0
    for pname, grad in grads.items():
        ref_grad = ref_grads[pname]
        worst = max(worst, (grad - ref_grad).abs().max().item())
        torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} grad {pname}: {m}")
    return worst


def _cp_case(kw, ref, tokens, labels):
    """CP=2: each rank routes its chunk; the balance loss's counts summed over CP and its gradient scaled
    by the CP size (as Megatron's forward_step) give one rank's loss and gradients (DDP averages over CP)."""
    groups = build_process_groups(ParallelLayout(world_size=2, context_parallel_size=2))
    local = get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels}, groups.cp)
    model = build_gpt(kw, groups)
    loss, grads = _one_step_ddp(model, groups, local["tokens"], local["labels"])
    positions = cp_chunk_positions(tokens.shape[1], 2, groups.rank_in("cp"))
    return _check_against("cp=2", loss, grads, _logged(model.config, groups), (ref[0][:, positions], *ref[1:]))


def _tp_sp_case(kw, ep, etp, ref, tokens, labels):
    """One TP=2 + SP layout against one rank; the router sees this rank's ``s/tp * b`` tokens and, with
    expert-TP 1 and all-to-all, the layer all-gathers nothing over the TP ranks (no full sequence)."""
    groups = build_process_groups(
        ParallelLayout(world_size=2, tensor_model_parallel_size=2, expert_model_parallel_size=ep,
                       expert_tensor_parallel_size=etp)
    )  # fmt: skip
    model = build_gpt(dict(kw, sequence_parallel=True), groups)
    with _MoEForwardGathers(model, groups.ranks["tp"]) as seen:
        loss, grads = _one_step_ddp(model, groups, tokens, labels)
    moe_layers = sum(isinstance(m, MoELayer) for m in model.modules())
    b, s = tokens.shape
    assert seen.router_inputs == [torch.Size([s // 2 * b, model.config.hidden_size])] * moe_layers, seen.router_inputs
    if etp == 1 and kw.get("moe_token_dispatcher_type") == "alltoall":
        assert seen.gathers == [], seen.gathers
    where = f"tp=2 sp ep={ep} etp={etp} {kw.get('moe_token_dispatcher_type')}"
    return _check_against(where, loss, grads, _logged(model.config, groups), ref)


def _one_step_ddp(model, groups, tokens, labels):
    """Loss and full gradients by global expert name after DDP's reduction (DP=1; expert-DP may be 2)."""
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model, pg_collection=groups)
    loss = ddp(tokens, None, None, labels=labels)  # [b, s]
    loss.mean().backward()
    finalize_model_grads([ddp], None, groups)
    grads = {
        global_name(n, groups): gather_tp(p.main_grad, p, tp_group_of(p, groups)) for n, p in model.named_parameters()
    }
    return loss.detach(), grads


def _tp_body(rank, world_size):
    """TP=2 + SP and CP=2 equal one rank (aux and z losses on: loss, every gradient, the logged aux losses);
    TP=2 without SP is refused in training and equals one rank in evaluation (every TP rank routes all
    tokens, as Megatron)."""
    ref_groups = single_rank_groups()
    MoEAuxLossAutoScaler.set_loss_scale(1.0)
    get_aux_loss_tracker().clear()
    tokens, labels = batch()
    styles = {"llama": llama_style(moe_layer_freq=[1, 0], **MOE), "gpt2_bias": gpt2_style(ffn_hidden_size=64, **MOE)}
    worst = 0.0
    for name, kw in styles.items():
        ref_model = build_gpt(kw, ref_groups)
        ref = (*_loss_and_grads(ref_model, tokens, labels, ref_groups.tp), _logged(ref_model.config, ref_groups))
        layouts = TP_SP_LAYOUTS if name == "llama" else TP_SP_LAYOUTS[:1]
        for ep, etp, dispatcher in layouts:
            case = dict(kw, moe_token_dispatcher_type=dispatcher)
            worst = max(worst, _tp_sp_case(case, ep, etp, ref, tokens, labels))
        if name == "llama":
            worst = max(worst, _cp_case(kw, ref, tokens, labels))
        tp_groups = build_process_groups(ParallelLayout(world_size=2, tensor_model_parallel_size=2))
        no_sp = build_gpt(kw, tp_groups)
        with pytest.raises(ValueError, match="tensor_model_parallel_size=2 needs sequence_parallel=True"):
            no_sp(tokens, None, None, labels=labels)
        no_sp.eval()
        with torch.no_grad():
            ref_eval = build_gpt(kw, ref_groups).eval()(tokens, None, None, labels=labels)
            torch.testing.assert_close(no_sp(tokens, None, None, labels=labels), ref_eval, rtol=RTOL, atol=ATOL)
    return worst


def test_gpt_moe_tp2_sp_ep_etp_layouts_equal_single_rank():
    """Also: the router's input is this rank's ``[s/tp * b, h]`` (no gather of the sequence first)."""
    assert run_distributed(_tp_body, 2)[0] < 1e-5


def _pp_body(rank, world_size):
    groups = build_process_groups(ParallelLayout(world_size=world_size, pipeline_model_parallel_size=2))
    kwargs = llama_style(num_layers=4, moe_layer_freq=[1, 1, 0, 1], **MOE)
    check_parity(kwargs, groups, vp=1, num_mb=3, what="moe llama pp=2", iterations=2)


def test_gpt_moe_pp2_with_aux_loss_equals_single_rank():
    run_distributed(_pp_body, 2)


def test_moe_flops_count_topk_experts_per_token():
    from megatron.training.training_log import FlopsConfig, num_floating_point_operations

    dense = FlopsConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=256,
        seq_length=32,
        padded_vocab_size=512,
        swiglu=True,
    )
    one_expert = dataclasses.replace(dense, num_moe_layers=4, moe_ffn_hidden_size=256, moe_router_topk=1)
    assert num_floating_point_operations(one_expert, 8) == num_floating_point_operations(dense, 8)
    two_moe = dataclasses.replace(dense, num_moe_layers=2, moe_ffn_hidden_size=128, moe_router_topk=4)
    extra_per_token = 2 * 4 * 64 * (4 * 128 - 256) * 1.5  # two layers: 4h * (k*f_moe - f) * 3/2
    assert num_floating_point_operations(two_moe, 8) - num_floating_point_operations(dense, 8) == pytest.approx(
        3 * 8 * 32 * extra_per_token
    )


def _recompute_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    MoEAuxLossAutoScaler.set_loss_scale(1.0)
    tokens, labels = batch()
    tracker, results = get_aux_loss_tracker(), []
    for extra in ({}, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)):
        tracker.clear()
        model = build_gpt(llama_style(**MOE, **extra), groups)
        model(tokens, None, None, labels=labels).mean().backward()
        results.append(({n: p.grad for n, p in model.named_parameters()}, dict(tracker.values)))
    (grads, tracked), (re_grads, re_tracked) = results
    for name, grad in grads.items():
        torch.testing.assert_close(re_grads[name], grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"grad {name}: {m}")
    for name, values in tracked.items():  # recorded once per layer, not again by the recomputation
        torch.testing.assert_close(re_tracked[name], values, rtol=RTOL, atol=0)


def test_full_recompute_keeps_aux_gradients_and_tracks_once():
    run_distributed(_recompute_body, 1)
