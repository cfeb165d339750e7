"""``unwrap_model`` (Megatron-core's signature) and the one parameter naming of checkpoints and optimizer state."""

from __future__ import annotations

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
