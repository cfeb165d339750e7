"""FP8 GEMMs inside the parallel linears' autograd function, and FP8 GPT models across TP layouts.

One process:
* ``parallel_linear`` with a tensorwise ``hybrid`` quantizer: output, input, weight and bias
  gradients equal a float64 reference built from the same quantized operands (X, W in e4m3, dY in
  e5m2) within fp32 accumulation error, and differ from the unquantized ``F.linear`` by more than
  that; ``wgrad=False`` gives the weight gradient ``dY^T X`` in high precision; only the FP8
  input (1 byte per element) is saved for backward.
* delayed scaling: the second step quantizes with ``fp8_max / amax`` of the first.
* block recipes: ``blockwise`` and ``mxfp8`` linears equal the fp4 branch's quantizers applied to
  each GEMM's operands along its inner dimension (weights transposed for dgrad, X and dY for
  wgrad); ``nvfp4``'s forward equals ``quantize_nvfp4_operand``'s fprop operands within fp32
  accumulation error and its weight gradient is near the exact product (stochastic rounding,
  Hadamard); a GPT trains a step with each (finite gradients, loss within 5% of bf16, not equal).
* ``first_last_layers_bf16``: the first layer's linears get no quantizer, the last one's do;
  the output layer never does. MoE experts get quantizers (expert-marked state) and train a step.

Two gloo ranks, one group: a Llama-style FP8 GPT (``hybrid``; ``tensorwise`` and ``delayed``, two
steps so the delayed scales are used) under TP=2 and TP=2 + sequence parallelism equals the same
model on one rank: every weight's amax history and scale bit for bit (the shards' amax is
reduced over TP), those of inputs and output gradients within rtol 1e-5 (summed in another
order), the loss within rtol 1e-5 and gradients within rtol 2e-3 / atol 1e-5 (fp32 activations;
only the order of float additions differs, which can move a value across an FP8 rounding
boundary). Without the amax reduction the loss check fails. The delayed state round-trips
through the distributed checkpoint (and ``state_dict``) bitwise, and the resumed next step
equals the uninterrupted one bitwise.
"""

import tempfile

import torch
import torch.nn.functional as F

from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing import model_sharded_state_dict
from megatron.core.quantization.fp8 import cast_to_fp8, quantize_current
from megatron.core.quantization.recipes import LinearQuantizer, QuantRecipe
from megatron.core.tensor_parallel.linear_function import parallel_linear
from megatron.core.transformer.fp8_utils import attach_quantizers
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, gpt2_style, llama_style, loss_and_grads, single_rank_groups

S, B, H, O = 8, 4, 32, 48


def _rand(seed, *shape, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _within_fp32(out, ref, a, b):
    """|out - ref| <= k eps32 |a||b|^T elementwise (fp32 accumulation of the same products)."""
    bound = a.size(1) * torch.finfo(torch.float32).eps * (a.abs() @ b.abs().t()) + 1e-12
    return bool(((out.double() - ref).abs() <= bound).all())


def _run_linear(recipe, x, w, b, g):
    x, w, b = (t.clone().requires_grad_(True) for t in (x, w, b))
    y = parallel_linear(x, w, b, None, "none", False, LinearQuantizer(recipe, None))
    y.backward(g)
    return y.detach(), x.grad, w.grad, b.grad


def test_tensorwise_linear_equals_reference_from_quantized_operands():
    x, w, b, g = _rand(0, S, B, H), _rand(1, O, H, scale=0.2), _rand(2, O), _rand(3, S, B, O, scale=1e-3)
    y, dx, dw, db = _run_linear(QuantRecipe("tensorwise", "hybrid"), x, w, b, g)
    xq = quantize_current(x.reshape(-1, H), "e4m3").dequantize().double()  # [t, h]
    wq = quantize_current(w, "e4m3").dequantize().double()  # [o, h]
    gq = quantize_current(g.reshape(-1, O), "e5m2").dequantize().double()  # [t, o]
    ref_y = xq @ wq.t() + b.double()
    assert _within_fp32(y.reshape(-1, O), ref_y, xq, wq)
    assert _within_fp32(dx.reshape(-1, H), gq @ wq, gq, wq.t())
    assert _within_fp32(dw, gq.t() @ xq, gq.t(), xq.t())
    torch.testing.assert_close(db, g.reshape(-1, O).sum(0))
    plain = F.linear(x, w, b).reshape(-1, O).double()
    assert not _within_fp32(plain, ref_y, xq, wq), "the output was not quantized"
    # --no-fp8-wgrad: the weight gradient is dY^T X from the unquantized tensors.
    _, dx2, dw2, _ = _run_linear(QuantRecipe("tensorwise", "hybrid", wgrad=False), x, w, b, g)
    torch.testing.assert_close(dw2, g.reshape(-1, O).t() @ x.reshape(-1, H), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(dx2, dx, rtol=0, atol=0)


def test_only_the_fp8_input_is_saved_for_backward():
    x, w = _rand(0, S, B, H).requires_grad_(True), _rand(1, O, H).requires_grad_(True)
    saved = []

    def pack(t):
        if t.data_ptr() != w.data_ptr():
            saved.append(t.numel() * t.element_size())
        return t

    quantizer = LinearQuantizer(QuantRecipe("tensorwise", "hybrid"), None)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        parallel_linear(x, w, None, None, "none", False, quantizer)
    activation = [n for n in saved if n > 64]  # scales are 4 bytes, the FP8 weight copy O*H
    assert sorted(activation) == sorted([S * B * H, O * H]), saved  # 1 byte per element


def test_delayed_linear_uses_the_previous_steps_amax():
    recipe = QuantRecipe("delayed", "e4m3", amax_history_len=1)
    quantizer = LinearQuantizer(recipe, None)
    w = _rand(1, O, H, scale=0.2).requires_grad_(True)
    x1, x2 = _rand(10, S, B, H, scale=5.0), _rand(11, S, B, H)
    parallel_linear(x1, w, None, None, "none", False, quantizer).sum().backward()
    y2 = parallel_linear(x2, w, None, None, "none", False, quantizer)
    scale = torch.full((1,), 448.0) / x1.abs().max().reshape(1)  # from step 1's input amax
    xq = cast_to_fp8(x2.reshape(-1, H), scale, "e4m3").dequantize().double()
    wq = cast_to_fp8(w.detach(), torch.full((1,), 448.0) / w.detach().abs().max(), "e4m3").dequantize().double()
    assert _within_fp32(y2.detach().reshape(-1, O), xq @ wq.t(), xq, wq)
    assert torch.equal(quantizer.delayed["input"].scale, torch.full((1,), 448.0) / x2.abs().max().reshape(1))


def _quantized_layers(model):
    return sorted(n for n, m in model.named_modules() if getattr(m, "quantizer", None) is not None)


def _first_last_bf16_body(rank, world_size):
    groups = single_rank_groups()
    kw = gpt2_style(hidden_size=64, bf16=True, fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True)
    model = build_gpt(dict(kw, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=0), groups)
    names = _quantized_layers(model)
    assert names and all(n.startswith("decoder.layers.1.") for n in names), names
    assert not any("output_layer" in n for n in _quantized_layers(build_gpt(gpt2_style(hidden_size=64), groups)))
    assert attach_quantizers(model.decoder.layers[0], model.config, groups, 1) == 0  # layer 1 stays bf16
    # MoE experts (some may get no tokens) run FP8 GEMMs with their own, expert-keyed state.
    moe = build_gpt(llama_style(bf16=True, fp8="hybrid", num_moe_experts=4, moe_ffn_hidden_size=32), groups)
    experts = [n for n in _quantized_layers(moe) if ".experts." in n]
    assert len(experts) == 2 * 4 * 2, experts  # 2 layers x 4 experts x fc1/fc2
    assert all(b.allreduce is False for n, b in moe.named_buffers() if ".experts." in n and ".quantizer." in n)
    tokens, labels = batch(0)
    moe(tokens, None, None, labels=labels).mean().backward()
    finite = all(torch.isfinite(p.grad).all() for p in moe.parameters())
    # --moe-grouped-gemm with FP8: the experts keep their quantized linears (no bf16 grouped GEMM).
    kw = llama_style(bf16=True, fp8="hybrid", num_moe_experts=4, moe_ffn_hidden_size=32, moe_grouped_gemm=True)
    grouped = build_gpt(kw, groups)
    assert all(type(layer.mlp.experts).__name__ == "GroupedMLP" for layer in grouped.decoder.layers)
    real, torch._grouped_mm = torch._grouped_mm, None  # calling it would raise
    try:
        out = grouped(tokens, None, None, labels=labels)
    finally:
        torch._grouped_mm = real
    return finite and torch.isfinite(out).all()


def test_first_last_layers_bf16():
    assert all(run_distributed(_first_last_bf16_body, 1))


# ----------------------------------------------------------------------------------
# Two ranks: TP=2 (+SP) equals one rank; the delayed state in checkpoints.
# ----------------------------------------------------------------------------------
def _fp8_style(recipe, **kw):
    return llama_style(bf16=True, fp8="hybrid", fp8_recipe=recipe, fp8_amax_history_len=4, **kw)


def _two_steps(model, tp_group):
    """Two forward/backward passes (the second uses delayed scales); loss and gathered grads of the second."""
    loss_and_grads(model, tp_group, 0)
    return loss_and_grads(model, tp_group, 1)


def _scaling_state(model):
    return {n: b.clone() for n, b in model.named_buffers() if ".quantizer." in n}


def _compare_layouts(tp_groups, ref_groups, recipe):
    ref = build_gpt(_fp8_style(recipe), ref_groups)
    ref_loss, ref_grads = _two_steps(ref, ref_groups.tp)
    for sp in (False, True):
        model = build_gpt(_fp8_style(recipe, sequence_parallel=sp), tp_groups)
        assert len(_quantized_layers(model)) == 8  # qkv, proj, fc1, fc2 per layer
        loss, grads = _two_steps(model, tp_groups.tp)
        where = f"{recipe} sp={sp}"
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0, msg=lambda m: f"{where} loss: {m}")
        for name, grad in ref_grads.items():
            torch.testing.assert_close(
                grads[name], grad, rtol=2e-3, atol=1e-5, msg=lambda m: f"{where} grad {name}: {m}"
            )
        state, ref_state = _scaling_state(model), _scaling_state(ref)
        assert set(state) == set(ref_state) and (recipe == "tensorwise") == (not state), where
        for name, value in ref_state.items():
            if ".weight." in name:  # identical weights, shard amaxes reduced: bit for bit
                assert torch.equal(state[name], value), f"{where} {name}: {state[name]} != {value}"
            else:  # activations and gradients summed in another order: last bits may differ
                torch.testing.assert_close(state[name], value, rtol=1e-5, atol=0, msg=lambda m: f"{where} {name}: {m}")


def _checkpoint_round_trip(tp_groups, directory):
    model = build_gpt(_fp8_style("delayed"), tp_groups)
    _two_steps(model, tp_groups.tp)
    saved = _scaling_state(model)
    assert saved and any(v.abs().sum() > 0 for n, v in saved.items() if n.endswith("amax_history"))
    dist_checkpointing.save(model_sharded_state_dict([model], pg_collection=tp_groups), directory)
    resumed = build_gpt(_fp8_style("delayed"), tp_groups, seed=99)
    loaded = dist_checkpointing.load(model_sharded_state_dict([resumed], pg_collection=tp_groups), directory)
    assert loaded is not None
    for name, value in saved.items():
        assert torch.equal(_scaling_state(resumed)[name], value), f"torch_dist: {name}"
    plain = build_gpt(_fp8_style("delayed"), tp_groups, seed=98)
    plain.load_state_dict(model.state_dict())  # the torch format's path
    after = [_two_steps(m, tp_groups.tp) for m in (model, resumed, plain)]
    for loss, grads in after[1:]:
        assert torch.equal(loss, after[0][0])
        assert all(torch.equal(grads[n], g) for n, g in after[0][1].items())


def _tp_body(rank, world_size, directory):
    tp_groups = ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    ref_groups = single_rank_groups()
    for recipe in ("tensorwise", "delayed"):
        _compare_layouts(tp_groups, ref_groups, recipe)
    _checkpoint_round_trip(tp_groups, directory)
    return True


def test_fp8_tp_and_sp_equal_one_rank_and_delayed_state_checkpoints():
    with tempfile.TemporaryDirectory() as directory:
        assert all(run_distributed(_tp_body, 2, directory))


def test_config_refuses_inconsistent_fp8_settings():
    import pytest

    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
    with pytest.raises(ValueError, match="fp8='hybrid', bf16=False, fp16=False: FP8 GEMMs with fp32"):
        TransformerConfig(**base, fp8="hybrid")
    with pytest.raises(ValueError, match="fp8_recipe='custom': must be one of"):
        TransformerConfig(**base, bf16=True, fp8="e4m3", fp8_recipe="custom")
    with pytest.raises(
        ValueError, match="first_last_layers_bf16=True, fp8='hybrid', fp8_recipe='delayed': .*Megatron refuses it too"
    ):
        TransformerConfig(**base, bf16=True, fp8="hybrid", first_last_layers_bf16=True)
    with pytest.raises(ValueError, match="num_layers_at_end_in_bf16=3: must be between 0 and"):
        TransformerConfig(
            **base, bf16=True, fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True,
            num_layers_at_end_in_bf16=3,
        )  # fmt: skip


def _block_reference(recipe, x2d, w, g2d):
    """Each GEMM's operands quantized by the fp4 branch's functions along that GEMM's inner dim."""
    from megatron.core.quantization import quantize_blockwise, quantize_mxfp8

    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    if recipe == "blockwise":
        act = lambda t, d: quantize_blockwise(t, d, (1, 128)).dequantize().double()  # noqa: E731
        wt = lambda t: quantize_blockwise(t, e4, (128, 128)).dequantize().double()  # noqa: E731
    else:
        act = lambda t, d: quantize_mxfp8(t, d).dequantize().double()  # noqa: E731
        wt = lambda t: quantize_mxfp8(t, e4).dequantize().double()  # noqa: E731
    y = act(x2d, e4) @ wt(w).t()
    dx = act(g2d, e5) @ wt(w.t().contiguous()).t()
    dw = act(g2d.t().contiguous(), e5) @ act(x2d.t().contiguous(), e4).t()
    return y, dx, dw


def test_block_recipes_quantize_each_gemm_along_its_inner_dimension():
    x, w, g = _rand(0, S, B, H), _rand(1, O, H, scale=0.2), _rand(3, S, B, O, scale=1e-3)
    for recipe in ("blockwise", "mxfp8"):
        y, dx, dw, _ = _run_linear(QuantRecipe(recipe, "hybrid"), x, w, torch.zeros(O), g)
        ref_y, ref_dx, ref_dw = _block_reference(recipe, x.reshape(-1, H), w, g.reshape(-1, O))
        for got, ref in ((y.reshape(-1, O), ref_y), (dx.reshape(-1, H), ref_dx), (dw, ref_dw)):
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-7, msg=lambda m: f"{recipe}: {m}")
    # nvfp4: forward exact against quantize_nvfp4_operand; gradients near the exact product (SR, RHT).
    from megatron.core.quantization.nvfp4 import quantize_nvfp4_operand

    y, dx, dw, _ = _run_linear(QuantRecipe("nvfp4", "e2m1"), x, w, torch.zeros(O), g)
    xq = quantize_nvfp4_operand(x.reshape(-1, H), "fprop", "input").dequantize().double()
    wq = quantize_nvfp4_operand(w, "fprop", "weight").dequantize().double()
    assert _within_fp32(y.reshape(-1, O), xq @ wq.t(), xq, wq)
    exact = g.reshape(-1, O).t() @ x.reshape(-1, H)
    assert (dw - exact).norm() < 0.25 * exact.norm() and (dw - exact).norm() > 0


def _block_models_body(rank, world_size):
    groups = single_rank_groups()
    losses = {}
    for name, kw in (
        ("bf16", {}),
        ("blockwise", dict(fp8="e4m3", fp8_recipe="blockwise")),
        ("mxfp8", dict(fp8="hybrid", fp8_recipe="mxfp8")),
        ("nvfp4", dict(fp4="e2m1", fp4_recipe="nvfp4")),
    ):
        model = build_gpt(llama_style(bf16=True, **kw), groups)
        assert (name == "bf16") == (not _quantized_layers(model)), name
        tokens, labels = batch(0)
        loss = model(tokens, None, None, labels=labels).mean()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters()), name
        losses[name] = loss.item()
    return losses


def test_block_recipes_train_a_gpt():
    losses = run_distributed(_block_models_body, 1)[0]
    for name in ("blockwise", "mxfp8", "nvfp4"):
        assert losses[name] != losses["bf16"] and abs(losses[name] - losses["bf16"]) < 0.05 * losses["bf16"], losses


def _recompute_body(rank, world_size):
    groups = single_rank_groups()
    plain = build_gpt(_fp8_style("delayed"), groups)
    recomputed = build_gpt(
        _fp8_style("delayed", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), groups
    )
    (loss, grads), (loss_r, grads_r) = _two_steps(plain, groups.tp), _two_steps(recomputed, groups.tp)
    assert torch.equal(loss, loss_r) and all(torch.equal(grads[n], g) for n, g in grads_r.items())
    state, state_r = _scaling_state(plain), _scaling_state(recomputed)
    return all(torch.equal(state[n], v) for n, v in state_r.items()) and len(state) == 8 * 3 * 2


def test_delayed_scaling_under_full_recompute_records_each_forward_once():
    """The recompute reuses the checkpointed forward's scales and records no amax (TE's rule)."""
    assert all(run_distributed(_recompute_body, 1))
