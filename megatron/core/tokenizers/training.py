"""Training small tokenizers offline, writing the files each Megatron tokenizer type reads.

Used by ``tools/train_tokenizer.py`` and by tests that need real tokenizer files.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Dict, Iterable, Iterator, List, Optional

from megatron.core.tokenizers.gpt2_bpe import EOD_TOKEN
from megatron.core.tokenizers.tiktoken_tokenizer import PATTERNS, write_ranks_json

BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
HF_SPECIAL_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
# SentencePiece skips longer training lines (its max_sentence_length default).
SENTENCEPIECE_MAX_LINE_BYTES = 4192


@dataclasses.dataclass
class TrainedTokenizer:
    """What a training run wrote and how to use it.

    Attributes:
        tokenizer_type: Megatron ``--tokenizer-type``.
        kwargs: keyword arguments of ``build_tokenizer`` for these files.
        files: every file written.
    """

    tokenizer_type: str
    kwargs: Dict[str, object]
    files: List[str]

    def megatron_flags(self) -> List[str]:
        """The command-line flags that select this tokenizer in Megatron's scripts."""
        return megatron_flags(self.tokenizer_type, self.kwargs)


def megatron_flags(tokenizer_type: str, kwargs: Dict[str, object]) -> List[str]:
    """Megatron command-line flags equal to ``build_tokenizer(tokenizer_type, **kwargs)``: each keyword is
    spelled as Megatron's flag of the same name (``vocab_file`` -> ``--vocab-file``)."""
    flags = []
    for name, value in {"tokenizer_type": tokenizer_type, **kwargs}.items():
        flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte-to-character map: printable Latin-1 bytes stand for themselves, the other
    bytes take the characters from U+0100 upwards, in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _train_byte_level_bpe(
    texts: Iterable[str], vocab_size: int, special_tokens: List[str], split_pattern: Optional[str] = None
):
    """Trains a byte-level BPE ``tokenizers.Tokenizer``; ``split_pattern`` replaces GPT-2's
    pre-tokenization regex when given."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    if split_pattern is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split_pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def train_gpt2_bpe(texts: Iterable[str], vocab_size: int, output_dir: str) -> TrainedTokenizer:
    """Writes ``vocab.json`` and ``merges.txt`` (with ``<|endoftext|>``) for GPT2BPETokenizer."""
    tokenizer = _train_byte_level_bpe(texts, vocab_size, [EOD_TOKEN])
    vocab_file, merge_file = tokenizer.model.save(output_dir)
    return TrainedTokenizer(
        "GPT2BPETokenizer", {"vocab_file": vocab_file, "merge_file": merge_file}, [vocab_file, merge_file]
    )


def train_tiktoken(texts: Iterable[str], vocab_size: int, output_dir: str, pattern: str = "v2") -> TrainedTokenizer:
    """Writes ``tiktoken.json`` (Megatron's ranks format) for TikTokenizer.

    A byte-level BPE is trained with the tiktoken split regex; its tokens, mapped from GPT-2's
    byte characters back to bytes, become ranks: bytes 0-255 first, then merges in the order
    they were learnt, which is the priority order tiktoken merges by.
    """
    tokenizer = _train_byte_level_bpe(texts, vocab_size, [], split_pattern=PATTERNS[pattern])
    byte_of_char = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        token_bytes = bytes(byte_of_char[c] for c in token)
        ranks.setdefault(token_bytes, len(ranks))
    path = os.path.join(output_dir, "tiktoken.json")
    write_ranks_json(ranks, path)
    num_special = 1000
    return TrainedTokenizer(
        "TikTokenizer",
        {
            "tokenizer_model": path,
            "tiktoken_pattern": pattern,
            "tiktoken_num_special_tokens": num_special,
            "vocab_size": num_special + len(ranks),
        },
        [path],
    )


def train_huggingface(texts: Iterable[str], vocab_size: int, output_dir: str, chat: bool = False) -> TrainedTokenizer:
    """Writes a ``transformers`` tokenizer directory (byte-level BPE, ``<s>`` before each text).

    ``chat``: with ChatML's ``<|im_start|>`` / ``<|im_end|>`` special tokens and chat template
    (``megatron.core.tokenizers.chatml.CHATML_TEMPLATE``), as a chat model's tokenizer ships.
    """
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    from megatron.core.tokenizers.chatml import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE

    specials = list(HF_SPECIAL_TOKENS.values()) + (list(CHATML_SPECIAL_TOKENS) if chat else [])
    tokenizer = _train_byte_level_bpe(texts, vocab_size, specials)
    bos = HF_SPECIAL_TOKENS["bos_token"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
    )
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **HF_SPECIAL_TOKENS)
    if chat:
        wrapped.add_special_tokens({"additional_special_tokens": list(CHATML_SPECIAL_TOKENS)})
        wrapped.chat_template = CHATML_TEMPLATE
    files = list(wrapped.save_pretrained(output_dir))
    return TrainedTokenizer("HuggingFaceTokenizer", {"tokenizer_model": output_dir}, files)


def train_wordpiece(
    texts: Iterable[str], vocab_size: int, output_dir: str, lower_case: bool = True
) -> TrainedTokenizer:
    """Writes a BERT ``vocab.txt`` for BertWordPieceLowerCase (or BertWordPieceCase)."""
    from tokenizers import BertWordPieceTokenizer

    tokenizer = BertWordPieceTokenizer(lowercase=lower_case)
    tokenizer.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=2, special_tokens=BERT_SPECIAL_TOKENS, show_progress=False
    )
    (vocab_file,) = tokenizer.save_model(output_dir)
    kind = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
    return TrainedTokenizer(kind, {"vocab_file": vocab_file}, [vocab_file])


def _short_lines(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        for line in text.splitlines():
            if line.strip() and len(line.encode("utf-8")) <= SENTENCEPIECE_MAX_LINE_BYTES:
                yield line


def train_sentencepiece(
    texts: Iterable[str], vocab_size: int, output_dir: str, model_type: str = "bpe"
) -> TrainedTokenizer:
    """Writes ``tokenizer.model`` (Llama-style: unk 0, bos 1, eos 2, no pad, byte fallback).

    The model also serves SentencePieceTokenizer and Llama2Tokenizer; GPTSentencePieceTokenizer
    is named as the default type.
    """
    import sentencepiece

    prefix = os.path.join(output_dir, "tokenizer")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=_short_lines(texts),
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=True,
        hard_vocab_limit=False,
        character_coverage=0.9995,
        num_threads=min(4, os.cpu_count() or 1),
        minloglevel=2,
    )
    return TrainedTokenizer(
        "GPTSentencePieceTokenizer", {"tokenizer_model": prefix + ".model"}, [prefix + ".model", prefix + ".vocab"]
    )


TRAINERS: Dict[str, Callable[[Iterable[str], int, str], TrainedTokenizer]] = {
    "gpt2bpe": train_gpt2_bpe,
    "sentencepiece-bpe": lambda t, v, o: train_sentencepiece(t, v, o, "bpe"),
    "sentencepiece-unigram": lambda t, v, o: train_sentencepiece(t, v, o, "unigram"),
    "wordpiece": train_wordpiece,
    "wordpiece-cased": lambda t, v, o: train_wordpiece(t, v, o, lower_case=False),
    "tiktoken": train_tiktoken,
    "huggingface": train_huggingface,
    "huggingface-chat": lambda t, v, o: train_huggingface(t, v, o, chat=True),
}


def train_tokenizer(kind: str, texts: Iterable[str], vocab_size: int, output_dir: str) -> TrainedTokenizer:
    """Trains one kind of :data:`TRAINERS` on ``texts`` and writes its files to ``output_dir``."""
    if kind not in TRAINERS:
        raise ValueError(f"--type={kind!r} is not supported; choose one of {', '.join(TRAINERS)}")
    os.makedirs(output_dir, exist_ok=True)
    return TRAINERS[kind](texts, vocab_size, output_dir)
