"""Layer specs: which module class builds each part of a layer, chosen once per model."""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple, Type, Union

import torch

# A class, a function (returned as is by build_module), or Megatron-core's ("module.path", "Name").
SpecTarget = Union[Type[torch.nn.Module], type, Callable[..., Any], Tuple[str, str]]


@dataclass
class ModuleSpec:
    """A module class, keyword arguments for it, and specs of its own submodules.

    Attributes:
        module: the class (or function, or ``(module_path, name)`` to import) to build.
        params: keyword arguments ``build_module`` passes to it.
        submodules: passed as the ``submodules`` keyword when not None.
        metainfo: free-form notes about the spec (Megatron-core's field); never read when building.
    """

    module: SpecTarget
    params: Dict[str, Any] = field(default_factory=dict)
    submodules: Optional[Any] = None
    metainfo: Dict[str, Any] = field(default_factory=dict)


def import_module(module_path: Tuple[str, str]) -> Any:
    """The object ``name`` of module ``path`` for ``module_path = (path, name)``.

    Raises:
        ImportError: the module or the name does not exist (Megatron-core logs and returns None).
    """
    path, name = module_path
    module = importlib.import_module(path)
    try:
        return getattr(module, name)
    except AttributeError as err:
        raise ImportError(f"cannot import name {name!r} from {path!r}") from err


def get_module(spec_or_module: Union[ModuleSpec, SpecTarget], **additional_kwargs: Any) -> Any:
    """The class or function a spec names, imported if given as ``(module_path, name)``.

    ``additional_kwargs`` is accepted for Megatron-core's signature and, as there, unused.
    """
    del additional_kwargs
    target = spec_or_module.module if isinstance(spec_or_module, ModuleSpec) else spec_or_module
    return import_module(target) if isinstance(target, tuple) else target


def build_module(spec_or_module: Union[ModuleSpec, SpecTarget], *args: Any, **kwargs: Any) -> Any:
    """Instantiate a spec (a ModuleSpec, a class, or ``(module_path, name)``) with the given arguments.

    A function (bare or as a ModuleSpec's ``module``) is returned itself, not called, as in
    Megatron-core (e.g. an activation chosen by a spec). A ModuleSpec's ``params`` are added to the
    keywords and its ``submodules``, when set, passed as ``submodules=``. An exception raised while
    building is re-raised as the same type with the class name appended.
    """
    module = get_module(spec_or_module)
    if isinstance(module, types.FunctionType):
        return module
    params: Dict[str, Any] = {}
    if isinstance(spec_or_module, ModuleSpec):
        params = spec_or_module.params
        if spec_or_module.submodules is not None:
            kwargs["submodules"] = spec_or_module.submodules
    try:
        return module(*args, **params, **kwargs)
    except Exception as err:
        try:
            annotated = type(err)(f"{err} when instantiating {getattr(module, '__name__', module)}")
        except Exception:  # noqa: BLE001 - an exception type with another constructor: keep it as is
            raise err from None
        raise annotated.with_traceback(err.__traceback__) from err
