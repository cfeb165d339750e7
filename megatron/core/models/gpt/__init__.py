"""GPT: ``GPTModel`` and its layer specs (``GPTModel`` imported on first use, see ``megatron.core.models``)."""

from typing import Any

__all__ = ["GPTModel"]


def __getattr__(name: str) -> Any:
    if name == "GPTModel":
        from megatron.core.models.gpt.gpt_model import GPTModel

        return GPTModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
