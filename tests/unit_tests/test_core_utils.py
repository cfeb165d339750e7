"""``unwrap_model`` (Megatron-core's signature) and the one parameter naming of checkpoints and optimizer state."""

from __future__ import annotations

import pytest
import torch

from megatron.core.utils import named_model_params, unwrap_model
from megatron.training import utils as training_utils


class Wrapper(torch.nn.Module):
    """Stands for the data-parallel wrapper: holds the model as ``.module`` and says it wraps."""

    is_ddp_wrapper = True

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


class HoldsModule(torch.nn.Module):
    """A model whose own submodule happens to be called ``module``: not a wrapper."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(2, 2)


def test_unwrap_strips_wrappers_only():
    model = HoldsModule()
    assert unwrap_model(Wrapper(Wrapper(model))) is model
    assert unwrap_model(model) is model  # its ``.module`` is a layer, not the model


def test_unwrap_takes_lists_and_wrapper_classes():
    models = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    assert unwrap_model([Wrapper(m) for m in models]) == models
    assert unwrap_model(Wrapper(models[0]), module_instances=(HoldsModule,)).module is models[0]
    assert unwrap_model(HoldsModule(), module_instances=HoldsModule).weight.shape == (2, 2)


def test_training_utils_exports_the_same_function():
    assert training_utils.unwrap_model is unwrap_model


def test_named_model_params_prefixes_chunks():
    one = torch.nn.Linear(2, 3)
    assert [name for name, _ in named_model_params([Wrapper(one)])] == ["weight", "bias"]
    chunks = [Wrapper(torch.nn.Linear(2, 2)), torch.nn.Linear(2, 2, bias=False)]
    named = named_model_params(chunks)
    assert [name for name, _ in named] == ["chunk0.weight", "chunk0.bias", "chunk1.weight"]
    assert named[2][1] is chunks[1].weight


# ---------------------------------------------------------------- megatron-core's version checks and experimental gate
def test_torch_version_checks_follow_packaging_order():
    from packaging.version import Version

    from megatron.core.utils import get_torch_version, is_torch_min_version

    installed = Version(torch.__version__)
    assert get_torch_version() == installed
    assert is_torch_min_version("2.0") and not is_torch_min_version("99.0")
    assert is_torch_min_version(torch.__version__)  # equality counts by default
    assert not is_torch_min_version(torch.__version__, check_equality=False)


def test_te_version_checks_with_and_without_transformer_engine(monkeypatch):
    import sys
    import types

    from packaging.version import Version

    from megatron.core.utils import get_te_version, is_te_min_version

    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import fails: not installed
    assert get_te_version() is None and not is_te_min_version("0.1")
    monkeypatch.setitem(sys.modules, "transformer_engine", types.SimpleNamespace(__version__="2.9.0+abc"))
    assert get_te_version() == Version("2.9.0+abc")
    assert is_te_min_version("2.9.0") and is_te_min_version("1.13") and not is_te_min_version("2.10")
    assert not is_te_min_version("2.9.0+abc", check_equality=False)


def test_experimental_cls_works_only_while_the_flag_is_on():
    from megatron.core import config
    from megatron.core.utils import ExperimentalNotEnabledError, experimental_cls

    class Plain:
        LIMIT = 3

        def __init__(self, x: int) -> None:
            self.x = x

        def doubled(self) -> int:
            return 2 * self.x

    Gated = experimental_cls(introduced_with_version="0.16.0")(Plain)
    assert config.is_experimental_enabled() is False
    assert Gated.is_experimental is False
    for use in (lambda: Gated(1), lambda: Gated.LIMIT):
        with pytest.raises(ExperimentalNotEnabledError):
            use()
    config.set_experimental_flag(True)
    try:
        obj = Gated(4)
        assert obj.doubled() == 8 and obj.x == 4 and Gated.LIMIT == 3 and isinstance(obj, Plain)
        assert Gated.is_experimental is True and obj.is_experimental is True
    finally:
        config.set_experimental_flag(False)
    with pytest.raises(ExperimentalNotEnabledError):
        obj.doubled()
    assert Plain(5).doubled() == 10  # the undecorated class is untouched


def test_process_groups_config_path_and_group_helper_without_distributed():
    from megatron.core import process_groups, process_groups_config
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    assert process_groups_config.ProcessGroupCollection is process_groups.ProcessGroupCollection
    assert get_tensor_model_parallel_group_if_none(None) is None  # torch.distributed not initialized
