"""Megatron-LM's ``ArgumentGroupFactory``: command-line arguments generated from a config dataclass.

For code written against Megatron-LM that builds its own parser from a dataclass. Our own flags
come from their records in ``megatron/training/flags/``; nothing here is used by ``pretrain``.

Each field ``some_name`` becomes ``--some-name`` (``dest`` the field name) with the field's default
(``default_factory`` called), its attribute docstring as help, and the type read from the
annotation: ``Optional[X]`` as ``X``, ``list[X]`` with ``nargs="+"``, ``Literal[...]`` as choices, an
``Enum`` by member name, a ``bool`` as a switch (``--x`` when it defaults to False,
``--no-x`` / ``--disable-x`` when it defaults to True). A field's ``metadata["argparse_meta"]``
(``add_argument`` keywords, plus ``arg_names``) wins over what was inferred; a type that cannot
be inferred (a union of several types) raises ``TypeInferenceError`` unless that metadata is there.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import textwrap
import types
import typing
from argparse import ArgumentParser, _ArgumentGroup
from typing import Any, Dict, List, Optional

__all__ = ["ArgumentGroupFactory", "TypeInferenceError"]


class TypeInferenceError(Exception):
    """A field's annotation has no argparse equivalent (and no ``argparse_meta`` says what to use)."""


def _field_docstrings(cls: type) -> Dict[str, str]:
    """``{field: docstring}`` from string literals right after annotated fields, base classes first."""
    found: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # defined where there is no source (an interactive session)
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                found[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return found


def _type_kwargs(annotation: Any) -> Dict[str, Any]:
    """``type`` / ``nargs`` / ``choices`` keywords for ``add_argument`` from a field's annotation."""
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {"type": lambda name: annotation[name], "choices": list(annotation)}
    origin, inner = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is None:
        return {"type": annotation}
    if origin in (typing.Union, types.UnionType):
        rest = [t for t in inner if t is not type(None)]
        if len(rest) == 1 and len(inner) == 2:
            return _type_kwargs(rest[0])
        raise TypeInferenceError(f"a union of several types has no argparse type: {annotation}")
    if origin is list and len(inner) == 1:
        return {**_type_kwargs(inner[0]), "nargs": "+"}
    if origin is typing.Literal:
        kinds = {type(choice) for choice in inner}
        if len(kinds) != 1:
            raise TypeInferenceError(f"Literal choices of several types: {annotation}")
        return {"type": kinds.pop(), "choices": inner}
    raise TypeInferenceError(f"no argparse type for {annotation}")


class ArgumentGroupFactory:
    """Adds one argument group to a parser, one argument per field of ``src_cfg_class`` (see the module doc).

    Args:
        src_cfg_class: the dataclass (the class, not an instance).
        exclude: field names to leave out.
    """

    def __init__(self, src_cfg_class: type, exclude: Optional[List[str]] = None) -> None:
        self.src_cfg_class = src_cfg_class
        self.field_docstrings = _field_docstrings(src_cfg_class)
        self.exclude = set(exclude or ())
        self._hints = typing.get_type_hints(src_cfg_class)

    @staticmethod
    def _format_arg_name(config_attr_name: str, prefix: Optional[str] = None) -> str:
        """``--name-with-hyphens`` for a field (``--prefix-name`` with a prefix such as ``no``)."""
        name = f"{prefix}_{config_attr_name}" if prefix else config_attr_name
        return "--" + name.replace("_", "-")

    def _build_argparse_kwargs_from_field(self, attribute: dataclasses.Field) -> Dict[str, Any]:
        """``add_argument`` keywords (plus ``arg_names``) for one field."""
        no_default = attribute.default is dataclasses.MISSING
        default = attribute.default_factory() if no_default and callable(attribute.default_factory) else None
        kwargs: Dict[str, Any] = {
            "arg_names": [self._format_arg_name(attribute.name)],
            "dest": attribute.name,
            "help": self.field_docstrings.get(attribute.name, ""),
            "default": default if no_default else attribute.default,
        }
        meta = attribute.metadata.get("argparse_meta")
        try:
            kwargs.update(_type_kwargs(self._hints.get(attribute.name, attribute.type)))
        except TypeInferenceError:
            if meta is None:
                raise
        if kwargs.get("type") is bool:
            del kwargs["type"]
            kwargs["action"] = "store_true" if kwargs["default"] is False else "store_false"
            if kwargs["action"] == "store_false":
                kwargs["arg_names"] = [self._format_arg_name(attribute.name, p) for p in ("no", "disable")]
        kwargs.update(meta or {})
        return kwargs

    def build_group(self, parser: ArgumentParser, title: Optional[str] = None) -> _ArgumentGroup:
        """Add the group (described by the class docstring) to ``parser`` and return it."""
        group = parser.add_argument_group(title=title, description=self.src_cfg_class.__doc__)
        for attribute in dataclasses.fields(self.src_cfg_class):
            if attribute.name in self.exclude or not attribute.init:
                continue
            kwargs = self._build_argparse_kwargs_from_field(attribute)
            group.add_argument(*kwargs.pop("arg_names"), **kwargs)
        return group
