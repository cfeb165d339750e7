"""What every family of the converter shares: its error, the model-flags type, and the check that names a
Hugging Face config field. Imports nothing of the converter, so that every module may use it."""

from __future__ import annotations

from typing import Any, Dict, Tuple

Args = Dict[str, Any]  # model flags by argparse destination


class ConversionError(ValueError):
    """The checkpoint or config cannot be converted; the message names the file and field."""


def require_field(hf: Dict[str, Any], field: str, allowed: Tuple[Any, ...], where: str) -> None:
    if hf.get(field) not in allowed:
        raise ConversionError(
            f"{where}: field {field!r} is {hf.get(field)!r}; the converter supports {' or '.join(map(repr, allowed))}"
        )
