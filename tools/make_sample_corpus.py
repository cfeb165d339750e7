"""Write a JSON-lines corpus that needs no download: the docstrings of Python's standard library.

    python tools/make_sample_corpus.py --output corpus.jsonl --max-mb 2

Each line is ``{"text": docstring}``. The text is read with ``ast`` from the installed
standard library's sources (nothing is imported or fetched), so it is the same on every
machine with the same Python. Enough for a quickstart, tokenizer training and tests.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys
import sysconfig
from typing import Iterator, List, Optional, Sequence

_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_docstrings() -> Iterator[str]:
    """Every docstring of the standard library's top-level modules, in a fixed order."""
    for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, _DOC_NODES):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc


def corpus_texts(max_chars: int) -> List[str]:
    """Docstrings in order until about ``max_chars`` characters."""
    texts, total = [], 0
    for doc in stdlib_docstrings():
        texts.append(doc)
        total += len(doc)
        if total >= max_chars:
            break
    return texts


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="JSON-lines file to write")
    parser.add_argument("--max-mb", type=float, default=2.0, help="stop after about this many MB of text")
    parser.add_argument("--json-key", default="text", help="key of the text in each JSON line")
    args = parser.parse_args(argv)
    texts = corpus_texts(int(args.max_mb * 1e6))
    if not texts:
        sys.exit("make_sample_corpus.py: found no docstrings in the standard library sources")
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({args.json_key: text}) + "\n")
    tmp.replace(out)
    print(f"wrote {len(texts)} documents ({sum(map(len, texts)) / 1e6:.2f} MB) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
