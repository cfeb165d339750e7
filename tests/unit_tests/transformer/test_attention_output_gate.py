"""``TransformerConfig.attention_output_gate`` (Qwen3-Next's gated attention) against a reference written here.

The reference reads the fused projection as megatron-core lays it out (per query group: its queries, as many
gate columns, its key, its value), runs causal grouped-query attention with PyTorch's SDPA, multiplies by
``sigmoid(gate)`` and projects. fp32: outputs and input gradients at rtol 1e-5. TP=2 (with and without SP)
is checked against one rank in ``tests/unit_tests/models/test_gpt_tp_parity.py``.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.dist_harness import run_distributed

HEADS, GROUPS, D, HIDDEN, S, B = 4, 2, 8, 16, 6, 3


def _config(**kw) -> TransformerConfig:
    shape = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS, kv_channels=D)
    return TransformerConfig(**{**shape, **kw}, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False)


def _reference(attention: SelfAttention, x: torch.Tensor) -> torch.Tensor:
    """``[s, b, h]`` -> ``[s, b, h]`` from the module's weights, gate layout as megatron-core's."""
    q_per_group = HEADS // GROUPS
    w = attention.linear_qkv.weight.view(GROUPS, (2 * q_per_group + 2) * D, HIDDEN)
    wq, wg, wk, wv = torch.split(w, [q_per_group * D, q_per_group * D, D, D], dim=1)
    x_bsh = x.transpose(0, 1)  # [b, s, h]

    def heads(weight: torch.Tensor) -> torch.Tensor:  # [groups, n*D, h] -> [b, groups*n, s, D]
        y = x_bsh @ weight.reshape(-1, HIDDEN).t()  # [b, s, groups*n*D]
        return y.view(B, S, -1, D).transpose(1, 2)

    q, gate, k, v = heads(wq), heads(wg), heads(wk), heads(wv)
    k, v = k.repeat_interleave(q_per_group, dim=1), v.repeat_interleave(q_per_group, dim=1)
    context = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, D]
    context = context * torch.sigmoid(gate)
    context = context.transpose(1, 2).reshape(B, S, HEADS * D).transpose(0, 1)  # [s, b, heads*D]
    return context @ attention.linear_proj.weight.t()


def _attention(groups: ProcessGroupCollection, **kw) -> SelfAttention:
    model_parallel_cuda_manual_seed(0)
    return SelfAttention(_config(**kw), layer_number=1, pg_collection=groups)


def _body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    _gated_attention_equals_the_reference(groups)
    _the_gate_changes_the_output(groups)


def test_gated_attention_against_the_reference_and_without_its_gate():
    run_distributed(_body, 1)


def test_mla_refuses_the_gate():
    with pytest.raises(ValueError, match="attention_output_gate=True"):
        _config(
            attention_output_gate=True,
            multi_latent_attention=True,
            num_query_groups=None,
            kv_lora_rank=4,
            qk_head_dim=4,
            qk_pos_emb_head_dim=4,
            v_head_dim=4,
        )


def _gated_attention_equals_the_reference(groups):
    attention = _attention(groups, attention_output_gate=True)
    assert tuple(attention.linear_qkv.weight.shape) == ((2 * HEADS + 2 * GROUPS) * D, HIDDEN)
    x = torch.randn(S, B, HIDDEN, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, _ = attention(x, None)
    expected = _reference(attention, x_ref)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)


def _the_gate_changes_the_output(groups):
    plain = _attention(groups)
    assert tuple(plain.linear_qkv.weight.shape) == ((HEADS + 2 * GROUPS) * D, HIDDEN)
    gated = _attention(groups, attention_output_gate=True)
    with torch.no_grad():  # the same queries, keys and values; the gate columns are the only difference
        per_group = gated.linear_qkv.weight.view(GROUPS, -1, HIDDEN)
        q_cols = HEADS // GROUPS * D
        keep = torch.cat([per_group[:, :q_cols], per_group[:, 2 * q_cols :]], dim=1).reshape(-1, HIDDEN)
        plain.linear_qkv.weight.copy_(keep)
        plain.linear_proj.weight.copy_(gated.linear_proj.weight)
    x = torch.randn(S, B, HIDDEN)
    ungated_out, _ = plain(x, None)
    gated_out, _ = gated(x, None)
    assert not torch.allclose(ungated_out, gated_out, atol=1e-4)
