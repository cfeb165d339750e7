"""``CUDA_DEVICE_MAX_CONNECTIONS=1``: Megatron's rule, and set by ``initialize_run`` before CUDA starts."""

import argparse
import os

import pytest

from megatron.training import cuda_env
from megatron.training import initialize as init
from tests.unit_tests.training.test_initialize import BASE

VAR = cuda_env.VAR


@pytest.mark.parametrize(
    "tp, cp, gpus, arch, needed",
    [
        (2, 1, 1, 9, True),  # TP on a Hopper
        (1, 2, 8, 8, True),  # CP on an Ampere
        (1, 1, 8, 9, False),  # neither TP nor CP
        (2, 2, 0, None, False),  # CPU: no CUDA queues
        (2, 1, 1, 10, False),  # Blackwell: no longer needed
        (4, 1, 1, None, True),  # architecture unknown: treated as older
    ],
)
def test_megatrons_rule(tp, cp, gpus, arch, needed):
    assert cuda_env.needs_one_connection(tp, cp, gpus, arch) is needed


def test_set_when_needed_and_unset_keep_a_users_value(monkeypatch):
    args = argparse.Namespace(tensor_model_parallel_size=2, context_parallel_size=1)
    monkeypatch.setattr(cuda_env, "visible_gpus", lambda: (1, 9))
    environ = {}
    assert "=1 set" in cuda_env.set_device_max_connections(args, environ) and environ[VAR] == "1"
    assert cuda_env.set_device_max_connections(args, environ) is None  # already 1
    environ = {VAR: "8"}
    assert "kept" in cuda_env.set_device_max_connections(args, environ) and environ[VAR] == "8"
    monkeypatch.setattr(cuda_env, "visible_gpus", lambda: (0, None))
    environ = {}
    assert cuda_env.set_device_max_connections(args, environ) is None and VAR not in environ


def test_initialize_run_sets_it_before_the_gpu_is_chosen(monkeypatch):
    """The driver reads the variable when the CUDA context starts: before ``initialize_distributed``
    (which calls ``torch.cuda.set_device``) it must already be in the environment."""
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setattr(cuda_env, "visible_gpus", lambda: (1, 9))
    seen = {}

    class Stop(Exception):
        pass

    def initialize_distributed(args, environ=None):
        seen["value"] = os.environ.get(VAR)
        raise Stop

    monkeypatch.setattr(init, "initialize_distributed", initialize_distributed)
    launch = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    try:
        with pytest.raises(Stop):
            init.initialize_run(BASE + ["--tensor-model-parallel-size", "2"], environ=launch)
    finally:
        os.environ.pop(VAR, None)
    assert seen["value"] == "1"
