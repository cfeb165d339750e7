"""Tokenize very long texts in pieces, with the ids of tokenizing them whole, in bounded memory.

Tokenizer libraries need ~150 bytes per input character while encoding (a 50 MB JSON line took
6 GB in one call). Texts longer than ``LONG_TEXT_CHARS`` are cut where a whitespace run starts,
and only where tokenizing the surrounding context in two parts gives the same ids as tokenizing
it whole. Standard library and NumPy only (``preprocess_data.py`` starts without torch).
"""

from __future__ import annotations

import re
import sys
from typing import Any, List, Optional

import numpy as np

LONG_TEXT_CHARS = 1 << 18
CUT_CONTEXT_CHARS = 256  # text on each side of a cut used to check that the cut changes no token
CUT_CANDIDATES = 16  # cut points tried per piece before the rest of the text is tokenized whole
_CUT_POINT = re.compile(r"(?<=\S)(?=\s)")  # the start of a whitespace run


def _cut_is_transparent(tok: Any, text: str, cut: int) -> bool:
    """Whether tokenizing around ``cut`` in two parts gives the ids of tokenizing it whole."""
    a, b = max(0, cut - CUT_CONTEXT_CHARS), min(len(text), cut + CUT_CONTEXT_CHARS)
    whole, left, right = tok.batch_tokenize([text[a:b], text[a:cut], text[cut:b]])
    return list(whole) == list(left) + list(right)


def _next_cut(tok: Any, text: str, start: int) -> Optional[int]:
    """The first checked cut at least ``LONG_TEXT_CHARS`` after ``start``.

    ``len(text)`` when the candidate is within ``CUT_CONTEXT_CHARS`` of the end (no cut needed);
    None when there is no whitespace or none of the candidates passes the check.
    """
    pos = start + LONG_TEXT_CHARS
    for _ in range(CUT_CANDIDATES):
        match = _CUT_POINT.search(text, pos)
        if match is None:
            return None
        if len(text) - match.start() <= CUT_CONTEXT_CHARS:
            return len(text)
        if _cut_is_transparent(tok, text, match.start()):
            return match.start()
        pos = match.start() + 1
    return None


def tokenize_long(tok: Any, text: str, dtype: Any) -> np.ndarray:
    """Ids of one long text, tokenized in pieces of about ``LONG_TEXT_CHARS`` characters.

    Pieces end where a whitespace run starts and only where tokenizing the surrounding context
    in two parts gives the same ids as tokenizing it whole (so a tokenizer that adds a BOS, or
    whose pieces may span whitespace there, is never cut). Each piece's ids go straight into a
    NumPy array: peak memory follows the piece size, not the text size.
    """
    pieces: List[np.ndarray] = []
    start = 0
    while len(text) - start > LONG_TEXT_CHARS:
        cut = _next_cut(tok, text, start)
        if cut == len(text):
            break
        if cut is None:
            print(
                f"note: a text of {len(text) - start} characters is tokenized in one piece: no checked cut "
                f"point among {CUT_CANDIDATES} candidates (memory grows with its length)",
                file=sys.stderr,
            )
            break
        pieces.append(np.asarray(tok.batch_tokenize([text[start:cut]])[0], dtype=dtype))
        start = cut
    pieces.append(np.asarray(tok.batch_tokenize([text[start:]])[0], dtype=dtype))
    return np.concatenate(pieces)


def tokenize_all(tok: Any, texts: List[str], dtype: Any) -> List[Any]:
    """``tok.batch_tokenize(texts)``, with the texts over ``LONG_TEXT_CHARS`` through ``tokenize_long``."""
    long_ones = {i for i, t in enumerate(texts) if len(t) > LONG_TEXT_CHARS}
    short = [t for i, t in enumerate(texts) if i not in long_ones]
    short_ids = iter(tok.batch_tokenize(short) if short else [])
    return [tokenize_long(tok, t, dtype) if i in long_ones else next(short_ids) for i, t in enumerate(texts)]
