"""build_tokenizer's errors, and the package's import cost."""

import subprocess
import sys

import pytest

from megatron.core.tokenizers import TOKENIZER_TYPES, build_tokenizer


def test_unknown_type_lists_valid_types():
    with pytest.raises(ValueError, match="tokenizer_type='GPT3Tokenizer'") as info:
        build_tokenizer("GPT3Tokenizer")
    for name in ("GPT2BPETokenizer", "TikTokenizer", "NullTokenizer", "BertWordPieceCase"):
        assert name in str(info.value)


@pytest.mark.parametrize(
    "tokenizer_type,kwargs,flag",
    [
        ("GPT2BPETokenizer", {}, "vocab_file"),
        ("BertWordPieceLowerCase", {}, "vocab_file"),
        ("SentencePieceTokenizer", {}, "tokenizer_model"),
        ("GPTSentencePieceTokenizer", {}, "tokenizer_model"),
        ("Llama2Tokenizer", {}, "tokenizer_model"),
        ("TikTokenizer", {"tiktoken_pattern": "v2"}, "tokenizer_model"),
        ("HuggingFaceTokenizer", {}, "tokenizer_model"),
    ],
)
def test_missing_argument_is_named(tokenizer_type, kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        build_tokenizer(tokenizer_type, **kwargs)


@pytest.mark.parametrize(
    "tokenizer_type,arg,flag",
    [
        ("GPT2BPETokenizer", "vocab_file", "vocab_file"),
        ("GPT2BPETokenizer", "merge_file", "merge_file"),
        ("BertWordPieceCase", "vocab_file", "vocab_file"),
        ("SentencePieceTokenizer", "tokenizer_model", "tokenizer_model"),
        ("TikTokenizer", "tokenizer_model", "tokenizer_model"),
        ("HuggingFaceTokenizer", "tokenizer_model", "tokenizer_model"),
    ],
)
def test_missing_file_is_named(tokenizer_files, tmp_path, tokenizer_type, arg, flag):
    kwargs = dict(tokenizer_files[tokenizer_type])
    kwargs[arg] = str(tmp_path / "does-not-exist")
    with pytest.raises(FileNotFoundError, match=f"{flag}=.*does-not-exist"):
        build_tokenizer(tokenizer_type, **kwargs)


def test_gpt2_vocab_without_eod(tokenizer_files, tmp_path):
    files = tokenizer_files["GPT2BPETokenizer"]
    vocab = tmp_path / "vocab.json"
    vocab.write_text('{"a": 0, "b": 1}')
    with pytest.raises(ValueError, match="<\\|endoftext\\|>"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=files["merge_file"])


def test_bert_vocab_without_required_tokens(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\nhello\n")
    with pytest.raises(ValueError, match="\\[CLS\\]"):
        build_tokenizer("BertWordPieceLowerCase", vocab_file=str(vocab))


def test_vocab_extra_ids_refused_where_unsupported(tokenizer_files):
    with pytest.raises(ValueError, match="vocab_extra_ids=2 is not supported by GPT2BPETokenizer"):
        build_tokenizer("GPT2BPETokenizer", vocab_extra_ids=2, **tokenizer_files["GPT2BPETokenizer"])


def test_every_type_is_megatrons():
    # The names must be valid values of Megatron's --tokenizer-type.
    megatron_choices = {
        "BertWordPieceLowerCase",
        "BertWordPieceCase",
        "GPT2BPETokenizer",
        "SentencePieceTokenizer",
        "GPTSentencePieceTokenizer",
        "HuggingFaceTokenizer",
        "Llama2Tokenizer",
        "TikTokenizer",
        "MultimodalTokenizer",
        "NullTokenizer",
        "NullMultimodalTokenizer",
        "SFTTokenizer",
    }
    assert set(TOKENIZER_TYPES) <= megatron_choices


def test_import_loads_no_heavy_library():
    heavy = ("torch", "transformers", "tokenizers", "sentencepiece", "tiktoken", "numpy")
    code = f"import sys, megatron.core.tokenizers; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
