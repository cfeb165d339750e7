"""FP8 GEMMs in MLA's replicated down projections and in multi-token prediction modules.

Megatron builds MLA's ``linear_q_down_proj`` / ``linear_kv_down_proj`` as Transformer Engine linears
inside the layer's FP8 autocast, and runs each MTP module's ``eh_proj`` and transformer layer in the
global FP8 context (no layer number, so ``first_last_layers_bf16`` does not apply; FP4 is not applied
to MTP). On one rank, a DeepSeek-V3-style model (MLA, MoE, one MTP module; dims multiples of 16):
* tensorwise FP8: both down projections of every decoder layer and of the MTP layer, and ``eh_proj``,
  have quantizers, and a forward/backward quantizes their input, weight and output gradient (recorded
  at ``LinearQuantizer.quantize``); a down projection's output equals the product of its quantized
  operands (float64 reference) and differs from the unquantized one;
* ``first_last_layers_bf16`` with the last decoder layer in bf16: that layer's linears have no
  quantizer, the MTP module's still do;
* NVFP4: the decoder's linears are quantized, the MTP module's are not.

Two ranks, TP=2 with sequence parallelism, tensorwise: loss (rtol 1e-5) and gradients (rtol 2e-3,
atol 1e-5, as the FP8 TP test) equal one rank's; this needs the down projections' amaxes reduced over
TP (each rank quantizes its own tokens), without which the loss check fails.
"""

import torch
import torch.nn.functional as F

import megatron.core.quantization.recipes as recipes
from megatron.core.parallel_state import ParallelLayout, build_process_groups
from megatron.core.quantization.fp8 import quantize_current
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, deepseek_style, single_rank_groups
from tests.unit_tests.models.test_mla_parallel_parity import _loss_and_grads
from tests.unit_tests.test_fp8_linear import _within_fp32

DIMS = dict(kv_lora_rank=16, qk_pos_emb_head_dim=16, v_head_dim=8, mtp_num_layers=1)
DOWN = ("self_attention.linear_q_down_proj", "self_attention.linear_kv_down_proj")


def _quantized(model):
    return {n for n, m in model.named_modules() if getattr(m, "quantizer", None) is not None}


def _targets(num_layers):
    decoder = {f"decoder.layers.{i}.{d}" for i in range(num_layers) for d in DOWN}
    mtp = {f"mtp.layers.0.transformer_layer.{d}" for d in DOWN} | {"mtp.layers.0.eh_proj"}
    return decoder, mtp


def _roles_per_module(model):
    """Run forward + backward; the roles each quantizer was asked for, by its linear's name."""
    owner = {id(m.quantizer): n for n, m in model.named_modules() if getattr(m, "quantizer", None) is not None}
    seen, real = {}, recipes.LinearQuantizer.quantize

    def recording(self, role, x, gemm="fprop", phase=None):
        seen.setdefault(owner[id(self)], set()).add(role)
        return real(self, role, x, gemm, phase)

    recipes.LinearQuantizer.quantize = recording
    try:
        tokens, labels = batch(0)
        model(tokens, None, None, labels=labels).mean().backward()
    finally:
        recipes.LinearQuantizer.quantize = real
    return seen


def _down_projection_numerics(model):
    down = model.decoder.layers[0].self_attention.linear_kv_down_proj
    x = torch.randn(8, 2, down.weight.size(1), generator=torch.Generator().manual_seed(0))
    y, _ = down(x)
    xq = quantize_current(x.reshape(-1, x.size(-1)), "e4m3").dequantize().double()  # [t, in]
    wq = quantize_current(down.weight.detach(), "e4m3").dequantize().double()  # [out, in]
    ref = xq @ wq.t()
    plain = F.linear(x, down.weight).reshape(-1, wq.size(0)).double()
    return _within_fp32(y.detach().reshape(-1, wq.size(0)), ref, xq, wq) and not _within_fp32(plain, ref, xq, wq)


def _body(rank, world_size):
    groups = single_rank_groups()
    kw = deepseek_style(bf16=True, fp8="hybrid", fp8_recipe="tensorwise", **DIMS)
    model = build_gpt(kw, groups)
    decoder, mtp = _targets(kw["num_layers"])
    assert decoder | mtp <= _quantized(model), sorted((decoder | mtp) - _quantized(model))
    seen = _roles_per_module(model)
    missing = {n: seen.get(n) for n in decoder | mtp if seen.get(n) != {"input", "weight", "grad_output"}}
    assert not missing, missing
    assert _down_projection_numerics(model)
    # The bf16 window leaves the last decoder layer out, never the MTP module (Megatron's global context).
    bf16_end = build_gpt(dict(kw, first_last_layers_bf16=True, num_layers_at_end_in_bf16=1), groups)
    names = _quantized(bf16_end)
    assert mtp <= names and not any(n.startswith("decoder.layers.2.") for n in names), sorted(names)
    # NVFP4: Megatron leaves MTP modules out of FP4.
    fp4 = build_gpt(deepseek_style(bf16=True, fp4="e2m1", fp4_recipe="nvfp4", **DIMS), groups)
    names = _quantized(fp4)
    assert decoder <= names and not any(n.startswith("mtp.") for n in names), sorted(names)
    return True


def test_mla_down_projections_and_mtp_layers_run_quantized_gemms():
    assert all(run_distributed(_body, 1))


def _tp_body(rank, world_size):
    tokens, labels = batch()
    one = single_rank_groups()
    tp = build_process_groups(ParallelLayout(world_size=world_size, tensor_model_parallel_size=world_size))
    kw = deepseek_style(bf16=True, fp8="hybrid", fp8_recipe="tensorwise", moe_ffn_hidden_size=32, **DIMS)
    ref_loss, ref_grads = _loss_and_grads(build_gpt(kw, one), tokens, labels, one)
    model = build_gpt(dict(kw, sequence_parallel=True), tp)
    loss, grads = _loss_and_grads(model, tokens, labels, tp)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=2e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")
    return True


def test_fp8_mla_and_mtp_under_tp_and_sp_equal_one_rank():
    """The down projections' amaxes are reduced over TP: under SP every rank uses one rank's scales."""
    assert all(run_distributed(_tp_body, 2))
