"""Clamped SwiGLU (``activation_func_clamp_value``, DeepSeek-V4's ``swiglu_limit``) against transformers.

Our dense ``MLP`` with the clamp equals ``DeepseekV4MLP`` on the same weights at 1e-6 (fp32), on
inputs large enough that both clamps bite (without the clamp it does not), and the activation the
experts share (``apply_activation``, used by ``MLP`` and the grouped-GEMM experts) equals
``DeepseekV4Experts``' gate. The config refuses a
non-positive clamp and a clamp without a gated MLP, naming the field.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers

from megatron.core.transformer.mlp import MLP, apply_activation
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.dist_harness import run_distributed
from tests.model_utils import single_rank_groups

LIMIT, H, FFN = 0.5, 8, 16


def _config(**kw):
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=FFN, gated_linear_unit=True)
    base.update(activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True)
    return TransformerConfig(**dict(base, **kw))


def _hf_config():
    return transformers.DeepseekV4Config(
        hidden_size=H, intermediate_size=FFN, swiglu_limit=LIMIT, hidden_act="silu", num_local_experts=2
    )


def _mlp_body(rank, world_size):
    torch.manual_seed(0)
    ours = MLP(_config(activation_func_clamp_value=LIMIT), pg_collection=single_rank_groups())
    hf = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4MLP(_hf_config())
    gate, up = ours.linear_fc1.weight.detach().chunk(2)
    with torch.no_grad():
        hf.gate_proj.weight.copy_(gate)
        hf.up_proj.weight.copy_(up)
        hf.down_proj.weight.copy_(ours.linear_fc2.weight)
    x = 20 * torch.randn(5, 1, H)  # [s, b, h]: projections far beyond the limit
    with torch.no_grad():
        expected = hf(x)
        got, _ = ours(x)
        unclamped = apply_activation(_config(), ours.linear_fc1(x)[0])
    assert (got - expected).abs().max() <= 1e-6
    assert (ours.linear_fc2(unclamped)[0] - expected).abs().max() > 1e-2  # the clamp matters here
    experts = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4Experts(_hf_config())
    fc1 = 20 * torch.randn(3, 2 * FFN)
    with torch.no_grad():
        torch.testing.assert_close(
            apply_activation(_config(activation_func_clamp_value=LIMIT), fc1), experts._apply_gate(fc1)
        )


def test_clamped_mlp_matches_deepseek_v4():
    run_distributed(_mlp_body, 1)


@pytest.mark.parametrize("bad", [dict(activation_func_clamp_value=0.0), dict(activation_func_clamp_value=float("inf"))])
def test_clamp_refusals(bad):
    with pytest.raises(ValueError, match="activation_func_clamp_value"):
        _config(**bad)
    with pytest.raises(ValueError, match="gated_linear_unit"):
        _config(activation_func_clamp_value=1.0, gated_linear_unit=False)
