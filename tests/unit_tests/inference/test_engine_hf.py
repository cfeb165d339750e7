"""Greedy generation equals Hugging Face ``generate(do_sample=False)`` (tiny random GPT-2 and Llama).

A batch of three prompts of different lengths; each HF reference generates its prompt alone. The
same on one rank, and under TP=2 and PP=2 (both layouts in one spawned group of two gloo ranks),
where every rank must return the same results. Under TP/PP, seeded sampling with log-probabilities
and a greedy run with a stop token must also equal a single-rank engine over the same weights
(tokens exactly, log-probs 1e-5).
"""

import pytest
import torch

from megatron.core.inference.engine import InferenceEngine
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.parallel_state import ParallelLayout, build_process_groups
from tests.dist_harness import run_distributed
from tests.model_utils import single_rank_groups
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


@pytest.mark.parametrize("layouts", [[(1, 1)], [(2, 1), (1, 2)]], ids=["one-rank", "tp2-and-pp2"])
def test_greedy_equals_hugging_face(layouts):
    world_size = layouts[0][0] * layouts[0][1]
    reports = run_distributed(_greedy_body, world_size, layouts)
    for rank, report in enumerate(reports):
        assert report == reports[0], f"rank {rank} returned other results than rank 0"
    for (tp, pp), kinds in reports[0].items():
        for kind, got in kinds.items():
            assert got["ours"] == got["hf"], f"{kind} tp={tp} pp={pp}: ours {got['ours']} != HF {got['hf']}"
            assert got["finish"] == ["length"] * 3
