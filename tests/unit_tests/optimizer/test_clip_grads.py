"""The chunked sum of squares behind the gradient norm agrees with an all-float64 sum (5e-6 relative:
fp32 norm kernels per 4096-element chunk, chunks added in float64)."""

import pytest
import torch

from megatron.core.optimizer.clip_grads import sum_of_squares


@pytest.mark.parametrize("numel", [1, 4095, 4096, 4097, 3 * 4096 + 11, 1_000_003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_sum_of_squares_matches_float64(numel, dtype):
    g = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 7).to(dtype)
    exact = g.double().pow(2).sum()
    got = sum_of_squares(g.view(-1, 1) if numel % 2 else g)  # any shape
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, exact, rtol=5e-6, atol=0)
