"""A tiny Qwen3-Next-style GPTModel (GDN, gated attention, GDN, gated attention; dense then MoE MLPs with a
gated shared expert) and the ``transformers`` ``Qwen3NextForCausalLM`` of the same shape."""

import torch
import transformers  # a test dependency: missing it must fail, not skip

from megatron.core.models.gpt.hf_qwen3_next import from_hf_qwen3_next
from megatron.core.ssm.gated_delta_net import GatedDeltaNet
from tests.model_utils import VOCAB, build_gpt, llama_style
from tests.unit_tests.ssm.mamba_utils import shard_state_dict

SEQ, CHUNK = 40, 16  # SEQ spans three GDN chunks of CHUNK (transformers' 64-token chunks: one)
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
# ``qwen3_next_kwargs`` overrides: dense MLPs in place of MoE (no router, no experts).
DENSE = dict(num_moe_experts=None, moe_layer_freq=1, moe_ffn_hidden_size=None)
DENSE.update(moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False)


def qwen3_next_kwargs(**overrides):
    """Our model's arguments: every 2nd layer full attention (query/key norms, output gate, a quarter of each
    head rotated), zero-centred norms, MoE after a dense first layer."""
    kw = llama_style(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=48,
        qk_layernorm=True, attention_output_gate=True, rotary_percent=0.25, layernorm_zero_centered_gamma=True,
        layernorm_epsilon=1e-6, experimental_attention_variant="gated_delta_net", linear_attention_freq=2,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=24,
        moe_shared_expert_gate=True, moe_layer_freq=[0, 1, 1, 1], max_sequence_length=SEQ, **GDN,
    )  # fmt: skip
    kw.update(overrides)
    return kw


def hf_qwen3_next(seed=None):
    """``Qwen3NextForCausalLM`` of ``qwen3_next_kwargs``' shape; with ``seed``, its weights perturbed at random
    (HF initializes norms and ``dt_bias`` to constants, which would hide a mix-up)."""
    config = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25, rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0], tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention"] * 2, max_position_embeddings=256, **GDN,
    )  # fmt: skip
    config._attn_implementation = "eager"
    if seed is not None:
        torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    if seed is not None:
        perturb(model)
    return model


def perturb(model):
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))


def build_qwen3_next(groups, **overrides):
    """Our model split over ``groups`` (its GDN layers computing in chunks of ``CHUNK``)."""
    model = build_gpt(qwen3_next_kwargs(**overrides), groups, seed=7).eval()
    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            module.chunk_size = CHUNK
    return model


def build_from_hf(hf_model, groups, **overrides):
    """Our model split over ``groups``, holding ``hf_model``'s weights."""
    ours = build_qwen3_next(groups, **overrides)
    full = from_hf_qwen3_next(hf_model.state_dict(), ours.config)
    ours.load_state_dict(shard_state_dict(ours, full, groups.tp), strict=True)
    return ours
