"""The interface every Megatron tokenizer implements.

Only the standard library is imported here: preprocessing workers import this package before they
know which tokenizer they need, and importing torch or a tokenizer library would cost seconds.
"""

from __future__ import annotations

import abc
import json
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Union


class MissingSpecialTokenError(NotImplementedError):
    """Raised when a tokenizer's vocabulary has no token for a special role (pad, cls, ...).

    A subclass of ``NotImplementedError`` because that is what Megatron's tokenizers raise, and
    callers such as the GPT dataset catch it to fall back to a default.
    """


def check_file(path: Optional[str], name: str, what: str) -> str:
    """Returns ``path`` if it names an existing file, else raises an error naming the argument ``name``."""
    if path is None:
        raise ValueError(f"{name}=None: required, give the {what}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{name}={path!r}: no such file ({what})")
    return path


def default_num_threads() -> int:
    """Threads for a library's native batch encoding: one per core the process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


# Megatron-core's tokenizer "library" names (the metadata of ``from_pretrained``) -> a builder taking
# ``(tokenizer_path, **kwargs)``. Each tokenizer module registers its own names, so this module
# imports none of them.
_LIBRARIES: Dict[str, Callable[..., MegatronTokenizer]] = {}


def register_library(*names: str) -> Callable[[Callable[..., MegatronTokenizer]], Callable[..., MegatronTokenizer]]:
    """Decorator: ``MegatronTokenizer.from_pretrained`` builds metadata ``library`` ``names`` with it."""

    def register(builder: Callable[..., MegatronTokenizer]) -> Callable[..., MegatronTokenizer]:
        for name in names:
            _LIBRARIES[name] = builder
        return builder

    return register


def _read_metadata(tokenizer_path: Optional[str], metadata_path: Union[None, str, dict]) -> dict:
    """The metadata dict: given, read from a JSON file, or ``tokenizer_metadata.json`` beside the path."""
    if isinstance(metadata_path, dict):
        return dict(metadata_path)
    if metadata_path is None:
        if tokenizer_path is None:
            raise ValueError("from_pretrained needs tokenizer_path or metadata_path (e.g. {'library': 'null'})")
        folder = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(tokenizer_path)
        metadata_path = os.path.join(folder, "tokenizer_metadata.json")
    if not isinstance(metadata_path, str):
        raise ValueError(f"metadata_path={metadata_path!r}: expected a path or a dict")
    if not os.path.isfile(metadata_path):
        raise FileNotFoundError(f"metadata_path={metadata_path!r}: no such tokenizer metadata file")
    with open(metadata_path) as f:
        return json.load(f)


class MegatronTokenizer(abc.ABC):
    """A text tokenizer with Megatron's interface.

    Ids are plain Python ints. Special-token properties (``eod``, ``pad``, ``bos``, ``eos``,
    ``cls``, ``sep``, ``mask``) return an id, or raise :class:`MissingSpecialTokenError` when the
    vocabulary has no such token; they never return a sentinel such as -1 or None.
    """

    #: Megatron's ``--tokenizer-type`` name of this tokenizer.
    tokenizer_type: str = "MegatronTokenizer"

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, before padding for the embedding table."""

    @property
    def vocab(self) -> Dict[str, int]:
        """Token string to id."""
        raise NotImplementedError(f"{self.tokenizer_type} has no vocabulary mapping")

    @property
    def inv_vocab(self) -> Dict[int, str]:
        """Id to token string, built once from :attr:`vocab`."""
        if getattr(self, "_inv_vocab_cache", None) is None:
            self._inv_vocab_cache = {i: t for t, i in self.vocab.items()}
        return self._inv_vocab_cache

    @abc.abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Encodes one text into ids."""

    @abc.abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Decodes ids back into text."""

    def batch_tokenize(self, texts: List[str]) -> List[List[int]]:
        """Encodes many texts; equal to ``[self.tokenize(t) for t in texts]``.

        Subclasses backed by a library override this with the library's native batch encoder,
        which is the hot path of preprocessing.
        """
        return [self.tokenize(t) for t in texts]

    #: Description of each special-token role, for error messages.
    SPECIAL_ROLES = {
        "eod": "end-of-document (eod)",
        "pad": "padding (pad)",
        "bos": "beginning-of-sequence (bos)",
        "eos": "end-of-sequence (eos)",
        "cls": "classification (cls)",
        "sep": "separator (sep)",
        "mask": "mask",
    }

    def special_id(self, role: str) -> Optional[int]:
        """The id playing ``role`` (a key of ``SPECIAL_ROLES``), or None when there is none.

        The default reads ``self._special_ids`` (role -> id), which most tokenizers fill in
        their constructor; tokenizers that ask their library instead override this.
        """
        return getattr(self, "_special_ids", {}).get(role)

    def _role(self, role: str) -> int:
        found = self.special_id(role)
        if found is None:
            raise MissingSpecialTokenError(f"{self.tokenizer_type} has no {self.SPECIAL_ROLES[role]} token")
        return found

    @property
    def eod(self) -> int:
        """End-of-document id, appended after each document by preprocessing."""
        return self._role("eod")

    @property
    def pad(self) -> int:
        """Padding id."""
        return self._role("pad")

    @property
    def bos(self) -> int:
        """Beginning-of-sequence id."""
        return self._role("bos")

    @property
    def eos(self) -> int:
        """End-of-sequence id."""
        return self._role("eos")

    @property
    def cls(self) -> int:
        """Classification id (BERT's ``[CLS]``)."""
        return self._role("cls")

    @property
    def sep(self) -> int:
        """Separator id (BERT's ``[SEP]``)."""
        return self._role("sep")

    @property
    def mask(self) -> int:
        """Mask id for masked language modelling."""
        return self._role("mask")

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        """Ids of the T5 sentinels ``<extra_id_N>`` added by ``--vocab-extra-ids``; may be empty."""
        return list(getattr(self, "_extra_ids", []))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"

    @staticmethod
    def from_pretrained(
        tokenizer_path: Optional[str] = None,
        metadata_path: Union[None, str, dict] = None,
        *,
        metdata_path: Union[None, str, dict] = None,
        **kwargs: Any,
    ) -> MegatronTokenizer:
        """Megatron-core's way to build a tokenizer from its metadata (``{"library": ...}``).

        Libraries: ``null`` / ``null-text`` (keyword ``vocab_size``), ``huggingface`` and
        ``sentencepiece`` (from ``tokenizer_path``); others raise ``NotImplementedError`` (build
        those with ``build_tokenizer``). ``metdata_path`` is the spelling Megatron-LM's
        ``examples/run_simple_mcore_train_loop.py`` uses, accepted as the same argument.

        Args:
            tokenizer_path: the tokenizer's file or folder (not needed for ``null``).
            metadata_path: a metadata dict or the path of its JSON file; default
                ``tokenizer_metadata.json`` beside ``tokenizer_path``.
            **kwargs: passed to the library's tokenizer (unknown ones raise ``TypeError``).
        """
        if metdata_path is not None:
            if metadata_path is not None:
                raise TypeError("from_pretrained got both metadata_path and metdata_path")
            metadata_path = metdata_path
        metadata = _read_metadata(tokenizer_path, metadata_path)
        library = metadata.get("library")
        if library not in _LIBRARIES:
            raise NotImplementedError(
                f"tokenizer library={library!r}: not supported yet by from_pretrained "
                f"(supported: {sorted(_LIBRARIES)}); use build_tokenizer"
            )
        return _LIBRARIES[library](tokenizer_path, **kwargs)


class TokenizersLibraryMixin:
    """Vocabulary and encoding for tokenizers backed by the ``tokenizers`` library.

    Expects ``self._tokenizer`` (a ``tokenizers.Tokenizer``) and ``self._vocab`` (token -> id).
    """

    _tokenizer: object
    _vocab: Dict[str, int]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    def tokenize(self, text: str) -> List[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def batch_tokenize(self, texts: List[str]) -> List[List[int]]:
        # encode_batch_fast skips the character offsets, which nothing here reads.
        encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [e.ids for e in encodings]
