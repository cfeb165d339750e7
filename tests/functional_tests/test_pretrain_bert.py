"""pretrain_bert.py end to end on CPU ranks: a sentence-split corpus, layout invariance, Megatron's example flags.

Each run is a real ``torchrun`` launch of the entry point. The same global batch with CPU
initialization and dropout off must print the one-rank ``lm loss`` and ``sop loss`` for TP=2,
TP=2 with sequence parallelism, PP=2 and DP=2 with the distributed optimizer (relative 2e-6: the
printed 7 digits but for last-digit float noise).
"""

import os
import subprocess
import sys

import pytest

from tests.functional_tests.gpt_runs import (
    REPO,
    RUN_TIMEOUT_S,
    assert_ok,
    build_sentence_corpus,
    free_port,
    parse_run,
    run_gpt,
    tiny_gpt_flags,
)

ITERS = 6
REL_TOL = 2e-6
BERT = [os.path.join(REPO, "pretrain_bert.py")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_sentence_corpus(str(tmp_path_factory.mktemp("bert_corpus")))


def bert_flags(corpus, iters: int = ITERS):
    """The tiny layout-invariant model of the GPT tests (2 layers, hidden 32), on the BERT corpus."""
    data = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", corpus["vocab_file"]]
    data += ["--data-path", corpus["data_prefix"], "--split", "90,5,5"]
    return tiny_gpt_flags(iters) + data


def run_bert(nproc, flags, cwd):
    return run_gpt(nproc, flags, cwd, script=BERT)


def _assert_same_losses(reference, other, what):
    assert len(other.lines) == len(reference.lines) == ITERS, what
    for ref, got in zip(reference.lines, other.lines):
        for key in ("lm loss", "sop loss"):
            assert got[key] == pytest.approx(ref[key], rel=REL_TOL), (what, key, ref, got)


LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2": ["--use-distributed-optimizer"],
}


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    result = run_bert(1, bert_flags(corpus), str(tmp_path_factory.mktemp("bert_single")))
    assert_ok(result, "BERT on one rank")
    return result


def test_one_rank_trains_and_logs_both_losses(single):
    first, last = single.lines[0], single.lines[-1]
    assert "sop loss" in first and "lm loss" in first
    assert last["lm loss"] < first["lm loss"], [line["lm loss"] for line in single.lines]
    assert "validation loss at" in single.output and "sop loss value" in single.output


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_print_the_one_rank_losses(layout, single, corpus, tmp_path):
    result = run_bert(2, bert_flags(corpus) + LAYOUTS[layout], str(tmp_path))
    assert_ok(result, f"BERT {layout}")
    _assert_same_losses(single, result, f"BERT {layout} vs one rank")


def test_no_binary_head_and_mock_data(corpus, tmp_path):
    tokenizer = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", corpus["vocab_file"]]
    flags = tiny_gpt_flags(3) + ["--mock-data"] + tokenizer
    result = run_bert(2, flags + ["--bert-no-binary-head", "--tensor-model-parallel-size", "2"], str(tmp_path))
    assert_ok(result, "BERT mock data without binary head")
    assert all("sop loss" not in line for line in result.lines) and len(result.lines) == 3


def test_megatron_example_script_scaled_down(corpus, tmp_path):
    """examples/bert/train_bert_340m_distributed.sh (Megatron's flags: fp16, PP) with CPU sizes from the environment."""
    sizes = dict(GPUS_PER_NODE="2", NUM_LAYERS="2", HIDDEN="32", HEADS="4", SEQ="64", MBS="2", GBS="8", ITERS="3")
    sizes.update(DECAY_ITERS="3", TP="1", PP="2", LOG_INTERVAL="1", SAVE_INTERVAL="3", EVAL_INTERVAL="2")
    env = dict(os.environ, **sizes, OMP_NUM_THREADS="1", PYTHONPATH=REPO, MASTER_PORT=str(free_port()))
    # The script evaluates 10 iterations at each evaluation (3 here: at 2 and valid+test at the end); one is
    # enough to run the evaluation path (a later flag wins).
    env.update(EXTRA="--num-workers 0 --eval-iters 1", TORCHRUN=f"{sys.executable} -m torch.distributed.run")
    script = os.path.join(REPO, "examples", "bert", "train_bert_340m_distributed.sh")
    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    cmd = ["bash", script, ckpt, tb, corpus["vocab_file"], corpus["data_prefix"]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    parsed = parse_run(proc.returncode, output)
    assert len(parsed.lines) == 3
    evaluations = parsed.evaluations
    assert [e for e in evaluations if e.get("iteration") == 2], output[-6000:]  # EVAL_INTERVAL=2
    assert os.path.exists(os.path.join(ckpt, "iter_0000003", "metadata.json"))


def test_corpus_without_sentence_split_is_refused_before_training(corpus, tmp_path):
    vocab = corpus["vocab_file"]
    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", corpus["jsonl"]]
    cmd += ["--output-prefix", str(tmp_path / "d"), "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab]
    subprocess.run(cmd + ["--workers", "1"], check=True, capture_output=True, timeout=RUN_TIMEOUT_S)
    flags = bert_flags({"vocab_file": vocab, "data_prefix": str(tmp_path / "d_text_document")}, 3)
    result = run_bert(1, flags, str(tmp_path))
    assert result.returncode != 0 and not result.lines
    assert "--split-sentences" in result.output, result.output[-3000:]
