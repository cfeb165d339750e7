"""GPTModel against transformers' Qwen2, Qwen3 and Qwen3-MoE (tiny random configs, nothing downloaded).

Qwen2 is Llama plus a QKV bias (``add_qkv_bias``); Qwen3 drops it for a per-head RMSNorm on
queries and keys before RoPE (``qk_layernorm``), with a head dim that need not be hidden/heads;
Qwen3-MoE routes with a softmax over all experts, keeps the top k and, with ``norm_topk_prob``,
renormalises them (our top-k-then-softmax, ``moe_router_pre_softmax=False``), else keeps the raw
probabilities (``moe_router_pre_softmax=True``). Logits must agree within 1e-4 max abs (fp32),
both ways: our weights exported into HF, and HF's own random weights imported into ours.
"""

import torch
import transformers  # a test dependency: missing it must fail, not skip

from megatron.core import parallel_state as ps
from megatron.core.models.gpt.hf_state_dict import from_hf_llama, to_hf_llama
from tests.dist_harness import run_distributed
from tests.model_utils import VOCAB, batch, build_gpt, llama_style

MAX_ABS = 1e-4


def _common(config):
    """The HF config fields every Qwen family shares, from our ``config``."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups,
        max_position_embeddings=16,
        rms_norm_eps=config.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )


def _qwen2(config):
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_common(config))).eval()


def _qwen3(config):
    hf_config = transformers.Qwen3Config(**_common(config), head_dim=config.kv_channels, attention_bias=False)
    return transformers.Qwen3ForCausalLM(hf_config).eval()


def _qwen3_moe(config, norm_topk_prob, mlp_only_layers=()):
    hf_config = transformers.Qwen3MoeConfig(
        **_common(config),
        head_dim=config.kv_channels,
        num_experts=config.num_moe_experts,
        num_experts_per_tok=config.moe_router_topk,
        moe_intermediate_size=config.moe_ffn_hidden_size,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=list(mlp_only_layers),
    )
    return transformers.Qwen3MoeForCausalLM(hf_config).eval()


MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, qk_layernorm=True, kv_channels=16)
CASES = {
    "qwen2": (dict(add_qkv_bias=True), _qwen2),
    "qwen3": (dict(qk_layernorm=True, kv_channels=16), _qwen3),  # q: 8 heads x 16 = 128 != hidden 64
    "qwen3_moe_norm_topk": (dict(MOE), lambda c: _qwen3_moe(c, True)),
    "qwen3_moe_raw_topk": (dict(MOE, moe_router_pre_softmax=True), lambda c: _qwen3_moe(c, False)),
    "qwen3_moe_dense_first": (dict(MOE, moe_layer_freq=[0, 1]), lambda c: _qwen3_moe(c, True, [0])),
}


def _parity_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    tokens, _ = batch(b=2)
    results = {}
    for name, (overrides, reference) in CASES.items():
        ours = build_gpt(llama_style(**overrides), groups, seed=7).eval()
        hf = reference(ours.config)
        loaded = hf.load_state_dict(to_hf_llama(ours.state_dict(), ours.config), strict=True)
        assert not loaded.missing_keys and not loaded.unexpected_keys
        with torch.no_grad():
            results[name] = (ours(tokens) - hf(tokens).logits).abs().max().item()
            fresh = reference(ours.config)  # HF's own init (norm weights 1, biases 0: perturb them)
            for n, p in fresh.named_parameters():
                if n.endswith(("norm.weight", "bias")):
                    p.add_(torch.randn_like(p) * 0.1)
            ours.load_state_dict(from_hf_llama(fresh.state_dict(), ours.config), strict=True)
            results[name + "_from_hf"] = (ours(tokens) - fresh(tokens).logits).abs().max().item()
    return results


def _ignored_feature_body(rank, world_size):
    """The features change the logits: a model built without them would not pass the parity above."""
    groups = ps.initialize_model_parallel(1, 1)
    tokens, _ = batch(b=2)
    diffs = {}
    for name, feature in (("add_qkv_bias", dict(add_qkv_bias=True)), ("qk_layernorm", dict(qk_layernorm=True))):
        with_it = build_gpt(llama_style(**feature), groups, seed=7).eval()
        without = build_gpt(llama_style(), groups, seed=7).eval()
        sd = {k: v for k, v in with_it.state_dict().items() if k in without.state_dict()}
        without.load_state_dict(sd, strict=True)
        with torch.no_grad():
            for n, p in with_it.named_parameters():
                if "linear_qkv.bias" in n or "q_layernorm" in n or "k_layernorm" in n:
                    p.add_(torch.randn_like(p) * 0.1)
            diffs[name] = (with_it(tokens) - without(tokens)).abs().max().item()
    return diffs


def test_logits_match_transformers_qwen():
    results = run_distributed(_parity_body, 1)[0]
    for name, diff in results.items():
        assert diff <= MAX_ABS, f"{name}: max |logits diff| = {diff:.3g} > {MAX_ABS}"


def test_qwen_features_change_the_logits():
    for name, diff in run_distributed(_ignored_feature_body, 1)[0].items():
        assert diff > 1e-3, f"{name}: logits unchanged ({diff:.3g})"
