"""DeepSeek-V4's attention (``CompressedAttention``) against transformers' ``DeepseekV4Attention`` (fp32);
run inside the model parity test's spawn (``tests/unit_tests/models/test_deepseek_v4_parity.py``).

Tiny sizes, 40 tokens: the window (6) is shorter than the sequence, CSA (rate 4: 10 entries) keeps
3 per query, HCA (rate 8: 5 entries) sees all it may. For each layer type the output equals
transformers' on the same weights at 1e-5; and each component matters: replacing CSA's indexer
choice by all entries, dropping the compressed entries, widening the window, zeroing the sinks or
rotating with the main base moves the output by far more.
"""

import torch
import transformers
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.hf_deepseek_v4 import attention_to_hf
from megatron.core.transformer.experimental_attention_variant.compressed_attention import CompressedAttention
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.model_utils import single_rank_groups

H, N, D, ROPE, S, B, WINDOW = 32, 4, 16, 8, 40, 2, 6
TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
V4 = dict(
    num_layers=3, hidden_size=H, num_attention_heads=N, kv_channels=D, q_lora_rank=12, normalization="RMSNorm",
    layernorm_epsilon=1e-6, window_size=(WINDOW - 1, 0), compressed_attention_layer_types=list(TYPES),
    csa_compress_rate=4, hca_compress_rate=8, compressed_attention_rotary_base=160000.0,
    attention_output_groups=2, attention_output_lora_rank=6, dsa_indexer_n_heads=2, dsa_indexer_head_dim=8,
    dsa_indexer_topk=3, attention_dropout=0.0, hidden_dropout=0.0, add_bias_linear=False,
    use_cpu_initialization=True, init_method_std=0.3,
)  # fmt: skip


def hf_config(config: TransformerConfig) -> transformers.DeepseekV4Config:
    """transformers' config of ``config``'s attention."""
    return transformers.DeepseekV4Config(
        hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads, head_dim=config.kv_channels,
        partial_rotary_factor=ROPE / config.kv_channels, q_lora_rank=config.q_lora_rank,
        o_groups=config.attention_output_groups, o_lora_rank=config.attention_output_lora_rank,
        sliding_window=config.window_size[0] + 1, rms_norm_eps=config.layernorm_epsilon,
        compress_rates={TYPES[1]: config.csa_compress_rate, TYPES[2]: config.hca_compress_rate},
        compress_rope_theta=config.compressed_attention_rotary_base, rope_theta=10000.0,
        index_n_heads=config.dsa_indexer_n_heads, index_head_dim=config.dsa_indexer_head_dim,
        index_topk=config.dsa_indexer_topk, num_hidden_layers=config.num_layers,
        layer_types=list(config.compressed_attention_layer_types), mlp_layer_types=["moe"] * config.num_layers,
    )  # fmt: skip


def _randomize_small(module):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("position_bias") or name == "attention_sinks":
                p.copy_(torch.randn_like(p))


def _hf_output(hf, x, config, layer_type):
    rotary = hf_v4.DeepseekV4RotaryEmbedding(hf.config)
    positions = torch.arange(S)[None]
    embeddings = {kind: rotary(x, positions, layer_type=kind) for kind in ("main", "compress")}
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    mask = torch.zeros(S, S).masked_fill((j > i) | (i - j >= WINDOW), float("-inf"))[None, None]
    out, _ = hf(x, embeddings, positions, mask.expand(B, 1, S, S))
    return out


def _ours(config, layer_number, seed=0):
    torch.manual_seed(seed)
    module = CompressedAttention(config, layer_number, pg_collection=single_rank_groups()).eval()
    _randomize_small(module)
    return module


def attention_results():
    """Per layer type: (max |ours - transformers|, max |transformers|) and how far each change moves it."""
    config = TransformerConfig(**V4)
    freqs = RotaryEmbedding(D, ROPE / D, rotary_interleaved=True, rotary_base=10000.0)(S)  # [s, 1, 1, r]
    torch.manual_seed(1)
    x = torch.randn(S, B, H)
    results = {}
    for number, layer_type in enumerate(TYPES, 1):
        ours = _ours(config, number)
        hf = hf_v4.DeepseekV4Attention(hf_config(config), number - 1).eval()
        hf.load_state_dict(attention_to_hf(ours.state_dict()), strict=True)
        with torch.no_grad():
            expected = _hf_output(hf, x.transpose(0, 1), config, layer_type).transpose(0, 1)  # [s, b, h]
            got, _ = ours(x, rotary_pos_emb=freqs)
            results[layer_type] = ((got - expected).abs().max().item(), expected.abs().max().item())
            results[layer_type + "/changed"] = _changes(ours, x, freqs, expected)
    return results


def _changes(ours, x, freqs, expected):
    """How far the output moves when one component is removed or replaced."""
    moved = {}

    def run(name):
        out, _ = ours(x, rotary_pos_emb=freqs)
        moved[name] = (out - expected).abs().max().item()

    sinks = ours.attention_sinks.clone()
    ours.attention_sinks.fill_(-1e9)
    run("no_sinks")
    ours.attention_sinks.copy_(sinks)
    window = ours.config.window_size
    ours.config.window_size = (S, 0)
    run("full_window")
    ours.config.window_size = window
    if ours.compressor is not None:
        compressor, indexer = ours.compressor, ours.indexer
        ours.compressor = ours.indexer = None
        run("no_compressed")
        ours.compressor, ours.indexer = compressor, indexer
        if indexer is not None:
            ours.indexer.topk = 10**6  # every visible entry: no sparse selection
            run("all_entries")
            ours.indexer.topk = ours.config.dsa_indexer_topk
        base = ours.config.compressed_attention_rotary_base
        ours.config.compressed_attention_rotary_base = 10000.0
        run("main_rope_base")
        ours.config.compressed_attention_rotary_base = base
    return moved


def check_attention_results(results):
    for layer_type in TYPES:
        diff, scale = results[layer_type]
        assert scale > 0.1, (layer_type, scale)
        assert diff <= 1e-5 * max(1.0, scale), f"{layer_type}: max |diff| = {diff:.3g}"
        for name, moved in results[layer_type + "/changed"].items():
            assert moved > 1e-3 * scale, f"{layer_type}: the output does not depend on {name} ({moved:.3g})"
