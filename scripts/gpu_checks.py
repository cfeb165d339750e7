"""Checks that need a real GPU, run by ``scripts/gpu_smoke.sh``.

``rules``: under ``torchrun --nproc-per-node 1`` (real NCCL), each rule the fake-CUDA dry run
enforces is tried on the GPU: what the dry run rejects must fail there, what it accepts
must work. ``flash``: our ``DotProductAttention`` (bf16, causal, dropout; also grouped-query)
forward and backward under ``sdpa_kernel(FLASH_ATTENTION)``, compared with the math kernel.
Prints one line per check (``PASS``/``FAIL name: detail``); exits 1 if any failed.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, List, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

Check = Tuple[str, bool, Callable[[], None]]  # name, must it raise, body


def _run(checks: List[Check]) -> int:
    failed = 0
    for name, must_raise, body in checks:
        try:
            body()
            torch.cuda.synchronize()
            raised, detail = False, "ran"
        except Exception as error:  # noqa: BLE001 - the error is the result
            raised, detail = True, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        ok = raised == must_raise
        failed += not ok
        print(
            f"{'PASS' if ok else 'FAIL'} {name} (expected {'an error' if must_raise else 'no error'}; {detail})",
            flush=True,
        )
    return failed


def _adam_step(fused: bool, cpu_state: str) -> Callable[[], None]:
    def body() -> None:
        param = torch.nn.Parameter(torch.ones(1024, device="cuda"))
        param.grad = torch.ones_like(param)
        opt = torch.optim.AdamW([param], lr=0.1, fused=fused, foreach=None if fused else True)
        opt.step()
        state = opt.state[param]
        state[cpu_state] = state[cpu_state].cpu()
        opt.step()

    return body


def rule_checks() -> List[Check]:
    """The dry run's device rules, tried for real (torchrun --nproc-per-node 1, NCCL)."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    return [
        ("NCCL all_reduce of a CPU tensor fails", True, lambda: dist.all_reduce(torch.ones(4))),
        ("NCCL all_reduce of a CUDA tensor works", False, lambda: dist.all_reduce(torch.ones(4, device=cuda))),
        ("NCCL broadcast of a CPU 0-dim tensor fails", True, lambda: dist.broadcast(torch.tensor(3.0), src=0)),
        (
            "NCCL all_gather_into_tensor of CPU tensors fails",
            True,
            lambda: dist.all_gather_into_tensor(torch.empty(4), torch.ones(4)),
        ),
        ("cuda tensor *= CPU [1] tensor fails", True, lambda: torch.ones(3, device=cuda).mul_(torch.ones(1))),
        ("cuda tensor *= CPU 0-dim tensor works", False, lambda: torch.ones(3, device=cuda).mul_(torch.tensor(2.0))),
        ("foreach AdamW with exp_avg on the CPU fails", True, _adam_step(fused=False, cpu_state="exp_avg")),
        ("foreach AdamW with step on the CPU works", False, _adam_step(fused=False, cpu_state="step")),
        ("fused AdamW with exp_avg on the CPU fails", True, _adam_step(fused=True, cpu_state="exp_avg")),
        ("fused AdamW with step on the CPU fails", True, _adam_step(fused=True, cpu_state="step")),
        (
            "AMP unscale with the inverse scale on the CPU fails",
            True,
            lambda: torch._amp_foreach_non_finite_check_and_unscale_(
                [torch.ones(4, device=cuda)], torch.zeros(1, device=cuda), torch.ones(1)
            ),
        ),
        (
            "torch.rand on the GPU with a CPU generator fails",
            True,
            lambda: torch.rand(4, device=cuda, generator=torch.Generator().manual_seed(1)),
        ),
        (
            "torch.rand on the GPU with a generator of the GPU works",
            False,
            lambda: torch.rand(4, device=cuda, generator=torch.Generator(device=cuda).manual_seed(1)),
        ),
        (
            "AMP unscale with everything on the GPU works",
            False,
            lambda: torch._amp_foreach_non_finite_check_and_unscale_(
                [torch.ones(4, device=cuda)], torch.zeros(1, device=cuda), torch.ones(1, device=cuda)
            ),
        ),
    ]


def rules() -> int:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    try:
        return _run(rule_checks())
    finally:
        dist.destroy_process_group()


def flash() -> int:
    """Our attention's SDPA call runs on the flash kernel (bf16, causal, head dim 64, dropout)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.attention import DotProductAttention
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=256,
        num_attention_heads=4,
        bf16=True,
        params_dtype=torch.bfloat16,
        attention_dropout=0.1,
    )
    attention = DotProductAttention(config, layer_number=1).cuda()
    q, k, v = (torch.randn(512, 2, 4, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))

    def run(backend: SDPBackend, train: bool) -> torch.Tensor:
        attention.train(train)
        with sdpa_kernel(backend):
            out = attention(q, k, v, None)
            out.float().square().sum().backward()
        return out.detach()

    def grouped_query() -> None:  # 4 query heads sharing 2 key/value heads (enable_gqa)
        k2, v2 = (torch.randn(512, 2, 2, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(2))
        attention.train(True)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            attention(q, k2, v2, None).float().sum().backward()

    def matches_math() -> None:
        diff = (run(SDPBackend.FLASH_ATTENTION, False) - run(SDPBackend.MATH, False)).abs().max().item()
        if diff > 2e-2:
            raise AssertionError(f"flash and math kernels differ by {diff}")

    checks: List[Check] = [
        (
            "torch.backends.cuda.flash_sdp_enabled()",
            False,
            lambda: (
                None
                if torch.backends.cuda.flash_sdp_enabled()
                else (_ for _ in ()).throw(AssertionError("flash SDPA is disabled"))
            ),
        ),
        (
            "DotProductAttention under sdpa_kernel(FLASH_ATTENTION), dropout 0.1, backward",
            False,
            lambda: run(SDPBackend.FLASH_ATTENTION, True),
        ),
        ("grouped-query attention (4 heads, 2 groups) under sdpa_kernel(FLASH_ATTENTION)", False, grouped_query),
        ("flash output equals the math kernel's (eval)", False, matches_math),
    ]
    return _run(checks)


if __name__ == "__main__":
    commands = {"rules": rules, "flash": flash}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(commands)}}}")
    sys.exit(1 if commands[sys.argv[1]]() else 0)
