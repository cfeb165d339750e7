"""Offline text and trained tokenizer files for tests of any component that needs a tokenizer.

Usage from another test module::

    from tests.tokenizer_files import make_tokenizer_files, megatron_flags

    @pytest.fixture(scope="session")
    def tok_files(tmp_path_factory):
        return make_tokenizer_files(tmp_path_factory.mktemp("tok"))

    tok_files["GPT2BPETokenizer"]        # build_tokenizer keyword arguments
    megatron_flags("GPT2BPETokenizer", tok_files["GPT2BPETokenizer"])   # the same as CLI flags

The text is the docstrings of the installed Python standard library, read with ``ast`` (no import,
no download). Training every kind takes about 3 s, once per process (later calls copy the files).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from typing import Dict, List

from megatron.core.tokenizers.training import megatron_flags, train_tokenizer
from tools import make_sample_corpus as sample_corpus

__all__ = ["corpus_texts", "make_tokenizer_files", "megatron_flags", "write_jsonl"]

DEFAULT_VOCAB_SIZE = 600
_MANIFEST = "tokenizer_files.json"
_TRAINED: Dict[int, str] = {}  # vocabulary size -> a private folder this process trained every kind into


def corpus_texts(max_chars: int = 300_000) -> List[str]:
    """Standard-library docstrings, one per text, in a fixed order, about ``max_chars`` long."""
    return sample_corpus.corpus_texts(max_chars)


def write_jsonl(path: str, texts: List[str], key: str = "text") -> str:
    """Writes one JSON object ``{key: text}`` per line, the input format of preprocessing."""
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({key: text}) + "\n")
    return path


def make_tokenizer_files(tmpdir, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Dict[str, Dict[str, object]]:
    """Trains one tokenizer per kind into ``tmpdir`` (reused if already there).

    A process trains each vocabulary size once, into a private folder, and copies those files into every
    ``tmpdir`` asked for: training again would give an equally valid set (SentencePiece and WordPiece
    training are not byte-for-byte repeatable) and cost about 3 s on 2 quiet cores.

    Returns:
        ``{tokenizer_type: build_tokenizer keyword arguments}`` for every Megatron type we
        implement (SentencePiece types share one model; NullTokenizer gets ``vocab_size``).
    """
    tmpdir = str(tmpdir)
    manifest = os.path.join(tmpdir, _MANIFEST)
    if not os.path.exists(manifest):
        source = _TRAINED.get(vocab_size)
        if source is None:
            source = tempfile.mkdtemp(prefix="tokenizer-files-")
            atexit.register(shutil.rmtree, source, True)
            _train_every_kind(source, vocab_size)
            _TRAINED[vocab_size] = source
        shutil.copytree(source, tmpdir, dirs_exist_ok=True)
        with open(manifest, encoding="utf-8") as f:
            moved = f.read().replace(json.dumps(source)[1:-1], json.dumps(tmpdir)[1:-1])
        with open(manifest, "w", encoding="utf-8") as f:
            f.write(moved)
    with open(manifest, encoding="utf-8") as f:
        return json.load(f)


def _train_every_kind(tmpdir: str, vocab_size: int) -> None:
    """Trains every kind into ``tmpdir`` and writes the manifest of their keyword arguments."""
    texts = corpus_texts()
    files: Dict[str, Dict[str, object]] = {}
    for kind in ("gpt2bpe", "sentencepiece-bpe", "wordpiece", "wordpiece-cased", "tiktoken", "huggingface"):
        trained = train_tokenizer(kind, texts, vocab_size, os.path.join(tmpdir, kind))
        files[trained.tokenizer_type] = trained.kwargs
    for sp_type in ("SentencePieceTokenizer", "Llama2Tokenizer"):
        files[sp_type] = dict(files["GPTSentencePieceTokenizer"])
    files["NullTokenizer"] = {"vocab_size": vocab_size}
    with open(os.path.join(tmpdir, _MANIFEST), "w", encoding="utf-8") as f:
        json.dump(files, f, indent=1)
