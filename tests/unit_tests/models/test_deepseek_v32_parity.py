"""GPTModel with DeepSeek Sparse Attention against transformers' DeepSeek-V3.2 (tiny, random, fp32).

The V3 test model (``deepseek_style``: MLA with YaRN, grouped sigmoid MoE, shared experts) plus the
lightning indexer keeping 4 of up to 16 keys per query, so the selection decides most of the
attention. Logits must agree within 1e-4 both ways (our weights exported, HF's imported). The
same HF model with the indexer keeping every key (DeepSeek-V3's dense MLA), and ours with the
indexer's rotary or key norm changed, move the logits far more than that: the test fails if the
indexer is removed, replaced by dense MLA, or computed differently.
"""

import torch
import transformers  # a test dependency: missing it must fail, not skip

from megatron.core import parallel_state as ps
from megatron.core.models.gpt.hf_state_dict import from_hf_llama, to_hf_llama
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, deepseek_style
from tests.unit_tests.models.test_deepseek_hf_parity import MAX_ABS, _randomize, hf_deepseek_fields

DSA = dict(experimental_attention_variant="dsa", dsa_indexer_n_heads=8, dsa_indexer_head_dim=12, dsa_indexer_topk=4)


def hf_deepseek_v32(config, index_topk=None):
    """``DeepseekV32ForCausalLM`` with ``config``'s shape (fp32, eval, eager attention)."""
    hf_config = transformers.DeepseekV32Config(
        **hf_deepseek_fields(config),
        index_topk=index_topk or config.dsa_indexer_topk,
        index_head_dim=config.dsa_indexer_head_dim,
        index_n_heads=config.dsa_indexer_n_heads,
    )
    hf_config._attn_implementation = "eager"
    return transformers.DeepseekV32ForCausalLM(hf_config).eval()


def _parity_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    tokens, _ = batch(b=2)
    ours = build_gpt(deepseek_style(**DSA), groups, seed=7).eval()
    results = {}
    with torch.no_grad():
        hf = hf_deepseek_v32(ours.config)
        loaded = hf.load_state_dict(to_hf_llama(ours.state_dict(), ours.config), strict=True)
        assert not loaded.missing_keys and not loaded.unexpected_keys
        results["to_hf"] = (ours(tokens) - hf(tokens).logits).abs().max().item()
        fresh = hf_deepseek_v32(ours.config)
        _randomize(fresh)
        ours.load_state_dict(from_hf_llama(fresh.state_dict(), ours.config), strict=True)
        reference = fresh(tokens).logits
        results["from_hf"] = (ours(tokens) - reference).abs().max().item()
        results["scale"] = reference.abs().max().item()
        dense = hf_deepseek_v32(ours.config, index_topk=tokens.shape[1])  # every key: DeepSeek-V3's MLA
        dense.load_state_dict(fresh.state_dict(), strict=True)
        results["dense_mla"] = (dense(tokens).logits - reference).abs().max().item()
        indexer = ours.decoder.layers[0].self_attention.core_attention.indexer
        indexer.k_norm.bias.add_(1.0)
        results["indexer_key_norm"] = (ours(tokens) - reference).abs().max().item()
    return results


def test_logits_match_transformers_deepseek_v32():
    results = run_distributed(_parity_body, 1)[0]
    print({k: f"{v:.3g}" for k, v in results.items()})
    assert results["scale"] > 0.5, results
    for name in ("to_hf", "from_hf"):
        assert results[name] <= MAX_ABS, f"{name}: max |logits diff| = {results[name]:.3g} > {MAX_ABS}"
    for name in ("dense_mla", "indexer_key_norm"):
        assert results[name] > 1e-2, f"{name}: the logits do not depend on it ({results[name]:.3g})"
