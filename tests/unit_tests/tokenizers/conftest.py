"""Tokenizer files trained once per test session."""

import pytest

from tests.tokenizer_files import corpus_texts, make_tokenizer_files


@pytest.fixture(scope="session")
def tokenizer_files(tmp_path_factory):
    """``{tokenizer_type: build_tokenizer kwargs}`` for every implemented type."""
    return make_tokenizer_files(tmp_path_factory.mktemp("tokenizers"))


@pytest.fixture(scope="session")
def sample_texts():
    """Texts unlike the training corpus: capitals, digits, accents, CJK, newlines, specials."""
    return [
        "Hello World! The quick brown fox jumps over 13 lazy dogs.",
        "Return the value of x.\n\n    Numbers 12345 and 3.14159 appear here.",
        "Accents: émigré café naïve; CJK: 中文字; emoji: \U0001f600.",
        "<|endoftext|> [CLS] <s> </s> <EOD> <extra_id_0> inside text",
        "",
        " leading and trailing spaces ",
    ]


@pytest.fixture(scope="session")
def corpus_sample():
    """A few real corpus documents."""
    return corpus_texts(max_chars=5_000)[:20]
