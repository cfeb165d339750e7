"""Each tokenizer type against its underlying library called directly."""

import base64
import json
import os

import pytest

from megatron.core.tokenizers import (
    TOKENIZER_TYPES,
    MissingSpecialTokenError,
    build_tokenizer,
)

# Texts free of special-token strings: the references below treat those differently on purpose.
PLAIN = [0, 1, 2, 4, 5]


def _plain(texts):
    return [texts[i] for i in PLAIN]


@pytest.mark.parametrize("tokenizer_type", [t for t in TOKENIZER_TYPES if t != "NullTokenizer"])
def test_batch_equals_single(tokenizer_files, tokenizer_type, sample_texts, corpus_sample):
    tok = build_tokenizer(tokenizer_type, **tokenizer_files[tokenizer_type])
    texts = sample_texts + corpus_sample
    assert tok.batch_tokenize(texts) == [tok.tokenize(t) for t in texts]
    assert tok.batch_tokenize([]) == []
    ids = [i for t in texts for i in tok.tokenize(t)]
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)


def test_gpt2_bpe_matches_tokenizers_library(tokenizer_files, sample_texts):
    from tokenizers import ByteLevelBPETokenizer

    files = tokenizer_files["GPT2BPETokenizer"]
    tok = build_tokenizer("GPT2BPETokenizer", **files)
    ref = ByteLevelBPETokenizer(files["vocab_file"], files["merge_file"])
    with open(files["vocab_file"], encoding="utf-8") as f:
        vocab = json.load(f)
    assert tok.vocab_size == len(vocab)
    assert tok.eod == vocab["<|endoftext|>"]
    for text in _plain(sample_texts):
        assert tok.tokenize(text) == ref.encode(text).ids
        assert tok.detokenize(tok.tokenize(text)) == text  # byte-level BPE is lossless
    # The eod string inside a document is ordinary text, never the eod id.
    assert tok.eod not in tok.tokenize("a <|endoftext|> b")
    assert tok.detokenize(tok.tokenize("a <|endoftext|> b")) == "a <|endoftext|> b"
    with pytest.raises(MissingSpecialTokenError, match="GPT2BPETokenizer has no padding"):
        _ = tok.pad


def _sp(files):
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=files["tokenizer_model"])


def test_gpt_sentencepiece_matches_library(tokenizer_files, sample_texts):
    files = tokenizer_files["GPTSentencePieceTokenizer"]
    tok, sp = build_tokenizer("GPTSentencePieceTokenizer", **files), _sp(files)
    assert tok.vocab_size == sp.get_piece_size()
    assert (tok.eod, tok.eos, tok.bos) == (sp.eos_id(), sp.eos_id(), sp.bos_id())
    for text in sample_texts:
        ids = tok.tokenize(text)
        assert ids == sp.encode(text)
        assert tok.detokenize(ids) == sp.decode(ids)
    assert tok.detokenize(tok.tokenize("Hello World, café 中文")) == "Hello World, café 中文"
    assert sp.pad_id() == -1
    for role in ("pad", "cls", "sep", "mask"):
        with pytest.raises(MissingSpecialTokenError):
            getattr(tok, role)


def test_llama2_prepends_bos(tokenizer_files, sample_texts):
    files = tokenizer_files["Llama2Tokenizer"]
    tok, sp = build_tokenizer("Llama2Tokenizer", **files), _sp(files)
    for text in sample_texts:
        assert tok.tokenize(text) == [sp.bos_id()] + sp.encode(text)
    assert tok.eod == sp.eos_id()


def test_sentencepiece_special_tokens(tokenizer_files, sample_texts):
    files = tokenizer_files["SentencePieceTokenizer"]
    tok = build_tokenizer("SentencePieceTokenizer", vocab_extra_ids=3, **files)
    sp = _sp(files)
    n = sp.get_piece_size()
    # New strings are appended in Megatron's order; bos/eos reuse the model's <s> and </s>;
    # the model has no pad piece so <PAD> is added.
    assert (tok.cls, tok.sep, tok.eod, tok.mask, tok.pad) == (n, n + 1, n + 2, n + 3, n + 4)
    assert (tok.bos, tok.eos) == (sp.bos_id(), sp.eos_id())
    assert tok.additional_special_tokens_ids == [n + 5, n + 6, n + 7]
    assert tok.vocab_size == n + 8
    assert tok.vocab["<extra_id_2>"] == n + 7
    for text in _plain(sample_texts):
        assert tok.tokenize(text) == sp.encode(text)
    text = "first<MASK> second <extra_id_1></s>"
    expected = (
        sp.encode("first")
        + [tok.mask]
        + sp.encode(" second ")
        + [tok.additional_special_tokens_ids[1], tok.eos]
        + sp.encode("")
    )
    assert tok.tokenize(text) == expected
    assert tok.detokenize(tok.tokenize("a<SEP>b")) == sp.decode(sp.encode("a")) + " <SEP> " + "b"


@pytest.mark.parametrize("tokenizer_type,lower", [("BertWordPieceLowerCase", True), ("BertWordPieceCase", False)])
def test_wordpiece_matches_library(tokenizer_files, sample_texts, tokenizer_type, lower):
    from tokenizers import BertWordPieceTokenizer

    files = tokenizer_files[tokenizer_type]
    tok = build_tokenizer(tokenizer_type, vocab_extra_ids=2, **files)
    ref = BertWordPieceTokenizer(files["vocab_file"], lowercase=lower)
    with open(files["vocab_file"], encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    for role, token in [("cls", "[CLS]"), ("sep", "[SEP]"), ("pad", "[PAD]"), ("mask", "[MASK]")]:
        assert getattr(tok, role) == lines.index(token)
    n = len(lines)
    assert (tok.bos, tok.eos) == (n, n + 1)  # [BOS] [EOS] appended as in Megatron
    assert tok.additional_special_tokens_ids == [n + 2, n + 3]
    assert tok.vocab_size == n + 4
    for text in _plain(sample_texts):
        assert tok.tokenize(text) == ref.encode(text, add_special_tokens=False).ids
    text = "the value of x is returned."
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.detokenize([tok.cls] + tok.tokenize(text) + [tok.pad]) == text


def _read_megatron_ranks(path):
    with open(path, encoding="utf-8") as f:
        return {base64.b64decode(x["token_bytes"]): x["rank"] for x in json.load(f)}


def test_tiktoken_matches_library(tokenizer_files, sample_texts):
    import tiktoken

    from megatron.core.tokenizers.tiktoken_tokenizer import PATTERN_V2

    files = tokenizer_files["TikTokenizer"]
    tok = build_tokenizer("TikTokenizer", **files)
    ranks = _read_megatron_ranks(files["tokenizer_model"])
    ref = tiktoken.Encoding("ref", pat_str=PATTERN_V2, mergeable_ranks=ranks, special_tokens={})
    num_special = files["tiktoken_num_special_tokens"]
    assert tok.vocab_size == num_special + len(ranks) == files["vocab_size"]
    assert (tok.unk, tok.bos, tok.eos, tok.eod) == (0, 1, 2, 2)
    for text in sample_texts:
        ids = tok.tokenize(text)
        assert ids == [r + num_special for r in ref.encode_ordinary(text)]
        assert tok.detokenize(ids) == text
    assert tok.detokenize([tok.bos]) == "<s>"


def test_tiktoken_vocab_size_and_special_tokens(tokenizer_files):
    files = dict(tokenizer_files["TikTokenizer"])
    files.update(
        tiktoken_num_special_tokens=10, vocab_size=10 + 300, tiktoken_special_tokens=["<unk>", "<s>", "</s>", "<pad>"]
    )
    tok = build_tokenizer("TikTokenizer", **files)
    assert tok.vocab_size == 310 and tok.pad == 3
    assert tok.vocab["<SPECIAL_9>"] == 9
    assert max(tok.tokenize("a long text with many merges in it")) < 310  # ranks cut at 300
    with pytest.raises(ValueError, match="vocab_size=100000"):
        build_tokenizer("TikTokenizer", **{**files, "vocab_size": 100000})
    with pytest.raises(ValueError, match="tiktoken_special_tokens=.* must include"):
        build_tokenizer("TikTokenizer", **{**files, "tiktoken_special_tokens": ["<s>"]})
    with pytest.raises(ValueError, match="tiktoken_pattern=None: TikTokenizer requires one"):
        build_tokenizer("TikTokenizer", **{**files, "tiktoken_pattern": None})


def test_tiktoken_reads_tiktoken_line_format(tokenizer_files, tmp_path):
    files = tokenizer_files["TikTokenizer"]
    ranks = _read_megatron_ranks(files["tokenizer_model"])
    lines_file = tmp_path / "ranks.tiktoken"
    lines_file.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    a = build_tokenizer("TikTokenizer", **files)
    b = build_tokenizer("TikTokenizer", **{**files, "tokenizer_model": str(lines_file)})
    text = "Hello World, the value 42."
    assert a.tokenize(text) == b.tokenize(text)


def test_huggingface_matches_library(tokenizer_files, sample_texts):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    files = tokenizer_files["HuggingFaceTokenizer"]
    tok = build_tokenizer("HuggingFaceTokenizer", **files)
    ref = AutoTokenizer.from_pretrained(files["tokenizer_model"])
    raw = Tokenizer.from_file(os.path.join(files["tokenizer_model"], "tokenizer.json"))
    assert tok.vocab_size == len(ref) == raw.get_vocab_size()
    assert (tok.eod, tok.bos, tok.pad) == (raw.token_to_id("</s>"), raw.token_to_id("<s>"), raw.token_to_id("<pad>"))
    for text in sample_texts:
        ids = tok.tokenize(text)
        assert ids == ref(text).input_ids == raw.encode(text).ids
        assert ids[0] == tok.bos
        assert tok.detokenize(ids) == ref.decode(ids)
    # A bare tokenizer.json file works too.
    single = build_tokenizer(
        "HuggingFaceTokenizer", tokenizer_model=os.path.join(files["tokenizer_model"], "tokenizer.json")
    )
    assert single.tokenize("Hello World") == raw.encode("Hello World").ids


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=600)
    assert tok.vocab_size == 601 and tok.eod == 600
    assert tok.tokenize("5 17  3\n9") == [5, 17, 3, 9]
    assert tok.batch_tokenize(["1 2", ""]) == [[1, 2], []]
    assert tok.detokenize([5, 17, 3]) == "5 17 3"
    with pytest.raises(ValueError, match="vocab_size=None"):
        build_tokenizer("NullTokenizer")


def test_wordpiece_t5_ids_reuse_tokens_the_vocab_has(tmp_path):
    """As Megatron's _BertWordPieceTokenizer: [BOS], [EOS] and <extra_id_N> keep the id the vocab.txt
    gives them, and only the absent ones are appended, in that order (the T5 dataset's bos/eos/sentinels)."""
    from megatron.core.tokenizers.wordpiece import BertWordPieceTokenizer

    lines = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[EOS]", "<extra_id_1>", "word", "##piece"]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(lines) + "\n")
    tok = BertWordPieceTokenizer(str(vocab), lower_case=False, vocab_extra_ids=3)
    n = len(lines)
    assert (tok.bos, tok.eos) == (n, lines.index("[EOS]"))
    assert tok.additional_special_tokens_ids == [n + 1, lines.index("<extra_id_1>"), n + 2]
    assert tok.vocab_size == n + 3 and tok.inv_vocab[n + 2] == "<extra_id_2>"
    assert BertWordPieceTokenizer(str(vocab), vocab_extra_ids=0).additional_special_tokens_ids == []
