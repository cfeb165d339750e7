"""The KV cache: logits of a prefill then one token per call equal a full recompute (fp32, atol 1e-5).

GPT-2 style (learned positions, MHA) and Llama style (RoPE, grouped-query attention), with the SDPA
and unfused softmax backends, Llama style with MoE layers and with a sliding window; a single rank.
"""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.inference import StaticInferenceContext
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, gpt2_style, llama_style

ATOL = 1e-5


def _cached_logits(model, tokens, prefill):
    """Logits ``[b, s, V]`` of ``tokens`` computed as a prefill of ``prefill`` tokens, then one per call."""
    context = StaticInferenceContext(tokens.shape[0], tokens.shape[1])
    steps = [(0, prefill)] + [(i, i + 1) for i in range(prefill, tokens.shape[1])]
    out = []
    for start, end in steps:
        out.append(model(tokens[:, start:end], None, None, inference_context=context))
        context.increment_sequence_len_offset(end - start)
    return torch.cat(out, dim=1)


MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96)
CASES = [
    ("gpt2", gpt2_style(attention_backend="auto")),
    ("gpt2 unfused", gpt2_style(attention_backend="unfused")),
    ("llama", llama_style(attention_backend="auto")),
    ("llama unfused", llama_style(attention_backend="unfused")),
    ("llama moe", llama_style(**MOE)),
    ("llama window", llama_style(window_size=(3, 0))),  # Mistral's sliding_window=4
    ("llama window unfused", llama_style(window_size=(3, 0), attention_backend="unfused")),
]


def _parity_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    tokens, _ = batch(b=3)  # [3, 16]
    diffs = {}
    for name, kwargs in CASES:
        model = build_gpt(kwargs, groups).eval()
        with torch.no_grad():
            full = model(tokens)  # [b, s, V]
            for prefill in (1, 5):
                diffs[f"{name} prefill={prefill}"] = (_cached_logits(model, tokens, prefill) - full).abs().max().item()
            context = StaticInferenceContext(3, 16, materialize_only_last_token_logits=True)
            last = model(tokens[:, :7], None, None, inference_context=context)  # [b, 1, V]
        assert last.shape == (3, 1, full.shape[-1])
        diffs[f"{name} last-token-only"] = (last[:, 0] - full[:, 6]).abs().max().item()
    return diffs


def test_cached_logits_equal_full_recompute():
    diffs = run_distributed(_parity_body, 1)[0]
    for name, diff in diffs.items():
        assert diff <= ATOL, f"{name}: max |cached - full| = {diff:.3g} > {ATOL}"


def _limits_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    tokens, _ = batch(b=2)  # [2, 16]
    model = build_gpt(gpt2_style(), groups).eval()
    with pytest.raises(ValueError, match="KV cache overflow: positions 0..15 .*max_sequence_length=4"):
        model(tokens, inference_context=StaticInferenceContext(2, 4))
    with pytest.raises(ValueError, match="KV cache overflow: .* of batch 2.*max_batch_size=1"):
        model(tokens, inference_context=StaticInferenceContext(1, 16))
    with pytest.raises(ValueError, match="max_batch_size=0"):
        StaticInferenceContext(0, 4)
    with pytest.raises(NotImplementedError, match="inference_params"):
        model(tokens, inference_params=StaticInferenceContext(2, 16))


def test_cache_limits_checked():
    run_distributed(_limits_body, 1)
