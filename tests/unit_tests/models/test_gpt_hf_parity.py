"""GPTModel against Hugging Face implementations nobody here wrote (random weights, nothing downloaded).

The same weights go into both models; logits must agree within 1e-4 max abs (fp32).
"""

import pytest
import transformers  # a test dependency (requirements-test.txt): missing it must fail, not skip

from megatron.core import parallel_state as ps
from megatron.core.models.gpt.hf_state_dict import (
    from_hf_llama,
    from_hf_mixtral,
    to_hf_gpt2,
    to_hf_llama,
    to_hf_mixtral,
)
from tests.dist_harness import run_distributed
from tests.model_utils import VOCAB, batch, build_gpt, gpt2_style, llama_style

MAX_ABS = 1e-4


def _gpt2_reference(config):
    hf_config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=config.hidden_size,
        n_layer=config.num_layers,
        n_head=config.num_attention_heads,
        n_inner=config.ffn_hidden_size,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=config.layernorm_epsilon,
        tie_word_embeddings=True,
    )
    return transformers.GPT2LMHeadModel(hf_config).eval()


# Llama 3.1's published RoPE scaling; Megatron's --use-rope-scaling fixes all but the factor.
LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama_reference(config, rope_base, scaled=False):
    rope = dict(LLAMA31_SCALING, rope_theta=rope_base) if scaled else {"rope_type": "default", "rope_theta": rope_base}
    hf_config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups,
        max_position_embeddings=131072 if scaled else 16,
        rms_norm_eps=config.layernorm_epsilon,
        rope_parameters=rope,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    return transformers.LlamaForCausalLM(hf_config).eval()


def _mistral_reference(config, sliding_window):
    hf_config = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups,
        max_position_embeddings=16,
        rms_norm_eps=config.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        sliding_window=sliding_window,
        tie_word_embeddings=False,
    )
    return transformers.MistralForCausalLM(hf_config).eval()


def _mixtral_reference(config):
    hf_config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups,
        max_position_embeddings=16,
        rms_norm_eps=config.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_local_experts=config.num_moe_experts,
        num_experts_per_tok=config.moe_router_topk,
        sliding_window=None,
        tie_word_embeddings=False,
    )
    return transformers.MixtralForCausalLM(hf_config).eval()


def _mixtral_body(rank, world_size):
    """MoE layers (top-2 of 4 experts, Megatron's top-k-then-softmax routing) against Mixtral."""
    groups = ps.initialize_model_parallel(1, 1)
    tokens, _ = batch(b=2)
    ours = build_gpt(llama_style(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96), groups, seed=3).eval()
    hf = _mixtral_reference(ours.config)
    hf.load_state_dict(to_hf_mixtral(ours.state_dict(), ours.config), strict=True)
    results = {"mixtral": (ours(tokens) - hf(tokens).logits).abs().max().item()}
    fresh = _mixtral_reference(ours.config)
    ours.load_state_dict(from_hf_mixtral(fresh.state_dict(), ours.config), strict=True)
    results["mixtral_from_hf"] = (ours(tokens) - fresh(tokens).logits).abs().max().item()
    return results


def _sliding_window_body(rank, world_size):
    """Mistral's sliding_window=W lets query i see keys i-W+1..i: Megatron's window_size=(W-1, 0)."""
    groups = ps.initialize_model_parallel(1, 1)
    tokens, _ = batch(b=2)
    results, logits = {}, {}
    for backend in ("auto", "unfused"):
        ours = build_gpt(llama_style(window_size=(3, 0), attention_backend=backend), groups, seed=5).eval()
        hf = _mistral_reference(ours.config, sliding_window=4)
        hf.load_state_dict(to_hf_llama(ours.state_dict(), ours.config), strict=True)
        logits[backend] = ours(tokens)
        results[f"mistral_window_{backend}"] = (logits[backend] - hf(tokens).logits).abs().max().item()
    full = build_gpt(llama_style(), groups, seed=5).eval()
    assert (full(tokens) - logits["auto"]).abs().max() > 1e-2  # the window changes the result
    return results


def _parity_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    tokens, _ = batch(b=2)
    results = {}
    ours = build_gpt(gpt2_style(), groups).eval()
    hf = _gpt2_reference(ours.config)
    missing = hf.load_state_dict(to_hf_gpt2(ours.state_dict(), ours.config), strict=False)
    assert not missing.missing_keys or all("attn.bias" in k or "masked_bias" in k for k in missing.missing_keys)
    results["gpt2"] = (ours(tokens) - hf(tokens).logits).abs().max().item()

    ours = build_gpt(llama_style(rotary_base=500000), groups).eval()
    hf = _llama_reference(ours.config, 500000.0)
    hf.load_state_dict(to_hf_llama(ours.state_dict(), ours.config), strict=True)
    results["llama"] = (ours(tokens) - hf(tokens).logits).abs().max().item()

    # And back: HF's own random weights loaded into ours give the same logits.
    fresh = _llama_reference(ours.config, 500000.0)
    ours.load_state_dict(from_hf_llama(fresh.state_dict(), ours.config), strict=True)
    results["llama_from_hf"] = (ours(tokens) - fresh(tokens).logits).abs().max().item()

    # Llama 3.1 RoPE scaling (--use-rope-scaling): the same frequencies as HF's "llama3" rope type.
    scaled = build_gpt(llama_style(rotary_base=500000, rope_scaling=True), groups).eval()
    hf = _llama_reference(scaled.config, 500000.0, scaled=True)
    hf.load_state_dict(to_hf_llama(scaled.state_dict(), scaled.config), strict=True)
    results["llama3_scaled"] = (scaled(tokens) - hf(tokens).logits).abs().max().item()
    hf_inv_freq = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")[0]
    results["llama3_inv_freq"] = (scaled.rotary_pos_emb.inv_freq - hf_inv_freq).abs().max().item()
    unscaled = ours.rotary_pos_emb.inv_freq
    assert (scaled.rotary_pos_emb.inv_freq - unscaled).abs().max() > 1e-4  # the scaling changed something
    return results


@pytest.mark.parametrize("body", [_parity_body, _sliding_window_body, _mixtral_body])
def test_logits_match_hugging_face(body):
    results = run_distributed(body, 1)[0]
    for name, diff in results.items():
        assert diff <= MAX_ABS, f"{name}: max |logits diff| = {diff:.3g} > {MAX_ABS}"
