"""Reading a JSON-lines corpus for ``tools/preprocess_data.py``: byte ranges of whole lines, blocks of lines,
the texts of one line, and sentence splitting (NLTK Punkt, never downloaded).

Standard library, NumPy-free and torch-free: worker processes import it at start-up.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, List, Optional, Sequence, Tuple

BLOCK_BYTES = 1 << 20  # lines per task: large enough to amortise IPC, small enough to balance
PUNKT_SAMPLE_BYTES = 512 * 1024  # Punkt training costs ~2 s per MB


def punkt_params(lang: str, sample: str) -> Tuple[Any, str]:
    """Punkt parameters for ``lang`` from local NLTK data, else trained on ``sample`` (no download)."""
    from nltk.tokenize import punkt

    try:
        return punkt.PunktTokenizer(lang)._params, f"NLTK punkt_tab data for {lang}"
    except (LookupError, OSError, ValueError):
        trainer = punkt.PunktTrainer()
        trainer.train(sample, finalize=True)
        return trainer.get_params(), f"Punkt trained on {len(sample) // 1024} KiB of the input"


def read_text_sample(files: Sequence[str], keys: Sequence[str], limit: int) -> str:
    """Up to ``limit`` characters of the keys' texts from the first lines of the input."""
    parts: List[str] = []
    size = 0
    for path in files:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    obj = json.loads(raw)
                except ValueError:
                    continue
                texts = [obj.get(k) for k in keys] if isinstance(obj, dict) else []
                for t in texts:
                    if isinstance(t, str):
                        parts.append(t)
                        size += len(t)
                if size >= limit:
                    return "\n\n".join(parts)
    return "\n\n".join(parts)


class SentenceSplitter:
    """Punkt sentence splitter; with ``keep_newlines`` the text between sentences stays attached."""

    def __init__(self, params: Any, keep_newlines: bool) -> None:
        from nltk.tokenize.punkt import PunktSentenceTokenizer

        self._punkt = PunktSentenceTokenizer(params)
        self.keep_newlines = keep_newlines

    def __call__(self, text: str) -> List[str]:
        if not self.keep_newlines:
            return self._punkt.tokenize(text)
        starts = [s for s, _ in self._punkt.span_tokenize(text)]
        # Each sentence runs to the start of the next, so newlines after it are kept.
        return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]


def parse_line(raw: bytes, keys: Sequence[str]) -> Tuple[Optional[List[str]], Optional[Tuple[str, str]]]:
    """The texts of one line, or ``(None, (reason, message))`` for a bad line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, ("invalid_utf8", f"invalid UTF-8 at byte {e.start}")
    try:
        obj = json.loads(line)
    except ValueError as e:
        return None, ("invalid_json", f"invalid JSON: {e}")
    if not isinstance(obj, dict):
        return None, ("invalid_json", f"a JSON {type(obj).__name__}, not an object")
    texts = []
    for key in keys:
        if key not in obj:
            return None, ("missing_key", f"no key {key!r}")
        value = obj[key]
        if not isinstance(value, str):
            return None, ("non_string", f"key {key!r} holds a {type(value).__name__}, not a string")
        if not value:
            return None, ("empty_text", f"key {key!r} is empty")
        texts.append(value)
    return texts, None


Range = Tuple[str, int, int]  # file, first byte, end byte (both at line starts)


def split_ranges(files: Sequence[str], parts: int) -> List[List[Range]]:
    """Cut the input into ``parts`` byte ranges of similar size, each made of whole lines."""
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    cuts = [total * k // parts for k in range(1, parts)]
    result: List[List[Range]] = [[] for _ in range(parts)]
    offset = 0
    for path, size in zip(files, sizes):
        inner = sorted({_line_start(path, c - offset) for c in cuts if offset < c < offset + size})
        bounds = [0] + [b for b in inner if 0 < b < size] + [size]
        for a, b in zip(bounds, bounds[1:]):
            part = min(parts - 1, sum(1 for c in cuts if c <= offset + a))
            result[part].append((path, a, b))
        offset += size
    return result


def _line_start(path: str, pos: int) -> int:
    """The first line start at or after byte ``pos``."""
    with open(path, "rb") as f:
        f.seek(pos - 1)
        f.readline()
        return f.tell()


def iter_blocks(ranges: Sequence[Range], block_bytes: int = BLOCK_BYTES) -> Iterator[Tuple[str, int, bytes]]:
    """Blocks of whole lines as ``(file, number of the first line, bytes)``."""
    for path, start, end in ranges:
        with open(path, "rb") as f:
            lineno = 1 + _count_newlines(f, start)
            f.seek(start)
            pos, pending = start, []  # pending: the start of a line longer than a block, in pieces
            while pos < end:
                data = f.read(min(block_bytes, end - pos))
                if not data:
                    raise ValueError(f"{path}: file ended at byte {pos}, expected {end} bytes (changed while read?)")
                pos += len(data)
                cut = len(data) if pos >= end else data.rfind(b"\n") + 1
                if cut <= 0:  # a line longer than a block: keep reading (joined once, not per read)
                    pending.append(data)
                    continue
                block = b"".join(pending + [data[:cut]])
                pending = [data[cut:]]
                yield path, lineno, block
                lineno += block.count(b"\n")


def _count_newlines(f: Any, end: int, chunk: int = 1 << 24) -> int:
    f.seek(0)
    count, pos = 0, 0
    while pos < end:
        data = f.read(min(chunk, end - pos))
        if not data:
            break
        count += data.count(b"\n")
        pos += len(data)
    return count
