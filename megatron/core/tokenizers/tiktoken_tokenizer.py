"""tiktoken BPE from a local ranks file (``--tokenizer-type TikTokenizer``).

Ranks file formats, chosen by the file name:

* ``*.json`` (Megatron's format): a JSON list whose item k is
  ``{"rank": k, "token_bytes": base64(bytes), "token_str": readable text}``; items 0-255 are the
  single bytes 0-255 in order.
* anything else (tiktoken's own ``.tiktoken`` format): lines ``base64(bytes) rank``.

Ids: the first ``num_special_tokens`` ids are special tokens (``<unk> <s> </s>``, then
``--tiktoken-special-tokens``, then fillers ``<SPECIAL_k>``); BPE token of rank r has id
``r + num_special_tokens``.
"""

from __future__ import annotations

import base64
import json
from typing import Dict, List, Optional, Sequence, Union

from megatron.core.tokenizers.base import MegatronTokenizer, check_file, default_num_threads

PATTERN_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
PATTERN_V2 = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PATTERNS = {"v1": PATTERN_V1, "v2": PATTERN_V2}
REQUIRED_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def read_ranks(path: str) -> Dict[bytes, int]:
    """Reads a ranks file in either format (see the module docstring); ranks must be 0..n-1."""
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            items = json.load(f)
            ranks = {base64.b64decode(x["token_bytes"]): int(x["rank"]) for x in items}
        else:
            ranks = {}
            for line in f:
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"tokenizer_model={path!r}: ranks are not the distinct ids 0..{len(ranks) - 1}")
    missing = [b for b in range(256) if ranks.get(bytes([b])) != b]
    if missing:
        raise ValueError(
            f"tokenizer_model={path!r}: rank b must be the single byte b for b < 256; wrong for {missing[:5]}"
        )
    return ranks


def write_ranks_json(ranks: Dict[bytes, int], path: str) -> None:
    """Writes ranks in Megatron's JSON format."""
    items = [
        {
            "rank": r,
            "token_bytes": base64.b64encode(t).decode("ascii"),
            "token_str": t.decode("utf-8", errors="replace"),
        }
        for t, r in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(items, f, ensure_ascii=False)


def special_token_list(num_special_tokens: int, special_tokens: Optional[List[str]]) -> List[str]:
    """The strings of ids ``0 .. num_special_tokens-1``."""
    tokens = list(special_tokens) if special_tokens else list(REQUIRED_SPECIAL_TOKENS)
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"tiktoken_special_tokens={tokens}: has duplicates")
    absent = [t for t in REQUIRED_SPECIAL_TOKENS if t not in tokens]
    if absent:
        raise ValueError(
            f"tiktoken_special_tokens={tokens}: must include {list(REQUIRED_SPECIAL_TOKENS)}; missing {absent}"
        )
    if len(tokens) > num_special_tokens:
        raise ValueError(
            f"tiktoken_num_special_tokens={num_special_tokens} is less than the {len(tokens)} special tokens given"
        )
    return tokens + [f"<SPECIAL_{i}>" for i in range(len(tokens), num_special_tokens)]


class TikTokenizer(MegatronTokenizer):
    """Byte-level BPE run by ``tiktoken`` from local ranks; no download ever happens.

    Special-token strings inside text are encoded as ordinary text; ``detokenize`` writes a
    special id as its string.

    Args:
        tokenizer_model: ranks file (see the module docstring).
        pattern: ``"v1"``, ``"v2"`` (Megatron's split regexes) or a regex of your own.
        vocab_size: total ids; BPE ranks beyond ``vocab_size - num_special_tokens`` are dropped.
            Default: every rank of the file plus the special tokens.
        num_special_tokens: ids reserved in front of the BPE ranks.
        special_tokens: first special strings; must include ``<unk> <s> </s>``.
        num_threads: threads for batch encoding; default one per available core.
    """

    tokenizer_type = "TikTokenizer"

    def __init__(
        self,
        tokenizer_model: str,
        pattern: Optional[str],
        vocab_size: Optional[int] = None,
        num_special_tokens: int = 1000,
        special_tokens: Optional[List[str]] = None,
        num_threads: Optional[int] = None,
    ):
        check_file(tokenizer_model, "tokenizer_model", "tiktoken ranks file")
        if pattern is None:
            raise ValueError("tiktoken_pattern=None: TikTokenizer requires one: v1, v2 or a regex")
        import tiktoken

        specials = special_token_list(num_special_tokens, special_tokens)
        ranks = read_ranks(tokenizer_model)
        if vocab_size is None:
            vocab_size = num_special_tokens + len(ranks)
        inner = vocab_size - num_special_tokens
        if not 256 <= inner <= len(ranks):
            raise ValueError(
                f"vocab_size={vocab_size} must be between {num_special_tokens + 256} "
                f"and {num_special_tokens + len(ranks)} (tiktoken_num_special_tokens="
                f"{num_special_tokens} plus the {len(ranks)} ranks of the file)"
            )
        # Shifting every rank keeps the merge order and makes tiktoken emit final ids directly.
        shifted = {t: r + num_special_tokens for t, r in ranks.items() if r < inner}
        self._specials = {t: i for i, t in enumerate(specials)}
        named = {"bos": "<s>", "eos": "</s>", "eod": "</s>", "pad": "<pad>", "mask": "<mask>"}
        self._special_ids = {role: self._specials[t] for role, t in named.items() if t in self._specials}
        self._vocab_size = vocab_size
        self._num_threads = num_threads or default_num_threads()
        self._model = tiktoken.Encoding(
            name="megatron_tiktoken",
            pat_str=PATTERNS.get(pattern, pattern),
            mergeable_ranks=shifted,
            special_tokens=self._specials,
        )
        self._vocab: Dict[Union[bytes, str], int] = {**shifted, **self._specials}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> Dict[Union[bytes, str], int]:
        """BPE tokens as bytes, special tokens as str."""
        return self._vocab

    def tokenize(self, text: str) -> List[int]:
        return self._model.encode_ordinary(text)

    def batch_tokenize(self, texts: List[str]) -> List[List[int]]:
        return self._model.encode_ordinary_batch(list(texts), num_threads=self._num_threads)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._model.decode(list(ids))

    @property
    def unk(self) -> int:
        """Id of ``<unk>``."""
        return self._specials["<unk>"]
