"""Greedy generation equals Hugging Face ``generate(do_sample=False)`` (tiny random GPT-2 and Llama).

A batch of three prompts of different lengths; each HF reference generates its prompt alone. The
same on one rank, under TP=2 and under PP=2 (two gloo ranks each), where every rank must return
the same results.
"""

import pytest

from megatron.core import parallel_state as ps
from megatron.core.inference.engine import InferenceEngine
from megatron.core.inference.sampling_params import SamplingParams
from tests.dist_harness import run_distributed
from tests.unit_tests.inference.hf_models import hf_greedy, hf_model, our_model, random_prompts

NEW_TOKENS = 10


def _greedy_body(rank, world_size, tp, pp):
    groups = ps.initialize_model_parallel(tp, pp)
    prompts = random_prompts([3, 9, 6])
    report = {}
    for kind in ("gpt2", "llama"):
        hf = hf_model(kind)
        engine = InferenceEngine(our_model(hf, groups), groups)
        results = engine.generate(prompts, SamplingParams(temperature=0.0, num_tokens_to_generate=NEW_TOKENS))
        report[kind] = {
            "ours": [r.generated_tokens for r in results],
            "hf": hf_greedy(hf, prompts, NEW_TOKENS),
            "finish": [r.finish_reason for r in results],
        }
    return report


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_greedy_equals_hugging_face(tp, pp):
    reports = run_distributed(_greedy_body, tp * pp, tp, pp)
    for rank, report in enumerate(reports):
        assert report == reports[0], f"rank {rank} returned other results than rank 0"
    for kind, got in reports[0].items():
        assert got["ours"] == got["hf"], f"{kind} tp={tp} pp={pp}: ours {got['ours']} != HF {got['hf']}"
        assert got["finish"] == ["length"] * 3
