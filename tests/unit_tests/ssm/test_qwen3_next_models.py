"""Qwen3-Next-style hybrids (Gated DeltaNet and gated full attention, MoE with a gated shared expert) in one
spawned group of two ranks.

Rank 0: logits against ``transformers``' ``Qwen3NextForCausalLM`` on 40 tokens (three of our 16-token GDN chunks),
both ways (HF's weights imported, ours exported), within 1e-4 (fp32); and the features change the logits.

Greedy generation (``InferenceEngine``: per GDN layer the convolution inputs and the recurrent state, the KV
cache for attention) on one rank and under TP=2 equals ``transformers``' ``generate``.

Both ranks: the model under TP=2, with and without sequence parallelism, equals the one-rank model with the
same weights in the per-token loss and every gradient (TP shards joined back, GDN's
``[q, k, v, z, beta, alpha]`` layout too); rtol=1e-5, atol=1e-6. The memory report's parameter list of the TP=2
model names its parameters and sizes.
"""

import torch

from megatron.core.models.gpt.hf_qwen3_next import to_hf_qwen3_next
from megatron.core.parallel_state import ParallelLayout, build_process_groups
from megatron.training.theoretical_memory_params import LanguageModelShape, RankPosition, chunk_parameters
from tests.dist_harness import run_distributed
from tests.model_utils import VOCAB, batch, single_rank_groups
from tests.unit_tests.inference.hf_models import random_prompts
from tests.unit_tests.ssm.qwen3_next_utils import DENSE, SEQ, build_from_hf, build_qwen3_next, hf_qwen3_next, perturb
from tests.unit_tests.ssm.test_mamba_models import _assert_close, _loss_and_grads

HF_MAX_ABS = 1e-4
NEW_TOKENS = 8


def _max_diff(ours, hf, tokens):
    with torch.no_grad():
        return float((ours(tokens) - hf(tokens, use_cache=False).logits).abs().max())


def _parity(groups, tokens):
    """(imported, exported) logit differences, and how much the output gate and zero-centred norms move them."""
    hf = hf_qwen3_next(seed=3)
    ours = build_from_hf(hf, groups)
    imported = _max_diff(ours, hf, tokens)
    perturb(ours)
    loaded = hf.load_state_dict(to_hf_qwen3_next(ours.state_dict(), ours.config), strict=True)
    assert not loaded.missing_keys and not loaded.unexpected_keys
    exported = _max_diff(ours, hf, tokens)
    moved = {}
    for feature in ("attention_output_gate", "layernorm_zero_centered_gamma"):
        without = build_qwen3_next(groups, **{feature: False})
        state = {k: v for k, v in ours.state_dict().items() if k in without.state_dict()}
        if feature == "attention_output_gate":  # drop the gate rows of the fused query projection
            for key in [k for k in state if k.endswith("linear_qkv.weight")]:
                state[key] = state[key].reshape(2, 6, 16, -1)[:, [0, 1, 4, 5]].reshape(-1, state[key].shape[-1])
        without.load_state_dict(state, strict=True)
        with torch.no_grad():
            moved[feature] = float((ours(tokens) - without(tokens)).abs().max())
    return imported, exported, moved


def _generate(groups, hf, prompts):
    from megatron.core.inference.engine import InferenceEngine
    from megatron.core.inference.sampling_params import SamplingParams

    engine = InferenceEngine(build_from_hf(hf, groups), groups)
    results = engine.generate(prompts, SamplingParams(temperature=0.0, num_tokens_to_generate=NEW_TOKENS))
    return [r.generated_tokens for r in results]


def _hf_generate(hf, prompts):
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            mask = torch.ones_like(ids)  # without it, generate takes token 0 for padding
            full = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        out.append(full[0, len(prompt) :].tolist())
    return out


def _body(rank, world_size):
    tokens, labels = batch(vocab=VOCAB, s=SEQ)
    ref_groups = single_rank_groups()
    parity = _parity(ref_groups, tokens) if rank == 0 else None
    ref = _loss_and_grads(build_qwen3_next(ref_groups).train(), tokens, labels, ref_groups.tp)
    tp = build_process_groups(ParallelLayout(world_size=world_size, tensor_model_parallel_size=world_size))
    # CPU initialization: the same weights at any TP size. MoE layers train under TP only with sequence
    # parallelism (Megatron's rule), so TP without it runs the model with dense MLPs, against its own reference.
    dense_ref = _loss_and_grads(build_qwen3_next(ref_groups, **DENSE).train(), tokens, labels, ref_groups.tp)
    for sp, extra, reference in ((False, DENSE, dense_ref), (True, {}, ref)):
        model = build_qwen3_next(tp, sequence_parallel=sp, **extra).train()
        _assert_close(f"tp={world_size} sp={sp}", _loss_and_grads(model, tokens, labels, tp.tp), reference)
    lm = LanguageModelShape(VOCAB, SEQ, "rope", share_embeddings_and_output_weights=False)
    derived = [(e.name, e.numel) for e in chunk_parameters(model.config, lm, RankPosition(tp=world_size))]
    assert derived == [(n, p.numel()) for n, p in model.named_parameters()]  # the memory report's parameter list
    hf = hf_qwen3_next(seed=3)
    prompts = random_prompts([3, 20, 9], vocab=VOCAB)  # 20: the prefill spans two GDN chunks
    generated = {"tp2": _generate(tp, hf, prompts)}
    if rank == 0:
        generated["tp1"] = _generate(ref_groups, hf, prompts)
        generated["hf"] = _hf_generate(hf, prompts)
    return parity, generated


def test_qwen3_next_matches_transformers_generates_and_tp_sp_equal_single_rank():
    (imported, exported, moved), generated = run_distributed(_body, 2)[0]
    assert imported < HF_MAX_ABS, ("HF weights imported", imported)
    assert exported < HF_MAX_ABS, ("our weights exported", exported)
    for feature, diff in moved.items():
        assert diff > 1e-3, f"{feature}: logits unchanged ({diff:.3g})"
    assert generated["tp1"] == generated["hf"], generated
    assert generated["tp2"] == generated["hf"], generated
