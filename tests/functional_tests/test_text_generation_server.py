"""The text-generation server end to end, from a checkpoint ``pretrain_gpt.py`` trained.

Real HTTP requests (``urllib``) against the real server on one rank and on two (TP=2); answers are
compared with the engine and the model called in-process (``text_generation_reference.py``).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("flask")
pytest.importorskip("megatron.core.inference.engine", reason="the generation engine (branch is14-engine) is not merged")

from tests.functional_tests.text_generation_runs import REPO, ServerRanks, call, run_reference, train_checkpoint  # noqa: E402

PROMPTS = ["The function returns", "Return a new list of"]
LOSS_TEXTS = ["Return the value of the attribute if it exists.", "This module provides functions for files."]
MC_DIR = os.path.join(REPO, "tests", "fixtures", "lm_eval")
MC_JSONL = os.path.join(MC_DIR, "megatron_tiny_mc.jsonl")
GREEDY_TOKENS = 8
TIMEOUT_S = 300
SEED = 7


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(server flags, reference answers, work dir) for the checkpoint trained once for this module."""
    tmp = str(tmp_path_factory.mktemp("text_generation"))
    flags, ckpt = train_checkpoint(tmp)
    flags = flags + ["--load", ckpt]
    wanted = {
        "greedy": [{"prompt": p, "tokens": GREEDY_TOKENS, "seed": SEED} for p in PROMPTS],
        "loss_texts": LOSS_TEXTS,
        "mc_jsonl": MC_JSONL,
    }
    return flags, run_reference(flags, wanted, tmp), tmp


@pytest.fixture(scope="module")
def server(trained):
    flags, _, tmp = trained
    with ServerRanks(flags, tmp, world=1) as ranks:
        yield ranks
        assert ranks.terminate_all() == [0], ranks.output(0)[-3000:]


def completions(server, body):
    return call(server.url + "/v1/completions", "POST", body)


def api(server, body):
    return call(server.url + "/api", "PUT", body)


def test_greedy_answers_equal_the_engine_and_each_other(server, trained):
    _, reference, _ = trained
    status, answer = api(server, {"prompts": PROMPTS, "tokens_to_generate": GREEDY_TOKENS, "top_k": 1})
    assert status == 200, answer
    assert answer["text"] == [p + g for p, g in zip(PROMPTS, reference["greedy"])]
    status, answer = completions(server, {"prompt": PROMPTS, "max_tokens": GREEDY_TOKENS, "temperature": 0})
    assert status == 200, answer
    assert [c["text"] for c in answer["choices"]] == reference["greedy"]


def test_seeded_sampling_equals_the_engine_on_both_endpoints(server, trained):
    _, reference, _ = trained
    for prompt, expected in zip(PROMPTS, reference["sampled"]):
        body = {"prompts": [prompt], "tokens_to_generate": GREEDY_TOKENS, "temperature": 1.0, "random_seed": SEED}
        status, answer = api(server, body)
        assert status == 200 and answer["text"] == [prompt + expected], answer
        body = {"prompt": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 1.0, "seed": SEED}
        status, answer = completions(server, body)
        assert status == 200 and answer["choices"][0]["text"] == expected, answer


def test_echoed_prompt_logprobs_give_the_models_loss(server, trained):
    _, reference, _ = trained
    body = {"prompt": LOSS_TEXTS, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    status, answer = completions(server, body)
    assert status == 200, answer
    for choice, text, loss in zip(answer["choices"], LOSS_TEXTS, reference["losses"]):
        lps = choice["logprobs"]["token_logprobs"]
        assert choice["text"] == text and lps[0] is None
        assert -sum(lps[1:]) / len(lps[1:]) == pytest.approx(loss, abs=1e-4)


def test_malformed_requests_get_400_and_the_server_keeps_serving(server):
    bad = [
        call(server.url + "/api", "PUT", raw=b"{not json"),
        api(server, {"prompts": ["x"], "tokens_to_generate": -1}),
        api(server, {"prompts": ["x"], "bogus": 1}),
        api(server, {"prompts": [1, 2]}),
        completions(server, {"prompt": "x", "max_tokens": 64}),  # 1 + 64 > 64 positions
        completions(server, {"prompt": "x", "temperature": "hot"}),
    ]
    for status, answer in bad:
        assert status == 400 and answer["error"]["message"], answer
    status, answer = completions(server, {"prompt": "Return", "max_tokens": 2, "temperature": 0})
    assert status == 200 and answer["choices"][0]["finish_reason"] in ("length", "stop")


def test_cli_prints_the_greedy_text(server, trained):
    _, reference, _ = trained
    cmd = [sys.executable, os.path.join(REPO, "tools", "text_generation_cli.py"), server.url.split("//")[1]]
    cmd += ["--prompt", PROMPTS[0], "--tokens-to-generate", str(GREEDY_TOKENS), "--greedy"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=True).stdout
    assert out == PROMPTS[0] + reference["greedy"][0] + "\n"


def test_lm_eval_accuracy_equals_scoring_with_the_engine(server, trained):
    pytest.importorskip("lm_eval")
    _, reference, tmp = trained
    hf_tokenizer = write_hf_tokenizer(trained[0], os.path.join(tmp, "hf_tokenizer"))
    out_dir = os.path.join(tmp, "lm_eval_out")
    model_args = f"base_url={server.url}/v1/completions,tokenizer_backend=huggingface,tokenizer={hf_tokenizer}"
    model_args += ",max_length=63,num_concurrent=4,max_retries=1,model=tiny"  # batched by the engine
    cmd = [os.path.join(os.path.dirname(sys.executable), "lm_eval"), "--model", "local-completions"]
    cmd += ["--model_args", model_args, "--tasks", "megatron_tiny_mc", "--include_path", MC_DIR]
    cmd += ["--output_path", out_dir, "--batch_size", "1", "--log_samples"]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["HF_DATASETS_CACHE"] = os.path.join(tmp, "hf_datasets")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    (results_file,) = glob.glob(os.path.join(out_dir, "**", "results_*.json"), recursive=True)
    with open(results_file) as f:
        accuracy = json.load(f)["results"]["megatron_tiny_mc"]["acc,none"]
    scores, answers = reference["mc_scores"], reference["mc_answers"]
    (samples_file,) = glob.glob(os.path.join(out_dir, "**", "samples_megatron_tiny_mc_*.jsonl"), recursive=True)
    with open(samples_file) as f:
        samples = sorted((json.loads(line) for line in f if line.strip()), key=lambda s: s["doc_id"])
    lm_eval_scores = [[float(resp[0]) for resp in sample["filtered_resps"]] for sample in samples]
    assert len(lm_eval_scores) == len(scores)
    for got, want in zip(lm_eval_scores, scores):  # the same tokens scored: lm-eval's tokenizer agrees with ours
        assert got == pytest.approx(want, abs=1e-4)
    expected = sum(max(range(len(s)), key=s.__getitem__) == a for s, a in zip(scores, answers)) / len(answers)
    assert accuracy == pytest.approx(expected)


def _lm_eval_chat(server, tmp: str, concurrent: int):
    """lm-eval's ``local-chat-completions`` on ``megatron_tiny_gen``: (exact-match score, each doc's response)."""
    out_dir = os.path.join(tmp, f"lm_eval_chat_{concurrent}")
    model_args = f"base_url={server.url}/v1/chat/completions,model=tiny,num_concurrent={concurrent},max_retries=1"
    cmd = [os.path.join(os.path.dirname(sys.executable), "lm_eval"), "--model", "local-chat-completions"]
    cmd += ["--model_args", model_args, "--tasks", "megatron_tiny_gen", "--include_path", MC_DIR]
    cmd += ["--apply_chat_template", "--output_path", out_dir, "--log_samples"]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["HF_DATASETS_CACHE"] = os.path.join(tmp, "hf_datasets")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    (results_file,) = glob.glob(os.path.join(out_dir, "**", "results_*.json"), recursive=True)
    with open(results_file) as f:
        score = json.load(f)["results"]["megatron_tiny_gen"]["exact_match,none"]
    (samples_file,) = glob.glob(os.path.join(out_dir, "**", "samples_megatron_tiny_gen_*.jsonl"), recursive=True)
    with open(samples_file) as f:
        samples = sorted((json.loads(line) for line in f if line.strip()), key=lambda s: s["doc_id"])
    return score, [sample["resps"] for sample in samples]


def test_lm_eval_chat_completions_concurrent_equal_sequential(server, trained):
    """The chat endpoint under lm-eval: four concurrent requests batched by the engine answer each document
    exactly as one request at a time does (greedy), so the scores are equal."""
    pytest.importorskip("lm_eval")
    tmp = trained[2]
    concurrent_score, concurrent = _lm_eval_chat(server, tmp, 4)
    sequential_score, sequential = _lm_eval_chat(server, tmp, 1)
    assert len(concurrent) == 10 and concurrent == sequential
    assert all(r[0][0] for r in concurrent), concurrent  # every document got text (this tiny model: newlines)
    assert concurrent_score == sequential_score


def write_hf_tokenizer(flags, directory: str) -> str:
    """The test's GPT-2 BPE files as a directory ``transformers.AutoTokenizer`` loads (lm-eval tokenizes with it)."""
    os.makedirs(directory, exist_ok=True)
    for flag, name in (("--vocab-file", "vocab.json"), ("--merge-file", "merges.txt")):
        with open(flags[flags.index(flag) + 1], "rb") as src, open(os.path.join(directory, name), "wb") as dst:
            dst.write(src.read())
    eod = "<|endoftext|>"
    config = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "bos_token": eod, "eos_token": eod}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({**config, "unk_token": eod, "model_max_length": 64}, f)
    return directory


def test_two_ranks_tensor_parallel_answer_like_one_and_stop_on_sigterm(trained):
    flags, reference, tmp = trained
    tp_dir = os.path.join(tmp, "tp2")
    os.makedirs(tp_dir, exist_ok=True)
    # Served as the README does it, without --use-cpu-initialization: TP layers then initialise (before the
    # checkpoint overwrites them) from the run's model-parallel RNG stream, which must be installed.
    served = [f for f in flags if f != "--use-cpu-initialization"] + ["--tensor-model-parallel-size", "2"]
    with ServerRanks(served, tp_dir, world=2) as ranks:
        status, answer = completions(ranks, {"prompt": PROMPTS, "max_tokens": GREEDY_TOKENS, "temperature": 0})
        assert status == 200, answer
        assert [c["text"] for c in answer["choices"]] == reference["greedy"]
        assert api(ranks, {"prompts": ["x"], "tokens_to_generate": -5})[0] == 400
        body = {"prompt": LOSS_TEXTS[:1], "max_tokens": 0, "echo": True, "logprobs": 0}
        lps = completions(ranks, body)[1]["choices"][0]["logprobs"]["token_logprobs"][1:]
        assert -sum(lps) / len(lps) == pytest.approx(reference["losses"][0], abs=1e-4)
        codes = ranks.terminate_all(timeout=60)
        assert codes == [0, 0], [ranks.output(r)[-2000:] for r in range(2)]
