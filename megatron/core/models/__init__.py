"""Model families built from the transformer blocks.

``GPTModel`` is imported on first use, so that the transformer modules can import
``megatron.core.models.common`` (rotary embeddings) without a circular import.
"""

from typing import Any

__all__ = ["GPTModel"]


def __getattr__(name: str) -> Any:
    if name == "GPTModel":
        from megatron.core.models.gpt.gpt_model import GPTModel

        return GPTModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
