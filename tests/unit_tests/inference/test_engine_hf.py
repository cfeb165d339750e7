"""Greedy generation equals Hugging Face ``generate(do_sample=False)`` (tiny random GPT-2 and Llama).

A batch of three prompts of different lengths; each HF reference generates its prompt alone. The
same on one rank, and under TP=2 and PP=2 (both layouts in one spawned group of two gloo ranks),
where every rank must return the same results. Under TP/PP, seeded sampling with log-probabilities
and a greedy run with a stop token must also equal a single-rank engine over the same weights
(tokens exactly, log-probs 1e-5). A sliding window (ours exported to Mistral) equals Mistral's greedy.
"""

import pytest
import torch
import transformers

from megatron.core import parallel_state as ps
from megatron.core.inference.engine import InferenceEngine
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.models.gpt.hf_state_dict import to_hf_llama
from megatron.core.parallel_state import ParallelLayout, build_process_groups
from tests.dist_harness import run_distributed
from tests.model_utils import VOCAB, build_gpt, llama_style, single_rank_groups
from tests.unit_tests.inference.hf_models import hf_greedy, hf_model, our_model, random_prompts

NEW_TOKENS = 10


def _greedy_body(rank, world_size, layouts):
    return {(tp, pp): _greedy_reports(tp, pp) for tp, pp in layouts}


def _greedy_reports(tp, pp):
    groups = build_process_groups(ParallelLayout(tp * pp, tp, pp))
    prompts = random_prompts([3, 9, 6])
    report = {}
    for kind in ("gpt2", "llama"):
        hf = hf_model(kind, seed=1)
        engine = InferenceEngine(our_model(hf, groups), groups)
        results = engine.generate(prompts, SamplingParams(temperature=0.0, num_tokens_to_generate=NEW_TOKENS))
        report[kind] = {
            "ours": [r.generated_tokens for r in results],
            "hf": hf_greedy(hf, prompts, NEW_TOKENS),
            "finish": [r.finish_reason for r in results],
        }
        if tp * pp > 1:
            reference = InferenceEngine(our_model(hf, single_rank_groups()), single_rank_groups())
            stop = report[kind]["hf"][1][4]
            for params in (
                SamplingParams(temperature=0.8, top_k=20, seed=11, num_tokens_to_generate=NEW_TOKENS),
                SamplingParams(temperature=0.0, stop_token_ids=(stop,), num_tokens_to_generate=NEW_TOKENS),
            ):
                params.return_log_probs = True
                _assert_same(engine.generate(prompts, params), reference.generate(prompts, params), f"{kind} {params}")
    return report


def _assert_same(results, expected, what):
    for r, e in zip(results, expected):
        assert (r.generated_tokens, r.finish_reason) == (e.generated_tokens, e.finish_reason), what
        for field in ("prompt_log_probs", "generated_log_probs"):
            got, want = torch.tensor(getattr(r, field)), torch.tensor(getattr(e, field))
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{what} {field}: {m}")
    assert any(e.finish_reason == "stop" for e in expected) or "stop_token_ids=()" in what, what


# Both in the full tier: test_engine_tp2_pp2.py runs this body under TP=2 x PP=2 (greedy equals HF, and
# sampling and the stop token equal a one-rank engine, which [one-rank] alone checked against HF).
@pytest.mark.parametrize(
    "layouts",
    [pytest.param([(1, 1)], id="one-rank", marks=pytest.mark.full), pytest.param([(2, 1), (1, 2)], id="tp2-and-pp2")],
)
def test_greedy_equals_hugging_face(layouts):
    world_size = layouts[0][0] * layouts[0][1]
    reports = run_distributed(_greedy_body, world_size, layouts)
    for rank, report in enumerate(reports):
        assert report == reports[0], f"rank {rank} returned other results than rank 0"
    for (tp, pp), kinds in reports[0].items():
        for kind, got in kinds.items():
            assert got["ours"] == got["hf"], f"{kind} tp={tp} pp={pp}: ours {got['ours']} != HF {got['hf']}"
            assert got["finish"] == ["length"] * 3


def _mistral_body(rank, world_size):
    """Sliding-window attention (window 4) over the KV cache against Mistral's own cache."""
    groups = ps.initialize_model_parallel(1, 1)
    ours = build_gpt(llama_style(window_size=(3, 0), max_sequence_length=32, init_method_std=0.2), groups).eval()
    hf = transformers.MistralForCausalLM(
        transformers.MistralConfig(
            vocab_size=VOCAB,
            hidden_size=ours.config.hidden_size,
            intermediate_size=ours.config.ffn_hidden_size,
            num_hidden_layers=ours.config.num_layers,
            num_attention_heads=ours.config.num_attention_heads,
            num_key_value_heads=ours.config.num_query_groups,
            max_position_embeddings=32,
            rms_norm_eps=ours.config.layernorm_epsilon,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            sliding_window=4,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=None,
        )
    ).eval()
    hf.load_state_dict(to_hf_llama(ours.state_dict(), ours.config), strict=True)
    prompts = random_prompts([3, 9, 6])
    results = InferenceEngine(ours, groups).generate(
        prompts, SamplingParams(temperature=0.0, num_tokens_to_generate=12)
    )
    return [r.generated_tokens for r in results], hf_greedy(hf, prompts, 12)


def test_sliding_window_equals_mistral():
    ours, hf = run_distributed(_mistral_body, 1)[0]
    assert ours == hf, f"ours {ours} != Mistral {hf}"
