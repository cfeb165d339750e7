"""Vocab-parallel cross entropy against torch.nn.functional.cross_entropy on the full logits.

Megatron's label smoothing ``ls`` gives the target ``1 - ls`` and each other class
``ls / (V - 1)``; the references are (a) that target distribution written out
explicitly and (b) torch's ``label_smoothing=ls * V / (V - 1)``. Loss and logit
gradients compared in fp32 with rtol 1e-5 / atol 1e-6.

Half-precision logits are processed in row blocks: a dispatch mode records every fp32 tensor the
forward and backward make, and none may be larger than one block (a one-block loss fails this).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp
from tests.dist_harness import run_distributed

RTOL, ATOL = 1e-5, 1e-6
S, B, V = 6, 3, 32


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _piece(x, r, n):
    size = x.size(-1) // n
    return x.narrow(-1, r * size, size)


def _torch_loss(logits, target, ls):
    vocab = logits.size(-1)
    flat = F.cross_entropy(
        logits.reshape(-1, vocab), target.reshape(-1), reduction="none", label_smoothing=ls * vocab / (vocab - 1)
    )
    return flat.view(target.shape)


def _explicit_loss(logits, target, ls):
    vocab = logits.size(-1)
    q = torch.full_like(logits, ls / (vocab - 1)).scatter(-1, target.unsqueeze(-1), 1.0 - ls)
    return -(q * logits.log_softmax(-1)).sum(-1)


def _check(r, n, ls, offset, dtype, label):
    gen = torch.Generator().manual_seed(int(ls * 100) + offset)
    full = (torch.randn(S, B, V, generator=gen) * 3 + offset).to(dtype)
    target = torch.randint(0, V, (S, B), generator=gen)
    upstream = torch.rand(S, B, generator=gen)
    ref_logits = full.float().clone().requires_grad_(True)
    ref_loss = _torch_loss(ref_logits, target, ls)
    ref_loss.backward(upstream)
    _close(_explicit_loss(full.float().double(), target, ls).float(), ref_loss.detach(), label + " explicit ref")

    mine = _piece(full, r, n).clone().requires_grad_(True)
    loss = tp.vocab_parallel_cross_entropy(mine, target, label_smoothing=ls)
    loss.backward(upstream)
    assert loss.dtype == torch.float32 and mine.grad.dtype == dtype, label
    _close(loss, ref_loss.detach(), label + " loss")
    expected_grad = _piece(ref_logits.grad, r, n)
    if dtype == torch.float32:
        _close(mine.grad, expected_grad, label + " grad")
    else:  # the fp32 gradient is rounded once to the logits' dtype: allow one bf16 ulp (2**-8 relative)
        torch.testing.assert_close(mine.grad.float(), expected_grad, rtol=2**-8, atol=1e-6)


def _body(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    r = ps.get_tensor_model_parallel_rank()
    for ls in (0.0, 0.1):
        _check(r, world_size, ls, 0, torch.float32, f"ls={ls}")
        _check(r, world_size, ls, 1000, torch.float32, f"ls={ls} logits around 1000 (stability)")
        _check(r, world_size, ls, 0, torch.bfloat16, f"ls={ls} bf16 logits, fp32 math")
    # Half-precision logits are processed in row blocks: force blocks of two rows (several per call).
    from megatron.core.tensor_parallel import cross_entropy

    cross_entropy._BLOCK_BYTES = 2 * 4 * (V // world_size)
    for ls in (0.0, 0.1):
        _check(r, world_size, ls, 0, torch.bfloat16, f"ls={ls} bf16 logits, 2-row blocks")
        _check(r, world_size, ls, 1000, torch.float16, f"ls={ls} fp16 logits around 1000, 2-row blocks")
    # [b, s] leading shape works the same way.
    gen = torch.Generator().manual_seed(3)
    logits, target = torch.randn(B, S, V, generator=gen), torch.randint(0, V, (B, S), generator=gen)
    loss = tp.vocab_parallel_cross_entropy(_piece(logits, r, world_size), target)
    _close(loss, _torch_loss(logits, target, 0.0), "[b, s] layout")


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_cross_entropy_matches_torch(world_size):
    run_distributed(_body, world_size)


def _single_body(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    _check(0, 1, 0.1, 0, torch.float32, "tp=1")
    _check(0, 1, 0.0, 1000, torch.float32, "tp=1 logits around 1000 (stability)")
    for ls in (0.0, 0.1):  # one rank: torch's fused log-softmax / softmax per block of rows
        _check(0, 1, ls, 0, torch.bfloat16, f"tp=1 ls={ls} bf16 logits")
        _check(0, 1, ls, 1000, torch.float16, f"tp=1 ls={ls} fp16 logits around 1000")
    with pytest.raises(ValueError, match="label_smoothing=0.99"):
        tp.vocab_parallel_cross_entropy(torch.randn(2, V), torch.zeros(2, dtype=torch.long), label_smoothing=0.99)
    with pytest.raises(ValueError, match="target shape"):
        tp.vocab_parallel_cross_entropy(torch.randn(2, V), torch.zeros(3, dtype=torch.long))


def test_single_rank_and_bad_input():
    run_distributed(_single_body, 1)


def test_rows_per_block_by_device():
    """CPU: cache-sized blocks (many at a large vocab); GPU: one block up to 1 GiB of fp32."""
    from megatron.core.tensor_parallel.cross_entropy import rows_per_block

    vocab = 25_152  # 50304 / tp 2
    assert rows_per_block(8192, vocab, torch.device("cpu")) == 83  # 8 MiB / (4 B * vocab)
    assert rows_per_block(8192, vocab, torch.device("cuda", 0)) == 8192  # 824 MB: one block
    assert rows_per_block(32768, vocab, "cuda") == 10_672  # 1 GiB / (4 B * vocab): 4 blocks
    assert rows_per_block(5, 10**9, "cuda") == 1 and rows_per_block(0, vocab, "cpu") == 1


def _block_size_body(rank, world_size):
    """bf16 loss and gradient are bitwise the same for 2-row blocks and a single block."""
    from megatron.core.tensor_parallel import cross_entropy

    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(S, B, V, generator=gen).bfloat16()
    target = torch.randint(0, V, (S, B), generator=gen)
    results = []
    for block_bytes in (2 * 4 * V, 2**30):
        cross_entropy._BLOCK_BYTES = block_bytes
        mine = logits.clone().requires_grad_(True)
        loss = tp.vocab_parallel_cross_entropy(mine, target, label_smoothing=0.1)
        loss.sum().backward()
        results.append((loss.detach(), mine.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_block_size_does_not_change_results():
    run_distributed(_block_size_body, 1)


class _LargestFloat32(TorchDispatchMode):
    """Records the element count of the largest fp32 tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def _largest_fp32(logits: torch.Tensor, target: torch.Tensor) -> int:
    """Largest fp32 tensor made by the loss's forward and backward on half-precision ``logits``."""
    logits = logits.clone().requires_grad_(True)
    with _LargestFloat32() as mode:
        tp.vocab_parallel_cross_entropy(logits, target).sum().backward()
    return mode.largest


def _block_body(rank, world_size):
    from megatron.core.tensor_parallel import cross_entropy

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    gen = torch.Generator().manual_seed(4)
    logits, target = torch.randn(S, B, V, generator=gen).bfloat16(), torch.randint(0, V, (S, B), generator=gen)
    assert _largest_fp32(logits, target) == S * B * V  # all rows fit the default block: one fp32 block
    cross_entropy._BLOCK_BYTES = 2 * 4 * V  # two rows of fp32 logits
    largest = _largest_fp32(logits, target)
    assert largest == 2 * V, f"an fp32 tensor of {largest} elements; a block of two rows has {2 * V}"


def test_half_precision_logits_never_make_an_fp32_copy_larger_than_a_block():
    run_distributed(_block_body, 1)


def test_one_rank_target_outside_the_vocabulary():
    """BERT/T5 mark unpredicted positions with -1: on one rank, as on several, such a row's loss is
    ``logsumexp - max`` and its logits' gradient is the plain softmax (no target)."""
    run_distributed(_outside_body, 1)


def _outside_body(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    for dtype in (torch.float32, torch.bfloat16):
        _check_outside(dtype)


def _check_outside(dtype):
    logits = torch.randn(S, B, V).to(dtype).requires_grad_()
    target = torch.randint(0, V, (S, B))
    target[0, :] = -1
    target[1, 0] = V + 3
    loss = tp.vocab_parallel_cross_entropy(logits, target)
    x = logits.detach().float()
    inside = (target >= 0) & (target < V)
    expected = torch.where(
        inside,
        F.cross_entropy(x.reshape(-1, V), target.clamp(0, V - 1).reshape(-1), reduction="none").view(S, B),
        torch.logsumexp(x, -1) - x.amax(-1),
    )
    _close(loss.float(), expected, "loss")
    weights = torch.rand(S, B)
    (loss * weights).sum().backward()
    onehot = F.one_hot(target.clamp(0, V - 1), V).float() * inside.unsqueeze(-1)
    expected_grad = (torch.softmax(x, -1) - onehot) * weights.unsqueeze(-1)
    tol = dict(rtol=RTOL, atol=ATOL) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(logits.grad.float(), expected_grad, **tol)
