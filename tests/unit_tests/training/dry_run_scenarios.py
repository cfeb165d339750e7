"""Small programs run under the dry run's rules; prints one JSON object of results.

Run as a script (the CUDA shim must load before torch): ``test_dry_run_rules.py`` does.
Each scenario returns what it observed: the error raised (type, message, site) or the
values and host syncs recorded.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from tools.dry_run.cuda_shim import load_cuda_shim  # noqa: E402

load_cuda_shim()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from tools.dry_run.attention_probe import flash_verdict  # noqa: E402
from tools.dry_run.fake_cuda import Patcher, patch_cuda_api  # noqa: E402
from tools.dry_run.fake_mode import DryRunMode, install_tensor_methods  # noqa: E402
from tools.dry_run.nccl_rules import install_nccl_rules  # noqa: E402
from tools.dry_run.report import Recorder, traceback_site  # noqa: E402

RECORDER = Recorder()


def _syncs() -> list:
    return [e.what for e in RECORDER.events if e.kind == "sync"]


def _observe(body: Callable[[], Any]) -> Dict[str, Any]:
    """Run ``body``; return its value (or the error) and the host syncs it made."""
    RECORDER.events.clear()
    try:
        value = body()
        return {"value": value, "syncs": _syncs()}
    except Exception as error:  # noqa: BLE001 - the error is what the scenario checks
        site, code, _ = traceback_site(error.__traceback__)
        return {"error": type(error).__name__, "message": str(error), "site": site, "code": code, "syncs": _syncs()}


def collectives() -> Dict[str, Any]:
    from megatron.core.utils import comm_device

    gloo = dist.new_group([4, 5], backend="gloo")
    pair = dist.new_group([4, 5])
    return {
        "cpu_all_reduce": _observe(lambda: dist.all_reduce(torch.ones(2), group=pair)),
        "cuda_all_reduce": _observe(lambda: dist.all_reduce(torch.ones(2, device="cuda"), group=pair) or "ok"),
        "cuda_in_gloo_group": _observe(lambda: dist.all_reduce(torch.ones(2, device="cuda"), group=gloo)),
        "cpu_p2p": _observe(
            lambda: dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, torch.ones(2, device="cuda"), 4, group=pair),
                    dist.P2POp(dist.irecv, torch.empty(2), 4, group=pair),
                ]
            )
        ),
        "comm_device": _observe(lambda: [str(comm_device(pair)), str(comm_device(gloo))]),
        "backend": _observe(lambda: dist.get_backend(pair)),
        "all_gather_object": _observe(
            lambda: (lambda out: dist.all_gather_object(out, {"a": 1}, group=pair) or out)([None, None])
        ),
    }


def device_rules() -> Dict[str, Any]:
    x = torch.ones(3, device="cuda")
    param = torch.nn.Parameter(torch.ones(4, device="cuda"))
    param.grad = torch.ones(4, device="cuda")

    def fused_step_on_cpu() -> None:
        opt = torch.optim.AdamW([param], lr=0.1, fused=True)
        opt.step()
        opt.state[param]["step"] = torch.tensor(1.0)
        opt.step()

    def foreach_exp_avg_on_cpu() -> None:
        opt = torch.optim.AdamW([param], lr=0.1, foreach=True)
        opt.step()
        opt.state[param]["exp_avg"] = torch.zeros(4)
        opt.step()

    return {
        "mismatch": _observe(lambda: x.mul_(torch.ones(1))),
        "cpu_scalar_ok": _observe(lambda: str(x.mul_(torch.tensor(2.0)).device)),
        "fused_cpu_step": _observe(fused_step_on_cpu),
        "foreach_cpu_exp_avg": _observe(foreach_exp_avg_on_cpu),
        "amp_unscale_cpu_scale": _observe(
            lambda: torch._amp_foreach_non_finite_check_and_unscale_([x], torch.zeros(1, device="cuda"), torch.ones(1))
        ),
        "foreach_cpu_scalar_ok": _observe(lambda: (torch._foreach_mul_([x], torch.tensor(2.0)), "ok")[1]),
        "cuda_rng_state_on_gpu": _observe(
            lambda: torch.cuda.set_rng_state(torch.zeros(16, dtype=torch.uint8, device="cuda"))
        ),
        "rand_cpu_generator": _observe(lambda: torch.rand(4, device="cuda", generator=torch.Generator())),
        "uniform_cpu_generator": _observe(lambda: x.uniform_(generator=torch.Generator().manual_seed(3))),
        "rand_cuda_generator": _observe(lambda: _cuda_generator_draw()),
    }


def _cuda_generator_draw() -> list:
    """A generator made on the paper GPU: seeded, kept on cuda:0, accepted by a draw there."""
    generator = torch.Generator(device="cuda").manual_seed(1234)
    out = torch.rand(4, device="cuda", generator=generator)
    return [str(generator.device), generator.initial_seed(), str(out.device)]


def host_syncs() -> Dict[str, Any]:
    x = torch.ones(8, device="cuda")
    return {
        "item": _observe(lambda: x.sum().item()),
        "zeros_item": _observe(lambda: torch.zeros(1, device="cuda").item()),
        "isfinite": _observe(lambda: bool(torch.isfinite(x).all())),
        "isnan": _observe(lambda: bool(torch.isnan(x).any())),
        "cpu_item": _observe(lambda: torch.ones(2).sum().item()),
        "tolist": _observe(lambda: x[:3].tolist()),
        "cpu_copy": _observe(lambda: str(x.cpu().device)),
        "blocking_h2d": _observe(lambda: str(torch.ones(2).to("cuda").device)),
        "non_blocking_h2d": _observe(lambda: str(torch.ones(2).cuda(non_blocking=True).device)),
        "nonzero": _observe(lambda: list((x > 0).nonzero().shape)),
        "synchronize": _observe(lambda: torch.cuda.synchronize()),
        "numpy_of_cuda": _observe(lambda: x.numpy()),
    }


def loop_syncs() -> Dict[str, Any]:
    """The training loop's own reads: one copy for all reported losses, one for the timers' gather."""
    from types import SimpleNamespace

    from megatron.core.timers import Timers
    from megatron.training.training import reduce_losses

    groups = SimpleNamespace(dp_cp=dist.new_group([5, 6]))
    pair = torch.stack([torch.ones((), device="cuda"), torch.ones((), device="cuda")])
    losses = [{"lm loss": pair, "load_balancing_loss": pair, "z_loss": pair} for _ in range(4)]
    timers = Timers(log_level=2, log_option="minmax")
    timers("forward-backward", log_level=0).start()
    timers("forward-backward").stop()
    return {
        "reduce_losses": _observe(lambda: sorted(reduce_losses(losses, groups))),
        "timers": _observe(lambda: list(timers._all_ranks_elapsed(["forward-backward"], True, False).shape)),
    }


def module_cuda() -> Dict[str, Any]:
    """``Module.cuda()`` on fake parameters keeps what the model set on them (as ``.data =`` does on a GPU)."""
    from tools.dry_run.runner import install_module_moves

    def move() -> list:
        layer = torch.nn.Linear(4, 4, device="cpu")
        layer.weight.tensor_model_parallel = True
        weight = layer.weight
        layer.cuda()
        return [layer.weight is weight, str(layer.weight.device), getattr(layer.weight, "tensor_model_parallel", None)]

    patcher = Patcher()
    install_module_moves(patcher)
    try:
        return {"cuda_keeps_attributes": _observe(move)}
    finally:
        patcher.restore()


def attention() -> Dict[str, Any]:
    def verdict(dtype: torch.dtype, mask: bool = False, head_dim: int = 64) -> list:
        q = torch.empty(2, 4, 16, head_dim, dtype=dtype, device="cuda")
        m = torch.ones(16, 16, dtype=torch.bool, device="cuda") if mask else None
        return list(flash_verdict(q, q, q, m))

    return {
        "bf16": _observe(lambda: verdict(torch.bfloat16)),
        "fp32": _observe(lambda: verdict(torch.float32)),
        "mask": _observe(lambda: verdict(torch.float16, mask=True)),
        "head_dim": _observe(lambda: verdict(torch.bfloat16, head_dim=264)),
    }


def quantizers() -> Dict[str, Any]:
    """Every FP8/FP4 recipe quantizes each GEMM operand of a ``[32, 64]`` CUDA tensor (nvfp4: its
    stochastic rounding, Hadamard transform and e2m1 table included), twice; the syncs are those of the quantizing."""
    from megatron.core.quantization.nvfp4 import NVFP4_LINEAR_RECIPE
    from megatron.core.quantization.recipes import FP4_RECIPES, FP8_RECIPES, LinearQuantizer, QuantRecipe

    def quantize_all(quantizer: LinearQuantizer, x: torch.Tensor) -> list:
        outs = [quantizer.quantize(role, x, gemm) for gemm, role in NVFP4_LINEAR_RECIPE]
        return sorted({str(t.data.device) for t in outs} | {str(t.scale_inv.device) for t in outs})

    results = {}
    for recipe in FP8_RECIPES + FP4_RECIPES:
        quantizer = LinearQuantizer(QuantRecipe(recipe, "e2m1" if recipe in FP4_RECIPES else "hybrid"), None).cuda()
        x = torch.randn(32, 64, device="cuda")
        results[recipe] = _observe(lambda q=quantizer, x=x: quantize_all(q, x) + quantize_all(q, x))
    return results


def main() -> None:
    os.environ.update(RANK="5", WORLD_SIZE="8")
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    patcher = Patcher()
    patch_cuda_api(patcher, RECORDER)
    install_nccl_rules(patcher, RECORDER)
    install_tensor_methods(patcher, RECORDER)
    results = {}
    with torch.autograd.set_multithreading_enabled(False), DryRunMode(RECORDER):
        for scenario in (collectives, device_rules, host_syncs, loop_syncs, module_cuda, attention, quantizers):
            results[scenario.__name__] = scenario()
    patcher.restore()
    dist.destroy_process_group()
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
