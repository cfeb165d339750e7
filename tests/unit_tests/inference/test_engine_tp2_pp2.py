"""Greedy generation under TP=2 x PP=2 (four gloo ranks) equals Hugging Face, and sampling with log-probs
and stop tokens equals one rank: the tokens chosen on the last stage's TP rank 0 cross both hops."""

from tests.dist_harness import run_distributed
from tests.unit_tests.inference.test_engine_hf import _greedy_body


def test_tp2_pp2_equals_hugging_face():
    reports = run_distributed(_greedy_body, 4, [(2, 2)])
    for rank, report in enumerate(reports):
        assert report == reports[0], f"rank {rank} returned other results than rank 0"
    for kind, got in reports[0][(2, 2)].items():
        assert got["ours"] == got["hf"], f"{kind} tp=2 pp=2: ours {got['ours']} != HF {got['hf']}"
