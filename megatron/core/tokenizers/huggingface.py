"""A ``transformers`` tokenizer from local files (``--tokenizer-type HuggingFaceTokenizer``)."""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

from megatron.core.tokenizers.base import MegatronTokenizer, register_library


def load_hf_tokenizer(tokenizer_model: Optional[str], trust_remote_code: bool = False, **kwargs):
    """Loads a ``transformers`` tokenizer without touching the network.

    Args:
        tokenizer_model: a directory written by ``save_pretrained`` (or a hub cache entry's
            name), or a ``tokenizer.json`` file of the ``tokenizers`` library.
        trust_remote_code: allow tokenizer code shipped in the directory to run.
        **kwargs: passed on to ``from_pretrained``.
    """
    if tokenizer_model is None:
        raise ValueError("tokenizer_model=None: required, give a local tokenizer directory or tokenizer.json")
    import transformers

    if os.path.isfile(tokenizer_model):
        return transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer_model, **kwargs)
    try:
        # local_files_only: a hub name is only accepted if it is already in the local cache.
        return transformers.AutoTokenizer.from_pretrained(
            tokenizer_model, local_files_only=True, trust_remote_code=trust_remote_code, **kwargs
        )
    except (OSError, ValueError) as err:
        raise FileNotFoundError(
            f"tokenizer_model={tokenizer_model!r} is neither a tokenizer.json file, a directory "
            f"of tokenizer files, nor a model in the local Hugging Face cache (nothing is "
            f"downloaded): {err}"
        ) from err


class HuggingFaceTokenizer(MegatronTokenizer):
    """Wraps a ``transformers`` tokenizer; ``tokenize`` adds the tokenizer's own special tokens
    (e.g. a Llama bos), as Megatron's does. eod is the tokenizer's eos.

    Args:
        tokenizer_model: see :func:`load_hf_tokenizer`.
        trust_remote_code: allow tokenizer code shipped in the directory to run.
        **kwargs: passed on to ``from_pretrained``.
    """

    tokenizer_type = "HuggingFaceTokenizer"

    def __init__(self, tokenizer_model: str, trust_remote_code: bool = False, **kwargs):
        self._tokenizer = load_hf_tokenizer(tokenizer_model, trust_remote_code, **kwargs)
        self._vocab: Optional[Dict[str, int]] = None

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens too, unlike the tokenizer's own vocab_size attribute.
        return len(self._tokenizer)

    @property
    def vocab(self) -> Dict[str, int]:
        if self._vocab is None:
            self._vocab = self._tokenizer.get_vocab()
        return self._vocab

    def tokenize(self, text: str) -> List[int]:
        return self.batch_tokenize([text])[0]

    def batch_tokenize(self, texts: List[str]) -> List[List[int]]:
        if not texts:  # transformers fails on an empty batch
            return []
        # A list input goes to the Rust backend's batch encoder in one call.
        out = self._tokenizer(list(texts), return_attention_mask=False, return_token_type_ids=False)
        return out["input_ids"]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids))

    def special_id(self, role: str) -> Optional[int]:
        # The library knows its special tokens; Megatron's eod is the model's eos.
        return getattr(self._tokenizer, f"{'eos' if role == 'eod' else role}_token_id", None)

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        tokens = getattr(self._tokenizer, "additional_special_tokens", None) or []
        return self._tokenizer.convert_tokens_to_ids(list(tokens)) if tokens else []


@register_library("huggingface")
def _hf_from_pretrained(tokenizer_path: Optional[str], **kwargs) -> HuggingFaceTokenizer:
    """``MegatronTokenizer.from_pretrained`` for the huggingface library."""
    return HuggingFaceTokenizer(tokenizer_path, **kwargs)
