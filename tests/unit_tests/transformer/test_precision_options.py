"""Numerics switches: fp32 residual stream, query-key layer scaling, fp32 softmax.

fp32_residual_connection with bf16 weights keeps every layer's output (the residual stream) in
fp32 while the weights and matmuls stay bf16, and its loss stays within 1% of the fp32 model's.
apply_query_key_layer_scaling divides scores by the layer number and multiplies back inside the
fp32 softmax: in fp32 the logits equal the plain model's (1e-5). The unfused bf16 attention with
and without fp32 softmax stays within 1% of fp32.
"""

import torch

from megatron.core import parallel_state as ps
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, gpt2_style


def _loss(model, tokens, labels):
    return model(tokens, None, None, labels=labels).float().mean().item()


def _body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    tokens, labels = batch()
    reference = _loss(build_gpt(gpt2_style(), groups), tokens, labels)
    out = {}

    model = build_gpt(gpt2_style(), groups, bf16=True, params_dtype=torch.bfloat16, fp32_residual_connection=True)
    assert model.config.pipeline_dtype == torch.float32
    dtypes = []
    for layer in model.decoder.layers:
        layer.register_forward_hook(lambda mod, args, output: dtypes.append(output[0].dtype))
    out["fp32_residual"] = _loss(model, tokens, labels)
    assert dtypes and all(d == torch.float32 for d in dtypes), dtypes
    assert model.decoder.layers[0].mlp.linear_fc1.weight.dtype == torch.bfloat16

    plain = build_gpt(gpt2_style(), groups, attention_backend="unfused")(tokens)
    scaled = build_gpt(gpt2_style(), groups, apply_query_key_layer_scaling=True)(tokens)
    torch.testing.assert_close(scaled, plain, rtol=1e-5, atol=1e-5)

    for fp32_softmax in (True, False):
        model = build_gpt(
            gpt2_style(),
            groups,
            bf16=True,
            params_dtype=torch.bfloat16,
            attention_backend="unfused",
            attention_softmax_in_fp32=fp32_softmax,
        )
        out[f"softmax_fp32={fp32_softmax}"] = _loss(model, tokens, labels)
    return reference, out


def test_precision_options_stay_close_to_fp32():
    reference, out = run_distributed(_body, 1)[0]
    for name, value in out.items():
        assert abs(value - reference) / reference < 0.01, (name, value, reference)
