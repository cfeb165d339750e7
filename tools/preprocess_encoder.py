"""Megatron-LM's ``tools.preprocess_data.Encoder``: one JSON line at a time, for code written against it.

``tools/preprocess_data.py`` itself encodes whole blocks of lines in NumPy (``encode_block``);
this class keeps upstream's per-line interface for callers that drive their own pool
(``Pool(initializer=encoder.initializer)`` then ``pool.imap(encoder.encode, lines)``). It reads
the namespace of ``tools.preprocess_data.get_args``: the tokenizer flags, ``json_keys``,
``split_sentences``, ``keep_newlines``, ``lang`` and ``append_eod``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable, Dict, List, Tuple

from megatron.core.tokenizers import TOKENIZER_KEYWORDS, build_tokenizer
from tools.jsonl_input import SentenceSplitter, punkt_params


class Encoder:
    """Tokenizes (``encode``) or sentence-splits (``split``) one JSON line.

    As upstream, ``initializer()`` puts the tokenizer and the splitter on the class
    (``Encoder.tokenizer``, ``Encoder.splitter``), once per worker process.
    """

    tokenizer: Any = None
    splitter: Callable[[str], List[str]] = staticmethod(lambda text: [text])

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def initializer(self) -> None:
        """Build the tokenizer and, with ``split_sentences``, the Punkt splitter of this process.

        The splitter's parameters come from local NLTK data for ``args.lang`` (never downloaded);
        without it, default Punkt parameters are used.
        """
        kwargs = {name: getattr(self.args, name) for name in TOKENIZER_KEYWORDS if hasattr(self.args, name)}
        Encoder.tokenizer = build_tokenizer(self.args.tokenizer_type, **kwargs)
        if self.args.split_sentences:
            params, _ = punkt_params(self.args.lang, "")
            Encoder.splitter = SentenceSplitter(params, self.args.keep_newlines)
        else:
            Encoder.splitter = staticmethod(lambda text: [text])

    def split(self, json_line: str) -> Tuple[str, int]:
        """``(JSON of {key: [sentences]}, len(json_line))`` for each of ``args.json_keys``."""
        data = json.loads(json_line)
        output = {key: list(Encoder.splitter(data[key])) for key in self.args.json_keys}
        return json.dumps(output), len(json_line)

    def encode(self, json_line: str) -> Tuple[Dict[str, List[int]], Dict[str, List[int]], int]:
        """``(ids per key, sentence lengths per key, len(json_line))`` of one document.

        A key's value may be a text or a list of sentences (the output of ``split``); sentences
        that tokenize to nothing are dropped; ``append_eod`` adds eod to a non-empty document,
        counted in its last sentence.
        """
        data = json.loads(json_line)
        ids: Dict[str, List[int]] = {}
        lens: Dict[str, List[int]] = {}
        for key in self.args.json_keys:
            text = data[key]
            sentences = text if isinstance(text, list) else [text]
            encoded = [list(Encoder.tokenizer.tokenize(s)) for s in sentences]
            encoded = [e for e in encoded if e]
            ids[key] = [i for e in encoded for i in e]
            lens[key] = [len(e) for e in encoded]
            if ids[key] and self.args.append_eod:
                ids[key].append(Encoder.tokenizer.eod)
                lens[key][-1] += 1
        return ids, lens, len(json_line)
