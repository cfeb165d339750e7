"""GPTModel against transformers' DeepSeek-V3 (a tiny random config, nothing downloaded).

The config has what makes DeepSeek-V3: multi-latent attention with query compression and YaRN
(scaling factor 4, ``mscale`` != ``mscale_all_dim``, so both the cos/sin scale and the softmax
temperature matter), a first dense layer and then MoE layers with sigmoid routing limited to 2 of
4 expert groups, a non-zero ``e_score_correction_bias`` (our expert bias), renormalised top-k
weights scaled by ``routed_scaling_factor``, and shared experts. Logits must agree within 1e-4 max
abs (fp32), both ways: our weights exported into HF, and HF's own random weights imported into ours.
A second test shows the features matter: removing the shared experts, or YaRN's scales, moves
the logits far more than that.
"""

import torch
import transformers  # a test dependency: missing it must fail, not skip

from megatron.core import parallel_state as ps
from megatron.core.models.gpt.hf_state_dict import from_hf_llama, to_hf_llama
from tests.dist_harness import run_distributed
from tests.model_utils import VOCAB, batch, build_gpt, deepseek_style

MAX_ABS = 1e-4


def hf_deepseek(config, **rope_overrides):
    """``DeepseekV3ForCausalLM`` with ``config``'s shape (fp32, eval)."""
    hf_config = transformers.DeepseekV3Config(**hf_deepseek_fields(config, **rope_overrides), rope_interleave=True)
    return transformers.DeepseekV3ForCausalLM(hf_config).eval()


def hf_deepseek_fields(config, **rope_overrides):
    """The DeepSeek-V3 config fields (shared by V3.2) of ``config``'s shape."""
    rope = dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=config.rotary_scaling_factor,
        original_max_position_embeddings=config.original_max_position_embeddings,
        beta_fast=config.beta_fast,
        beta_slow=config.beta_slow,
        mscale=config.mscale,
        mscale_all_dim=config.mscale_all_dim,
    )
    rope.update(rope_overrides)
    return dict(
        vocab_size=VOCAB,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        moe_intermediate_size=config.moe_ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        n_shared_experts=config.moe_shared_expert_intermediate_size // config.moe_ffn_hidden_size,
        n_routed_experts=config.num_moe_experts,
        routed_scaling_factor=config.moe_router_topk_scaling_factor,
        kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.q_lora_rank,
        qk_rope_head_dim=config.qk_pos_emb_head_dim,
        qk_nope_head_dim=config.qk_head_dim,
        v_head_dim=config.v_head_dim,
        n_group=config.moe_router_num_groups,
        topk_group=config.moe_router_group_topk,
        num_experts_per_tok=config.moe_router_topk,
        first_k_dense_replace=config.moe_layer_freq.index(1),
        norm_topk_prob=True,
        max_position_embeddings=1024,
        rms_norm_eps=config.layernorm_epsilon,
        rope_parameters=rope,
        tie_word_embeddings=False,
    )


def _randomize(model: torch.nn.Module) -> None:
    """Weights large enough that every part shows in the logits (HF's init is 0.02 and zero biases)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))


def _parity_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    tokens, _ = batch(b=2)
    ours = build_gpt(deepseek_style(), groups, seed=7).eval()
    results = {}
    with torch.no_grad():
        ours.decoder.layers[1].mlp.router.expert_bias.normal_(0, 0.05)
        hf = hf_deepseek(ours.config)
        loaded = hf.load_state_dict(to_hf_llama(ours.state_dict(), ours.config), strict=True)
        assert not loaded.missing_keys and not loaded.unexpected_keys
        results["to_hf"] = (ours(tokens) - hf(tokens).logits).abs().max().item()
        fresh = hf_deepseek(ours.config)
        _randomize(fresh)
        ours.load_state_dict(from_hf_llama(fresh.state_dict(), ours.config), strict=True)
        reference = fresh(tokens).logits
        results["from_hf"] = (ours(tokens) - reference).abs().max().item()
        results["scale"] = reference.abs().max().item()
        results.update(_feature_diffs(fresh, ours.config, tokens, reference))
    return results


def _feature_diffs(hf, config, tokens, reference):
    """How far the HF logits move without the shared experts, or without YaRN's two scales."""
    diffs = {}
    for name, rope in (("yarn_cos_sin_scale", dict(mscale=0.7)), ("yarn_softmax_scale", dict(mscale_all_dim=0.0))):
        variant = hf_deepseek(config, **rope)
        variant.load_state_dict(hf.state_dict(), strict=True)
        diffs[name] = (variant(tokens).logits - reference).abs().max().item()
    for layer in hf.model.layers[1:]:
        layer.mlp.shared_experts.down_proj.weight.zero_()
    diffs["shared_experts"] = (hf(tokens).logits - reference).abs().max().item()
    return diffs


def test_logits_match_transformers_deepseek_v3():
    results = run_distributed(_parity_body, 1)[0]
    print({k: f"{v:.3g}" for k, v in results.items()})
    assert results["scale"] > 0.5, results
    for name in ("to_hf", "from_hf"):
        assert results[name] <= MAX_ABS, f"{name}: max |logits diff| = {results[name]:.3g} > {MAX_ABS}"
    for name in ("yarn_cos_sin_scale", "yarn_softmax_scale", "shared_experts"):
        assert results[name] > 1e-2, f"{name}: the logits do not depend on it ({results[name]:.3g})"
