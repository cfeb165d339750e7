"""The dynamic engine (continuous batching, paged KV cache) against the static engine and ``transformers``.

A mixed workload of 32 prompts (1 to 20 tokens, some longer than the step's token budget, so chunked
prefill) arrives in three waves while earlier requests are running; only 8 run at once and the block
pool is small, so requests wait for slots and blocks. Every request's greedy tokens must equal the
static engine's (all 32 in one batch) and a Hugging Face greedy loop (full recompute, no cache); with
log-probabilities, those of the static engine (atol 1e-5), and the top-n alternatives those of a full
forward. Seeded sampling gives the same tokens whatever the arrival order. Prefix caching: a prompt
sharing 3 full blocks with a finished one reuses them (counted) and computes 12 fewer prompt positions,
with unchanged output. A sliding window equals the static engine's. TP=2 and PP=2 (one spawned pair of
gloo ranks): greedy equals HF, seeded sampling equals one rank's dynamic engine.
"""

import torch

from megatron.core.inference import InferenceEngine, SamplingParams
from megatron.core.inference.dynamic_context import DynamicInferenceContext
from megatron.core.inference.dynamic_engine import DynamicInferenceEngine
from megatron.core.parallel_state import ParallelLayout, build_process_groups
from tests.dist_harness import run_distributed
from tests.model_utils import build_gpt, llama_style, single_rank_groups
from tests.unit_tests.inference.hf_models import hf_model, our_model, random_prompts

NEW = 8
LENGTHS = [1 + (7 * i) % 20 for i in range(32)]  # 1 .. 20 tokens, mixed order
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=NEW)


def dynamic_engine(model, groups, **overrides):
    """A small pool (block 4, 8 requests, 16 tokens per step): requests queue, prompts are chunked."""
    c = model.config
    kw = dict(max_requests=8, max_tokens=16, block_size_tokens=4)
    kw.update(overrides)
    length = kw.pop("max_sequence_length", 32)
    context = DynamicInferenceContext(
        c.params_dtype, c.num_layers, c.kv_channels, c.num_query_groups, length, 1e-4, **kw
    )
    return DynamicInferenceEngine(model, context, pg_collection=groups)


def run_waves(engine, prompts, params, waves=(10, 20)):
    """Add ``prompts`` in waves (the first ``waves[0]``, two steps later up to ``waves[1]`` ...), run to the end."""
    requests, start = [], 0
    for end in (*waves, len(prompts)):
        requests += [engine.add_request(None, p, params) for p in prompts[start:end]]
        start = end
        for _ in range(2):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    return requests


def hf_greedy_loop(hf, prompts, new_tokens):
    """Greedy continuation of each prompt by HF forwards of the whole left-padded batch (no KV cache)."""
    seqs = [list(p) for p in prompts]
    for _ in range(new_tokens):
        width = max(len(s) for s in seqs)
        ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs])  # [b, width]
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]  # [b, V]
        for s, token in zip(seqs, logits.argmax(-1).tolist()):
            s.append(token)
    return [s[len(p) :] for s, p in zip(seqs, prompts)]


def _check_greedy(kind, groups):
    hf = hf_model(kind, seed=1)
    model = our_model(hf, groups)
    prompts = random_prompts(LENGTHS)
    engine = dynamic_engine(model, groups)
    ours = [r.generated_tokens for r in run_waves(engine, prompts, GREEDY)]
    static = [r.generated_tokens for r in InferenceEngine(model, groups).generate(prompts, GREEDY)]
    assert ours == static, f"{kind}: dynamic != static"
    assert ours == hf_greedy_loop(hf, prompts, NEW), f"{kind}: dynamic != HF"
    assert engine.context.allocator.usage()[0] == 0, "blocks still held after every request finished"
    return model, engine


def _check_log_probs(model, groups):
    """Log-probabilities equal the static engine's; the top-n alternatives equal a full forward's."""
    prompts = random_prompts(LENGTHS[:12], seed=3)
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=NEW, return_log_probs=True, top_n_logprobs=3)
    ours = run_waves(dynamic_engine(model, groups), prompts, params, waves=(5,))
    params.top_n_logprobs = 0
    static = InferenceEngine(model, groups).generate(prompts, params)
    for r, s in zip(ours, static):
        assert r.generated_tokens == s.generated_tokens
        for got, want in ((r.prompt_log_probs, s.prompt_log_probs), (r.generated_log_probs, s.generated_log_probs)):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-5)
        tokens = torch.tensor([r.tokens])  # [1, s]
        with torch.no_grad():
            full = torch.log_softmax(model(tokens)[0, :-1].float(), -1).topk(3, -1)  # [s-1, 3]
        tops = r.prompt_top_n_logprobs + r.generated_top_n_logprobs
        assert [list(t) for t in tops] == full.indices.tolist()
        torch.testing.assert_close(torch.tensor([list(t.values()) for t in tops]), full.values, rtol=0, atol=1e-5)


def _check_sampling(model, groups):
    """Seeded sampling: the same tokens in waves or all at once, other tokens than greedy."""
    prompts = random_prompts(LENGTHS[:16], seed=4)
    params = SamplingParams(temperature=1.0, top_k=20, seed=9, num_tokens_to_generate=NEW)
    waves = [r.generated_tokens for r in run_waves(dynamic_engine(model, groups), prompts, params, waves=(3, 9))]
    at_once = [r.generated_tokens for r in dynamic_engine(model, groups).generate(prompts, params)]
    assert waves == at_once
    assert waves != [r.generated_tokens for r in dynamic_engine(model, groups).generate(prompts, GREEDY)]
    return waves


def _check_prefix_caching(model, groups):
    """A second prompt sharing 3 full blocks (12 tokens) with a finished one takes them from the cache."""
    first, second = random_prompts([15, 5], seed=5)
    second = first[:12] + second
    engine = dynamic_engine(model, groups)
    engine.generate([first], GREEDY)
    before = engine.prefill_tokens
    (result,) = engine.generate([second], GREEDY)
    assert engine.context.allocator.reused_blocks == 3
    assert engine.prefill_tokens - before == len(second) - 12
    uncached = dynamic_engine(model, groups, enable_prefix_caching=False)
    assert result.generated_tokens == uncached.generate([second], GREEDY)[0].generated_tokens
    assert uncached.context.allocator.reused_blocks == 0


def _check_stop_and_abort(model, groups):
    prompts = random_prompts([4, 7], seed=6)
    engine = dynamic_engine(model, groups)
    full = [r.generated_tokens for r in engine.generate(prompts, GREEDY)]
    stop = full[1][2]
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=NEW, stop_token_ids=(stop,))
    stopped = engine.generate(prompts, params)
    assert stopped[1].generated_tokens == full[1][: full[1].index(stop) + 1] and stopped[1].finish_reason == "stop"
    request = engine.add_request(None, prompts[0], GREEDY)
    engine.step()
    engine.abort_request(request.request_id)
    assert request.finish_reason == "abort" and not engine.has_unfinished_requests()
    assert engine.context.allocator.usage()[0] == 0


def _check_sliding_window(groups):
    """A sliding window (4 keys) over the right-aligned paged keys equals the static cache's."""
    model = build_gpt(llama_style(window_size=(3, 0), max_sequence_length=32, init_method_std=0.2), groups).eval()
    prompts = random_prompts(LENGTHS[:10], seed=8)
    ours = [r.generated_tokens for r in run_waves(dynamic_engine(model, groups), prompts, GREEDY, (4,))]
    assert ours == [r.generated_tokens for r in InferenceEngine(model, groups).generate(prompts, GREEDY)]


def _one_rank_body(rank, world_size):
    groups = single_rank_groups()
    _check_greedy("gpt2", groups)
    model, _ = _check_greedy("llama", groups)
    _check_log_probs(model, groups)
    _check_sampling(model, groups)
    _check_prefix_caching(model, groups)
    _check_stop_and_abort(model, groups)
    _check_sliding_window(groups)


def test_dynamic_engine_equals_static_and_hugging_face():
    run_distributed(_one_rank_body, 1)


def _parallel_body(rank, world_size):
    """TP=2 then PP=2: greedy equals HF and seeded sampling equals one rank's dynamic engine."""
    hf = hf_model("llama", seed=1)
    prompts = random_prompts(LENGTHS, seed=7)  # the whole 32-request workload
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3, num_tokens_to_generate=NEW)
    reference = dynamic_engine(our_model(hf, single_rank_groups()), single_rank_groups())
    expected = [r.generated_tokens for r in reference.generate(prompts, params)]
    report = {}
    for tp, pp in ((2, 1), (1, 2)):
        groups = build_process_groups(ParallelLayout(2, tp, pp))
        model = our_model(hf, groups)
        greedy = [r.generated_tokens for r in run_waves(dynamic_engine(model, groups), prompts, GREEDY, (4,))]
        sampled = [r.generated_tokens for r in dynamic_engine(model, groups).generate(prompts, params)]
        report[(tp, pp)] = greedy, sampled
    return report, hf_greedy_loop(hf, prompts, NEW), expected


def test_dynamic_engine_tp2_and_pp2():
    reports = run_distributed(_parallel_body, 2)
    assert reports[1][0] == reports[0][0], "the ranks returned different tokens"
    report, hf, expected = reports[0]
    for layout, (greedy, sampled) in report.items():
        assert greedy == hf, f"tp, pp = {layout}: greedy != HF"
        assert sampled == expected, f"tp, pp = {layout}: seeded sampling != one rank"
