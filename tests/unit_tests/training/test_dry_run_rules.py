"""The dry run's rules on small programs (``dry_run_scenarios.py``, one subprocess for all).

A CPU tensor in an NCCL collective or p2p call, a CUDA tensor in a gloo group, an op
mixing devices, a fused / foreach optimizer step with state on the host, a random draw on
the GPU from a CPU generator: each raises at its source line. Host syncs are counted (one
per ``.item()``, ``.tolist()``, ``.cpu()``, blocking host-to-device copy, ``nonzero``,
``torch.cuda.synchronize``; none for ``non_blocking`` uploads or CPU scalars) and stand-in values keep the run healthy.
"""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dry_run_scenarios.py")
SITE = "tests/unit_tests/training/dry_run_scenarios.py"


@pytest.fixture(scope="module")
def results():
    out = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_nccl_rules(results):
    got = results["collectives"]
    assert got["cpu_all_reduce"]["error"] == "DeviceRuleError"
    assert (
        "all_reduce over the group of ranks [4, 5] (nccl) got a cpu float32[2] tensor: NCCL only moves CUDA"
        in got["cpu_all_reduce"]["message"]
    )
    assert got["cpu_all_reduce"]["site"].startswith(SITE)
    assert got["cuda_all_reduce"]["value"] == "ok"
    assert "gloo group only moves CPU tensors" in got["cuda_in_gloo_group"]["message"]
    assert "batch_isend_irecv (irecv)" in got["cpu_p2p"]["message"]
    # comm_device() sees NCCL through get_backend(): the GPU for NCCL groups, the host for gloo ones.
    assert got["comm_device"]["value"] == ["cuda:0", "cpu"] and got["backend"]["value"] == "nccl"
    assert got["all_gather_object"]["value"] == [{"a": 1}, {"a": 1}]
    assert got["all_gather_object"]["syncs"] == ["all_gather_object (host round trip with NCCL)"]


def test_device_rules(results):
    got = results["device_rules"]
    assert got["mismatch"]["error"] == "FakeTensorDeviceMismatchError" and got["mismatch"]["site"].startswith(SITE)
    assert got["cpu_scalar_ok"]["value"] == "cuda:0"  # a 0-dim CPU tensor is a scalar argument on a GPU too
    assert got["fused_cpu_step"]["error"] == "DeviceRuleError"
    assert "_fused_adamw_: tensor 0 of list 4 is cpu float32[]" in got["fused_cpu_step"]["message"]
    assert "_foreach_lerp_" in got["foreach_cpu_exp_avg"]["message"]
    assert (
        "_amp_foreach_non_finite_check_and_unscale_: a cpu float32[1] argument"
        in got["amp_unscale_cpu_scale"]["message"]
    )
    assert got["foreach_cpu_scalar_ok"]["value"] == "ok"
    assert "must be a torch.uint8 tensor on the CPU" in got["cuda_rng_state_on_gpu"]["message"]
    # A random op draws from a generator of its own device (scripts/gpu_checks.py tries it on a GPU).
    for name, op in (("rand_cpu_generator", "rand"), ("uniform_cpu_generator", "uniform")):
        assert got[name]["error"] == "DeviceRuleError" and got[name]["site"].startswith(SITE), got[name]
        assert f"torch.{op}: a generator on cpu draws for a tensor on cuda:0" in got[name]["message"]
    assert got["rand_cuda_generator"]["value"] == ["cuda:0", 1234, "cuda:0"]


def test_host_syncs_and_stand_in_values(results):
    got = results["host_syncs"]
    item = [".item()/bool()/float()/int()"]
    expected = {
        "item": (1.0, item),
        "zeros_item": (0.0, item),
        "isfinite": (True, item),
        "isnan": (False, item),
        "cpu_item": (1.0, []),
        "tolist": ([1.0, 1.0, 1.0], [".tolist()"]),
        "cpu_copy": ("cpu", ["device-to-host copy (.cpu())"]),
        "blocking_h2d": ("cuda:0", ["blocking host-to-device copy"]),
        "non_blocking_h2d": ("cuda:0", []),
        "nonzero": ([4, 1], ["nonzero (data-dependent shape)"]),
        "synchronize": (None, ["torch.cuda.synchronize()"]),
    }
    for name, (value, syncs) in expected.items():
        assert (got[name].get("value"), got[name]["syncs"]) == (value, syncs), name
    assert got["numpy_of_cuda"]["error"] == "TypeError"


def test_training_loop_reads_losses_and_timers_with_one_copy_each(results):
    got = results["loop_syncs"]
    # Three reported losses, one copy (not one .item() per loss).
    assert got["reduce_losses"] == {"value": ["lm loss", "load_balancing_loss", "z_loss"], "syncs": [".tolist()"]}
    assert got["timers"] == {"value": [8, 1], "syncs": ["device-to-host copy (.cpu())"]}  # upload is non_blocking


def test_module_cuda_keeps_parameter_attributes(results):
    # Same object, now on the GPU, still marked as a tensor-parallel shard (as with .data = on a GPU).
    assert results["module_cuda"]["cuda_keeps_attributes"]["value"] == [True, "cuda:0", True]


def test_quantizers_run_on_the_gpu_without_host_syncs_or_uploads(results):
    # Before: nvfp4 could not make its stochastic-rounding generator on the GPU, and uploaded its
    # constants (e2m1 table, 448*6, Hadamard matrix and signs) per call; delayed scaling uploaded a 0.0.
    got = results["quantizers"]
    assert sorted(got) == ["blockwise", "delayed", "mxfp8", "nvfp4", "tensorwise"]
    for recipe, seen in got.items():
        assert seen == {"value": ["cuda:0", "cuda:0"], "syncs": []}, (recipe, seen)


def test_flash_verdict(results):
    got = results["attention"]
    assert got["bf16"]["value"] == [True, ""]
    assert got["fp32"]["value"] == [False, "dtype float32"]
    assert got["mask"]["value"] == [False, "explicit attn_mask [16, 16]"]
    assert got["head_dim"]["value"][0] is False and "head dim 264" in got["head_dim"]["value"][1]
