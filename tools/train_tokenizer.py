"""Train a small tokenizer offline and print the Megatron flags that use it.

Example::

    python tools/train_tokenizer.py --input corpus.jsonl --json-key text \\
        --type gpt2bpe --vocab-size 8000 --output-dir tok/
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Iterator, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.tokenizers.training import TRAINERS, train_tokenizer  # noqa: E402

KINDS = (
    "gpt2bpe",
    "sentencepiece-bpe",
    "sentencepiece-unigram",
    "wordpiece",
    "tiktoken",
    "huggingface",
    "huggingface-chat",
)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--input", nargs="+", required=True, help="text files (one text per line) or JSON-lines files (.json/.jsonl)"
    )
    parser.add_argument("--json-key", default="text", help="key of the text in JSON-lines input")
    parser.add_argument("--type", required=True, choices=KINDS, help="kind of tokenizer to train")
    parser.add_argument("--vocab-size", type=int, required=True, help="target vocabulary size")
    parser.add_argument("--output-dir", required=True, help="directory for the tokenizer files")
    parser.add_argument(
        "--cased", action="store_true", help="wordpiece only: keep case and accents (BertWordPieceCase)"
    )
    args = parser.parse_args(argv)
    missing = [path for path in args.input if not os.path.isfile(path)]
    if missing:
        parser.error(f"--input: no such file: {', '.join(missing)}")
    if args.vocab_size <= 0:
        parser.error(f"--vocab-size={args.vocab_size} must be positive")
    if args.cased and args.type != "wordpiece":
        parser.error("--cased applies to --type wordpiece only")
    return args


def read_texts(paths: List[str], json_key: str) -> Iterator[str]:
    """Yields the texts of plain-text files (a line each) and JSON-lines files (a document each)."""
    for path in paths:
        is_json = path.endswith((".json", ".jsonl"))
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if not is_json:
                    yield line.rstrip("\n")
                    continue
                doc = json.loads(line)
                if json_key not in doc:
                    raise SystemExit(f"{path}:{number}: no key {json_key!r} (see --json-key)")
                yield doc[json_key]


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    kind = "wordpiece-cased" if args.cased else args.type
    assert kind in TRAINERS
    trained = train_tokenizer(kind, read_texts(args.input, args.json_key), args.vocab_size, args.output_dir)
    for path in trained.files:
        print(f"wrote {path}")
    print("Megatron flags: " + shlex.join(trained.megatron_flags()))
    if trained.tokenizer_type == "GPTSentencePieceTokenizer":
        print("(the same model also serves --tokenizer-type SentencePieceTokenizer and Llama2Tokenizer)")


if __name__ == "__main__":
    main()
