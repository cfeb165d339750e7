"""Conversations -> token ids and the mask of the tokens the loss counts (assistant turns only).

A conversation is a list of messages ``{"role": "system"|"user"|"assistant", "content": str}``;
a JSON line gives it as ``messages``, or as ``prompt`` / ``response`` (optionally ``system``).

Two ways to format one (``sft_tokenizer_prompt_format``):

* ``"chat_template"``: the tokenizer's own chat template (Hugging Face tokenizers). The whole
  conversation is rendered once and tokenized once, so the ids are what the model sees at inference;
  an assistant turn's characters are those between the rendering of the messages before it (with
  the generation prompt) and the rendering up to it, so its end-of-turn text counts too. A token is
  trained when its first character lies in an assistant turn (character offsets from the tokenizer).
* ``"chatml"``: a built-in ChatML format (``<|im_start|>role\\n content<|im_end|>\\n``) for tokenizers
  without a template: each piece is tokenized on its own, the assistant's content and its
  ``<|im_end|>\\n`` trained. ``CHATML_TEMPLATE`` is the same format as a Jinja chat template.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from megatron.core.tokenizers.chatml import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE  # noqa: F401 - re-exported

PROMPT_FORMATS = ("chat_template", "chatml")
ROLES = ("system", "user", "assistant")

Messages = List[Dict[str, str]]


def conversation_messages(record: Any, need_assistant: bool = True) -> Messages:
    """The messages of one JSON record; a ValueError saying what is wrong otherwise.

    ``need_assistant``: a training conversation must hold an assistant turn (a chat request need not).
    """
    if not isinstance(record, dict):
        raise ValueError(f"a JSON object expected, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record and "response" in record:
        messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
        if "system" in record:
            messages.insert(0, {"role": "system", "content": record["system"]})
    else:
        raise ValueError("neither 'messages' nor 'prompt' and 'response'")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must be {{'role': one of {ROLES}, 'content': a string}}")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant message (nothing to train on)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def hf_tokenizer(tokenizer: Any) -> Any:
    """The ``transformers`` tokenizer inside our ``HuggingFaceTokenizer`` (or the object itself)."""
    if hasattr(tokenizer, "apply_chat_template"):  # already one (its own _tokenizer is the Rust backend)
        return tokenizer
    return getattr(tokenizer, "_tokenizer", tokenizer)


def _encode(tokenizer: Any, text: str) -> List[int]:
    """Ids of ``text`` without the tokenizer's own added specials (a bos per piece would repeat)."""
    hf = hf_tokenizer(tokenizer)
    if hasattr(hf, "encode") and hasattr(hf, "apply_chat_template"):
        return list(hf.encode(text, add_special_tokens=False))
    return list(tokenizer.tokenize(text))


def assistant_char_spans(hf: Any, messages: Messages) -> Tuple[str, List[Tuple[int, int]]]:
    """The rendered conversation and the ``[start, end)`` characters of each assistant turn."""
    full = hf.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = hf.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = hf.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (full.startswith(before) and full.startswith(upto) and len(before) <= len(upto)):
            raise ValueError(
                f"the tokenizer's chat template does not render message {i} as a prefix of the conversation: "
                "its assistant tokens cannot be found (use sft_tokenizer_prompt_format='chatml')"
            )
        spans.append((len(before), len(upto)))
    return full, spans


def _with_template(tokenizer: Any, messages: Messages) -> Tuple[List[int], List[bool]]:
    hf = hf_tokenizer(tokenizer)
    if not getattr(hf, "chat_template", None):
        raise ValueError(
            f"sft_tokenizer_prompt_format='chat_template': the tokenizer ({type(hf).__name__}) has no chat "
            "template; give one, or use the built-in 'chatml'"
        )
    full, spans = assistant_char_spans(hf, messages)
    enc = hf(full, add_special_tokens=False, return_offsets_mapping=True)
    trained = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), trained


def _with_chatml(tokenizer: Any, messages: Messages) -> Tuple[List[int], List[bool]]:
    ids: List[int] = []
    trained: List[bool] = []
    for m in messages:
        for text, train in ((_chatml_header(m["role"]), False), (f"{m['content']}<|im_end|>\n", None)):
            piece = _encode(tokenizer, text)
            ids += piece
            trained += [m["role"] == "assistant" if train is None else train] * len(piece)
    return ids, trained


def _chatml_header(role: str) -> str:
    return f"<|im_start|>{role}\n"


def default_prompt_format(tokenizer: Any) -> str:
    """``chat_template`` when the tokenizer has one (``--sft-tokenizer-prompt-format``'s default), else ``chatml``."""
    return "chat_template" if getattr(hf_tokenizer(tokenizer), "chat_template", None) else "chatml"


def generation_prompt_ids(tokenizer: Any, messages: Messages, prompt_format: str) -> List[int]:
    """Token ids of ``messages`` followed by the assistant turn's opening, as in training (the prompt of a chat)."""
    if prompt_format == "chat_template":
        hf = hf_tokenizer(tokenizer)
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(hf.encode(text, add_special_tokens=False))
    ids, _ = format_conversation(tokenizer, messages, prompt_format) if messages else ([], [])
    return ids + _encode(tokenizer, _chatml_header("assistant"))


def format_conversation(tokenizer: Any, messages: Messages, prompt_format: str) -> Tuple[List[int], List[bool]]:
    """Token ids of ``messages`` and, per token, whether the loss counts it (assistant turns only)."""
    if prompt_format == "chat_template":
        return _with_template(tokenizer, messages)
    if prompt_format == "chatml":
        return _with_chatml(tokenizer, messages)
    raise ValueError(f"sft_tokenizer_prompt_format={prompt_format!r}: must be one of {PROMPT_FORMATS}")
