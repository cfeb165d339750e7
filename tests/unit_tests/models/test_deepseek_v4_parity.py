"""GPTModel as DeepSeek-V4 against transformers' ``DeepseekV4ForCausalLM`` (tiny, random, fp32).

Three layers (CSA, HCA, sliding window), three hyper-connection streams, a hash-routed MoE layer then two
learned ones (sqrtsoftplus scores, V4's default, with the expert bias), shared experts, clamped SwiGLU; 40
tokens, so the window (6), CSA's top-3 of up to 10 entries and HCA's 5 entries all shape the logits. Our
weights exported load strictly (nothing missing or left over) and the logits agree within 1e-4; the import is
the exact inverse. The hash table, the Sinkhorn normalisation and the hyper head each move the logits far more
than that when changed (as do sigmoid router scores in place of sqrtsoftplus), so the test fails without them.
In the same spawn each attention type alone equals ``DeepseekV4Attention`` at 1e-5 and depends on each of its
parts (``tests/unit_tests/transformer/compressed_attention_checks.py``).
"""

import torch
import torch.nn.functional as F
import transformers

from megatron.core import parallel_state as ps
from megatron.core.models.gpt.hf_deepseek_v4 import from_hf_deepseek_v4, to_hf_deepseek_v4
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt
from tests.unit_tests.transformer.compressed_attention_checks import attention_results, check_attention_results

MAX_ABS = 1e-4
VOCAB, S = 128, 40  # VOCAB: model_utils.batch's default (the EP check draws its tokens there)
TYPES = ["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"]
V4_MODEL = dict(
    num_layers=3, hidden_size=32, num_attention_heads=4, kv_channels=16, ffn_hidden_size=16,
    normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
    add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
    position_embedding_type="rope", rotary_percent=0.5, rotary_interleaved=True,
    share_embeddings_and_output_weights=False, vocab_size=VOCAB, max_sequence_length=S,
    q_lora_rank=12, window_size=(5, 0), compressed_attention_layer_types=TYPES, csa_compress_rate=4,
    hca_compress_rate=8, attention_output_groups=2, attention_output_lora_rank=6,
    dsa_indexer_n_heads=2, dsa_indexer_head_dim=8, dsa_indexer_topk=3, hyper_connection_streams=3,
    num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2, moe_router_score_function="sqrtsoftplus",
    moe_router_topk_scaling_factor=1.5, moe_router_enable_expert_bias=True,
    moe_router_load_balancing_type="none", moe_shared_expert_intermediate_size=16,
    activation_func_clamp_value=3.0, moe_num_hash_layers=1, moe_hash_router_vocab_size=VOCAB, init_method_std=0.2,
)  # fmt: skip


def hf_deepseek_v4(config):
    """``DeepseekV4ForCausalLM`` with ``config``'s shape (fp32, eval, eager attention)."""
    hf_config = transformers.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=config.hidden_size, moe_intermediate_size=config.moe_ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        head_dim=config.kv_channels, q_lora_rank=config.q_lora_rank, partial_rotary_factor=0.5,
        num_experts_per_tok=config.moe_router_topk, n_routed_experts=config.num_moe_experts, n_shared_experts=1,
        scoring_func=config.moe_router_score_function, routed_scaling_factor=config.moe_router_topk_scaling_factor,
        rope_theta=10000.0,
        layer_types=TYPES, compress_rope_theta=config.compressed_attention_rotary_base,
        compress_rates={TYPES[0]: config.csa_compress_rate, TYPES[1]: config.hca_compress_rate},
        hc_mult=config.hyper_connection_streams, hc_sinkhorn_iters=config.hyper_connection_sinkhorn_iterations,
        hc_eps=config.hyper_connection_eps, mlp_layer_types=["hash_moe", "moe", "moe"],
        swiglu_limit=config.activation_func_clamp_value, sliding_window=config.window_size[0] + 1,
        o_groups=config.attention_output_groups, o_lora_rank=config.attention_output_lora_rank,
        index_n_heads=config.dsa_indexer_n_heads, index_head_dim=config.dsa_indexer_head_dim,
        index_topk=config.dsa_indexer_topk, rms_norm_eps=config.layernorm_epsilon, tie_word_embeddings=False,
        max_position_embeddings=S,
    )  # fmt: skip
    hf_config._attn_implementation = "eager"
    return transformers.DeepseekV4ForCausalLM(hf_config).eval()


def randomize_v4(model):
    """The parameters that start at 0 or 1 (norms, sinks, position and mapping biases, scales, expert
    bias) made random, so each shows in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("mapping_scale"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(("position_bias", "attention_sinks", "mapping_bias")):
                p.copy_(0.5 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.05 * torch.randn_like(b))


def _parity_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    tokens, _ = batch(b=2, s=S, vocab=VOCAB)
    ours = build_gpt(V4_MODEL, groups, seed=7).eval()
    randomize_v4(ours)
    results = {}
    with torch.no_grad():
        hf = hf_deepseek_v4(ours.config)
        exported = to_hf_deepseek_v4(ours.state_dict(), ours.config)
        loaded = hf.load_state_dict(exported, strict=True)
        results["keys"] = (loaded.missing_keys, loaded.unexpected_keys)
        back = from_hf_deepseek_v4(exported, ours.config)
        results["round_trip"] = sorted(set(back) ^ set(ours.state_dict())) or all(
            torch.equal(back[k], v) for k, v in ours.state_dict().items()
        )
        reference = hf(tokens).logits
        results["diff"] = (ours(tokens) - reference).abs().max().item()
        results["scale"] = reference.abs().max().item()
        results["changed"] = _changes(ours, tokens, reference)
    results["attention"] = attention_results()  # each layer type alone against DeepseekV4Attention
    return results


def _changes(ours, tokens, reference):
    """How far the logits move when a DeepSeek-V4 part is changed (each restored afterwards)."""
    moved = {}
    layer0 = ours.decoder.layers[0]
    table = layer0.mlp.router.tid2eid
    saved = table.clone()
    table.copy_((table + 1) % ours.config.num_moe_experts)  # another frozen table
    moved["hash_table"] = (ours(tokens) - reference).abs().max().item()
    table.copy_(saved)
    connections = [m for m in ours.modules() if hasattr(m, "sinkhorn_iterations")]
    for hc in connections:  # columns normalised only: no longer (nearly) doubly stochastic
        hc.sinkhorn_iterations = 1
    moved["sinkhorn"] = (ours(tokens) - reference).abs().max().item()
    for hc in connections:
        hc.sinkhorn_iterations = ours.config.hyper_connection_sinkhorn_iterations
    ours.config.moe_router_score_function = "sigmoid"  # the routers read the model's config
    moved["score_function"] = (ours(tokens) - reference).abs().max().item()
    ours.config.moe_router_score_function = "sqrtsoftplus"
    head = ours.decoder.hyper_head.mapping_bias
    head.add_(1.0)
    moved["hyper_head"] = (ours(tokens) - reference).abs().max().item()
    head.sub_(1.0)
    return moved


def test_logits_match_transformers_deepseek_v4():
    results = run_distributed(_parity_body, 1)[0]
    print(results)
    check_attention_results(results["attention"])
    assert results["keys"] == ([], []), results["keys"]
    assert results["round_trip"] is True, results["round_trip"]
    assert results["scale"] > 0.5, results
    assert results["diff"] <= MAX_ABS, f"max |logits diff| = {results['diff']:.3g} > {MAX_ABS}"
    for name, moved in results["changed"].items():
        assert moved > 1e-2, f"the logits do not depend on {name} ({moved:.3g})"
