"""tools/train_tokenizer.py end to end: train each kind, then build the tokenizer from its flags."""

import os
import shlex
import subprocess
import sys

import pytest

from megatron.core.tokenizers import build_tokenizer
from tests.tokenizer_files import corpus_texts, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TOOL = os.path.join(ROOT, "tools", "train_tokenizer.py")
_ARG_OF_FLAG = {
    "--vocab-file": "vocab_file",
    "--merge-file": "merge_file",
    "--tokenizer-model": "tokenizer_model",
    "--vocab-size": "vocab_size",
    "--tiktoken-pattern": "tiktoken_pattern",
    "--tiktoken-num-special-tokens": "tiktoken_num_special_tokens",
}


def _run(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True)


def _flags_to_tokenizer(stdout):
    """Parses the printed Megatron flags and builds the tokenizer they describe."""
    line = next(l for l in stdout.splitlines() if l.startswith("Megatron flags: "))
    words = shlex.split(line[len("Megatron flags: ") :])
    flags = dict(zip(words[::2], words[1::2]))
    kwargs = {_ARG_OF_FLAG[f]: v for f, v in flags.items() if f != "--tokenizer-type"}
    for name in ("vocab_size", "tiktoken_num_special_tokens"):
        if name in kwargs:
            kwargs[name] = int(kwargs[name])
    return flags["--tokenizer-type"], build_tokenizer(flags["--tokenizer-type"], **kwargs)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_corpus")
    texts = corpus_texts(max_chars=60_000)
    jsonl = write_jsonl(str(d / "docs.jsonl"), texts, key="content")
    txt = d / "docs.txt"
    txt.write_text("\n".join(texts), encoding="utf-8")
    return jsonl, str(txt)


@pytest.mark.parametrize(
    "kind,expected_type,extra",
    [
        ("gpt2bpe", "GPT2BPETokenizer", []),
        ("sentencepiece-bpe", "GPTSentencePieceTokenizer", []),
        ("sentencepiece-unigram", "GPTSentencePieceTokenizer", []),
        ("wordpiece", "BertWordPieceLowerCase", []),
        ("wordpiece", "BertWordPieceCase", ["--cased"]),
        ("tiktoken", "TikTokenizer", []),
        ("huggingface", "HuggingFaceTokenizer", []),
    ],
)
def test_cli_trains_each_kind(corpus, tmp_path, kind, expected_type, extra):
    jsonl, txt = corpus
    out = _run(
        "--input",
        jsonl,
        txt,
        "--json-key",
        "content",
        "--type",
        kind,
        "--vocab-size",
        "400",
        "--output-dir",
        str(tmp_path / kind),
        *extra,
    )
    assert out.returncode == 0, out.stderr
    written = [l.split(" ", 1)[1] for l in out.stdout.splitlines() if l.startswith("wrote ")]
    assert written and all(os.path.isfile(p) for p in written)
    tokenizer_type, tok = _flags_to_tokenizer(out.stdout)
    assert tokenizer_type == expected_type
    ids = tok.tokenize("Return the value of the attribute.")
    assert ids and max(ids) < tok.vocab_size


def test_cli_errors(corpus, tmp_path):
    jsonl, _ = corpus
    out = _run(
        "--input",
        str(tmp_path / "nope.jsonl"),
        "--type",
        "gpt2bpe",
        "--vocab-size",
        "300",
        "--output-dir",
        str(tmp_path),
    )
    assert out.returncode != 0 and "--input: no such file" in out.stderr and "nope.jsonl" in out.stderr
    out = _run(
        "--input",
        jsonl,
        "--json-key",
        "body",
        "--type",
        "gpt2bpe",
        "--vocab-size",
        "300",
        "--output-dir",
        str(tmp_path),
    )
    assert out.returncode != 0 and "no key 'body'" in out.stderr
    out = _run("--input", jsonl, "--type", "bpe", "--vocab-size", "300", "--output-dir", str(tmp_path))
    assert out.returncode != 0 and "--type" in out.stderr
