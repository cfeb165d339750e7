"""Sampling, stop tokens, log-probabilities and argument checks of ``InferenceEngine.generate`` (one rank).

Log-probabilities must equal log_softmax of the model's own full-recompute logits (atol 1e-5), and the
prompt's ("echo") reproduce the per-token training loss of the ``labels=`` path.
"""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.inference import InferenceEngine, SamplingParams
from megatron.core.inference.sampling import sample_tokens
from tests.dist_harness import run_distributed
from tests.model_utils import VOCAB, build_gpt, gpt2_style, llama_style
from tests.unit_tests.inference.hf_models import random_prompts

ATOL = 1e-5
LENGTHS = [3, 9, 6]


def _engine(groups):
    model = build_gpt(llama_style(max_sequence_length=32, init_method_std=0.2), groups).eval()
    return model, InferenceEngine(model, groups)


def _check_log_probs(model, results):
    """Every returned log-probability against log_softmax of a full forward of prompt + generated tokens."""
    for r in results:
        tokens = torch.tensor([r.prompt_tokens + r.generated_tokens])  # [1, s]
        with torch.no_grad():
            expected = torch.log_softmax(model(tokens)[0, :-1].float(), -1)  # [s-1, V]
        expected = expected.gather(-1, tokens[0, 1:, None])[:, 0].tolist()  # log p(token i | before), i >= 1
        n = len(r.prompt_tokens)
        assert len(r.prompt_log_probs) == n - 1 and len(r.generated_log_probs) == len(r.generated_tokens)
        torch.testing.assert_close(torch.tensor(r.prompt_log_probs), torch.tensor(expected[: n - 1]), rtol=0, atol=ATOL)
        torch.testing.assert_close(
            torch.tensor(r.generated_log_probs), torch.tensor(expected[n - 1 :]), rtol=0, atol=ATOL
        )


def _echo_matches_loss(model, engine, prompts):
    """num_tokens_to_generate=0: mean(-prompt log-probs) equals the mean per-token loss of ``labels=``."""
    results = engine.generate(prompts, SamplingParams(num_tokens_to_generate=0, return_log_probs=True))
    for prompt, r in zip(prompts, results):
        assert r.generated_tokens == [] and r.generated_log_probs == [] and r.finish_reason == "length"
        tokens = torch.tensor([prompt])
        with torch.no_grad():
            loss = model(tokens[:, :-1], labels=tokens[:, 1:])  # [1, s-1]
        echo = -torch.tensor(r.prompt_log_probs).mean()
        torch.testing.assert_close(echo, loss.mean(), rtol=0, atol=ATOL)


def _log_probs_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    model, engine = _engine(groups)
    prompts = random_prompts(LENGTHS)
    for params in (
        SamplingParams(temperature=0.0, num_tokens_to_generate=7, return_log_probs=True),
        SamplingParams(temperature=1.3, top_p=0.9, seed=5, num_tokens_to_generate=7, return_log_probs=True),
    ):
        _check_log_probs(model, engine.generate(prompts, params))
    _echo_matches_loss(model, engine, prompts + [[5, 6]])


def test_log_probs_match_model_logits_and_loss():
    run_distributed(_log_probs_body, 1)


def _tokens(engine, prompts, **params):
    return [r.generated_tokens for r in engine.generate(prompts, SamplingParams(num_tokens_to_generate=8, **params))]


def _sampling_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    _, engine = _engine(groups)
    prompts = random_prompts(LENGTHS)
    greedy = _tokens(engine, prompts, temperature=0.0)
    assert _tokens(engine, prompts, top_k=1) == greedy
    assert _tokens(engine, prompts, top_p=1e-6, seed=3) == greedy
    sampled = _tokens(engine, prompts, temperature=1.0, seed=7)
    assert _tokens(engine, prompts, temperature=1.0, seed=7) == sampled
    assert sampled != greedy and _tokens(engine, prompts, temperature=1.0, seed=8) != sampled
    assert _tokens(engine, prompts, top_k=5, seed=7) == _tokens(engine, prompts, top_k=5, seed=7)
    return greedy


def _stop_body(rank, world_size):
    """A stop token ends the sequences that emit it (included, finish "stop"); the others run on."""
    groups = ps.initialize_model_parallel(1, 1)
    _, engine = _engine(groups)
    prompts = random_prompts(LENGTHS)
    greedy = _tokens(engine, prompts, temperature=0.0)
    stop = greedy[1][2]
    results = engine.generate(
        prompts, SamplingParams(temperature=0.0, num_tokens_to_generate=8, stop_token_ids=(stop,))
    )
    for full, r in zip(greedy, results):
        if stop in full:
            assert r.generated_tokens == full[: full.index(stop) + 1] and r.finish_reason == "stop"
        else:
            assert r.generated_tokens == full and r.finish_reason == "length"
    assert results[1].finish_reason == "stop" and len(results[1].generated_tokens) <= 3
    return [r.finish_reason for r in results]


def test_sampling_seeds_and_greedy_limits():
    run_distributed(_sampling_body, 1)


def test_stop_token_stops_that_sequence_only():
    reasons = run_distributed(_stop_body, 1)[0]
    assert "length" in reasons, f"the stop token ended every sequence ({reasons}): the test shows nothing"


def test_top_k_and_top_p_keep_only_their_tokens():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))  # [b, V]
    top5 = torch.topk(logits, 5, dim=-1).indices  # [b, 5]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_tokens(logits, SamplingParams(top_k=5), g) for _ in range(200)], 1)  # [b, 200]
    assert all(set(draws[j].tolist()) <= set(top5[j].tolist()) for j in range(4))
    probs = torch.softmax(logits, -1)
    sorted_probs, order = torch.sort(probs, -1, descending=True)
    nucleus = [order[j, : int((torch.cumsum(sorted_probs[j], 0) < 0.5).sum()) + 1].tolist() for j in range(4)]
    draws = torch.stack([sample_tokens(logits, SamplingParams(top_p=0.5), g) for _ in range(200)], 1)
    assert all(set(draws[j].tolist()) <= set(nucleus[j]) for j in range(4))
    assert all(len(set(draws[j].tolist())) > 1 for j in range(4) if len(nucleus[j]) > 1)


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-30])
def test_vanishing_temperature_takes_the_argmax_instead_of_non_finite_probabilities(temperature):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1)) * 1e9  # [b, V]
    logits[1] = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2))  # finite at T=1e-30: sampled
    with pytest.raises(RuntimeError):  # what the guard prevents: softmax of overflowed logits
        torch.multinomial(torch.softmax(logits / temperature, -1), 1)
    params = SamplingParams(temperature=temperature)
    tokens = sample_tokens(logits, params, torch.Generator().manual_seed(0))  # [b]
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert tokens[1] == logits[1].argmax()  # the limit T -> 0; for 1e-30 row 1 is a sharp softmax, argmax too


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature=-0.1"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(top_p=-0.1), "top_p=-0.1"),
        (dict(top_k=3, top_p=0.5), "top_k=3 and top_p=0.5"),
        (dict(num_tokens_to_generate=-1), "num_tokens_to_generate=-1"),
    ],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def _engine_errors_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    model, engine = _engine(groups)
    params = SamplingParams(num_tokens_to_generate=10)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], params)
    with pytest.raises(ValueError, match="prompt 0 has 23 tokens.*max_sequence_length=32"):
        engine.generate([[1] * 23], params)
    assert len(engine.generate([[1] * 22], params)[0].generated_tokens) == 10  # 22 + 10 = 32 fits
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, VOCAB]], params)
    with pytest.raises(ValueError, match="max_sequence_length=8"):
        InferenceEngine(model, groups, max_sequence_length=8).generate([[1, 2]], params)
    assert engine.generate([], params) == []
    with pytest.raises(NotImplementedError, match="2 model chunks"):
        InferenceEngine([model, model], groups)
    with pytest.raises(TypeError, match="must be SamplingParams"):
        engine.generate([[1, 2]], {"temperature": 0.0})
    with pytest.raises(ValueError, match="max_sequence_length=64 exceeds the model's 16 learned positions"):
        InferenceEngine(build_gpt(gpt2_style(), groups).eval(), groups, max_sequence_length=64)
    params.top_k = -2  # edited after construction: generate checks again
    with pytest.raises(ValueError, match="top_k=-2"):
        engine.generate([[1, 2]], params)
    params.top_k = 0
    model.train()
    with pytest.raises(ValueError, match="model.eval"):
        engine.generate([[1, 2]], params)


def _padded_vocab_body(rank, world_size):
    """With the tokenizer's ``vocab_size`` the padded ids (boosted here so they would win) are never chosen:
    greedy tokens equal a full-recompute loop's argmax over the first ``vocab_size`` logits, and log-probs
    stay normalized over the whole padded vocabulary (the training loss's distribution)."""
    groups = ps.initialize_model_parallel(1, 1)
    model, _ = _engine(groups)
    with torch.no_grad():
        model.output_layer.weight[100:] *= 5
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=6, return_log_probs=True)
    prompts = random_prompts(LENGTHS, vocab=100)
    unrestricted = InferenceEngine(model, groups).generate(prompts, params)
    assert any(t >= 100 for r in unrestricted for t in r.generated_tokens), "padding never wins: nothing tested"
    for prompt, r in zip(prompts, InferenceEngine(model, groups, vocab_size=100).generate(prompts, params)):
        tokens, log_probs = list(prompt), []
        for _ in range(6):
            with torch.no_grad():
                logits = model(torch.tensor([tokens]))[0, -1].float()  # [128], padded
            tokens.append(int(logits[:100].argmax()))
            log_probs.append(torch.log_softmax(logits, -1)[tokens[-1]].item())
        assert r.generated_tokens == tokens[len(prompt) :]
        torch.testing.assert_close(torch.tensor(r.generated_log_probs), torch.tensor(log_probs), rtol=1e-5, atol=ATOL)
    with pytest.raises(ValueError, match="outside the vocabulary \\[0, 100\\)"):
        InferenceEngine(model, groups, vocab_size=100).generate([[1, 100]], params)
    with pytest.raises(ValueError, match="vocab_size=129 must be in \\[1, 128\\]"):
        InferenceEngine(model, groups, vocab_size=129)


def test_padded_vocabulary_never_sampled():
    run_distributed(_padded_vocab_body, 1)


def test_generate_rejects_bad_prompts_before_any_work():
    run_distributed(_engine_errors_body, 1)
