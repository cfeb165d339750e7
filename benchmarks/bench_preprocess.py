"""Preprocessing throughput against the ``tokenizers`` library's own batch encoder.

    python benchmarks/bench_preprocess.py --size-mb 100 --workers 2

Builds a JSON-lines corpus of ``--size-mb`` MB from the standard library's docstrings (no
download), trains a GPT-2 style byte-level BPE on part of it, then times on the same cores:

* ``tokenizers``: ``Tokenizer.encode_batch_fast`` over the corpus texts already in memory (its
  native thread pool), the upper bound for any tool that must produce the same ids;
* ``preprocess_data.py --workers N``: the whole tool, from the JSON file to ``.bin``/``.idx``;
* the tool's start-up time (``--help``).

Prints MB/s and documents/s of both and their ratio. Everything lives in a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.tokenizer_files import corpus_texts  # noqa: E402


def write_corpus(path: str, size_mb: float) -> List[str]:
    """Write docstrings, repeated with a varying preamble, until the file holds ``size_mb`` MB."""
    base = corpus_texts(max_chars=10**9)
    texts, size, copy = [], 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < size_mb * 1e6:
            for doc in base:
                text = f"Copy {copy}. {doc}"
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                texts.append(text)
                size += len(line.encode("utf-8"))
                if size >= size_mb * 1e6:
                    break
            copy += 1
    return texts


def time_library(vocab_file: str, merge_file: str, texts: List[str], threads: int) -> float:
    """Seconds the ``tokenizers`` library needs to encode ``texts`` with its own thread pool."""
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    start = time.perf_counter()
    for i in range(0, len(texts), 4096):
        tok.encode_batch_fast(texts[i : i + 4096], add_special_tokens=False)
    return time.perf_counter() - start


def run_tool(corpus: str, out_prefix: str, tok_flags: List[str], workers: int) -> float:
    """Wall seconds of one preprocessing run (a fresh process, as a user runs it)."""
    cmd = [
        sys.executable,
        os.path.join(REPO, "tools", "preprocess_data.py"),
        "--input",
        corpus,
        "--output-prefix",
        out_prefix,
        *tok_flags,
        "--workers",
        str(workers),
        "--append-eod",
        "--log-interval",
        "100000",
    ]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def startup_seconds() -> float:
    """Wall seconds of ``preprocess_data.py --help``."""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--help"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=100.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=16384)
    args = p.parse_args()
    from megatron.core.tokenizers.training import train_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        t = time.perf_counter()
        texts = write_corpus(corpus, args.size_mb)
        mb = os.path.getsize(corpus) / 1e6
        print(f"corpus: {len(texts)} documents, {mb:.1f} MB ({time.perf_counter() - t:.1f} s to write)")
        t = time.perf_counter()
        trained = train_tokenizer(
            "gpt2bpe", corpus_texts(max_chars=3_000_000), args.vocab_size, os.path.join(tmp, "bpe")
        )
        print(f"byte-level BPE: vocab {args.vocab_size} trained in {time.perf_counter() - t:.1f} s")
        kw = trained.kwargs
        startup = min(startup_seconds() for _ in range(3))
        lib = time_library(kw["vocab_file"], kw["merge_file"], texts, args.workers)
        ours = run_tool(corpus, os.path.join(tmp, "out"), trained.megatron_flags(), args.workers)
    n = len(texts)
    print(f"{'':34s}{'MB/s':>10s}{'docs/s':>12s}{'seconds':>10s}")
    print(f"{'tokenizers encode_batch_fast':34s}{mb / lib:10.2f}{n / lib:12.0f}{lib:10.2f}")
    print(f"{f'preprocess_data --workers {args.workers}':34s}{mb / ours:10.2f}{n / ours:12.0f}{ours:10.2f}")
    print(f"ratio (ours / library): {lib / ours:.0%}   (target >= 80%)")
    print(f"start-up (--help): {startup:.3f} s")


if __name__ == "__main__":
    main()
