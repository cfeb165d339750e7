"""Bad training data stops ``pretrain_gpt.py`` before the first iteration, or is handled correctly.

End-to-end probes: a stale index cache after re-preprocessing under the same prefix, a corrupt
``.idx``, and token ids beyond the model's vocabulary (data made by a bigger tokenizer). And one for
``tools/preprocess_data.py``: a line the tokenizer refuses is skipped and named, not fatal.
"""

from __future__ import annotations

import os
import struct
from typing import List, Sequence

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import HEADER_SIZE, get_idx_path
from megatron.core.tokenizers import build_tokenizer
from tests.functional_tests.gpt_runs import assert_ok, run_gpt, tiny_gpt_flags
from tests.tokenizer_files import make_tokenizer_files, megatron_flags
from tests.unit_tests.data.test_preprocess_data import check_dataset, expected_sequences, run_tool, write_lines
from tests.unit_tests.datasets.fixtures import write_dataset

VOCAB = 600


def write_documents(prefix: str, docs: Sequence[Sequence[int]]) -> str:
    """``docs`` (lists of token ids) as a ``.bin``/``.idx`` pair at ``prefix``."""
    return write_dataset(os.path.dirname(prefix), os.path.basename(prefix), docs)


def random_documents(seed: int, n: int = 80, low: int = 20, high: int = 90) -> List[List[int]]:
    rng = np.random.RandomState(seed)
    return [rng.randint(0, VOCAB, size=rng.randint(low, high)).tolist() for _ in range(n)]


def data_run_flags(prefix: str, cache: str, iters: int = 3, tp: int = 1) -> List[str]:
    return tiny_gpt_flags(iters) + [
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(VOCAB),
        "--data-path",
        prefix,
        "--split",
        "90,5,5",
        "--data-cache-path",
        cache,
        "--tensor-model-parallel-size",
        str(tp),
    ]


def test_stale_index_cache_is_rebuilt(tmp_path):
    prefix = write_documents(str(tmp_path / "corpus_text_document"), random_documents(0))
    cache = str(tmp_path / "cache")
    assert_ok(run_gpt(1, data_run_flags(prefix, cache), str(tmp_path)), "first run")
    # Re-preprocessed under the same prefix: as many documents, other lengths and tokens.
    write_documents(prefix, random_documents(1, low=40, high=70))
    reused = run_gpt(1, data_run_flags(prefix, cache), str(tmp_path))
    assert_ok(reused, "run over the old cache")
    fresh = run_gpt(1, data_run_flags(prefix, str(tmp_path / "fresh_cache")), str(tmp_path))
    assert_ok(fresh, "run with a fresh cache")
    assert reused.losses() == fresh.losses() and len(fresh.losses()) == 3


def test_corrupt_idx_stops_before_training(tmp_path):
    prefix = write_documents(str(tmp_path / "corpus_text_document"), random_documents(2))
    with open(get_idx_path(prefix), "r+b") as f:
        f.seek(HEADER_SIZE + 4 * 7)  # lengths[7] (int32) becomes negative
        f.write(struct.pack("<i", -5))
    result = run_gpt(1, data_run_flags(prefix, str(tmp_path / "cache")), str(tmp_path))
    assert result.returncode != 0 and result.lines == []
    assert f"{get_idx_path(prefix)}: sequence 7 has length -5" in result.output, result.output[-3000:]


def test_token_ids_beyond_the_vocabulary_stop_every_rank(tmp_path):
    docs = random_documents(3)
    docs[41][5] = 5000  # preprocessed with a bigger tokenizer than --vocab-size 600
    prefix = write_documents(str(tmp_path / "corpus_text_document"), docs)
    result = run_gpt(2, data_run_flags(prefix, str(tmp_path / "cache"), tp=2), str(tmp_path), timeout=240)
    assert result.returncode != 0 and result.lines == []
    # NullTokenizer: 601 ids, padded to a multiple of 512 x TP 2.
    assert (
        f"data prefix {prefix} holds token id 5000 but the padded vocabulary (--tokenizer-type NullTokenizer "
        "--vocab-size 600, padded to a multiple of --make-vocab-size-divisible-by 512 x "
        "--tensor-model-parallel-size 2) has 1024 entries"
    ) in result.output, result.output[-4000:]


# Line 2 holds a lone surrogate (valid JSON, refused by every library tokenizer with a TypeError);
# line 4 a text NullTokenizer cannot read as numbers (a ValueError); the others are valid for both.
TOKENIZER_BAD_LINES = [
    {"text": "12 7 9"},
    {"text": "bad \ud800 surrogate"},
    {"text": "3 4"},
    {"text": "x 5"},
    {"text": "8"},
]


@pytest.mark.parametrize("tok_type", ["GPT2BPETokenizer", "NullTokenizer"])
def test_line_the_tokenizer_refuses_is_skipped_with_file_and_line(tmp_path, tok_type, capsys):
    files = make_tokenizer_files(tmp_path / "tok")
    src = write_lines(tmp_path / "in.jsonl", TOKENIZER_BAD_LINES)
    flags = megatron_flags(tok_type, files[tok_type])
    rc, prefix = run_tool(tmp_path, src, flags)
    err = capsys.readouterr().err
    assert rc == 0, err
    tok = build_tokenizer(tok_type, **files[tok_type])
    bad_lines = [2] if tok_type == "GPT2BPETokenizer" else [2, 4]
    assert f"skipped {len(bad_lines)} bad lines: tokenizer_error={len(bad_lines)}" in err
    for lineno in bad_lines:
        assert f"in.jsonl:{lineno}: tokenizer failed: " in err
    valid = [d["text"] for i, d in enumerate(TOKENIZER_BAD_LINES, 1) if i not in bad_lines]
    check_dataset(f"{prefix}_text_document", expected_sequences(tok, valid, False, False, False))

    rc, _ = run_tool(tmp_path, src, flags, "--strict", name="strict")
    assert rc == 1
    assert "in.jsonl:2: tokenizer failed: " in capsys.readouterr().err
    assert not [n for n in os.listdir(tmp_path) if n.startswith("strict")]
