"""Random Hadamard transform (RHT) over 16-element blocks, as NVIDIA's NVFP4 recipe uses it.

``Q = H diag(s)`` with ``H`` the 16x16 Sylvester Hadamard matrix scaled by ``1/4`` (orthonormal) and
``s`` a random ±1 vector, so ``Q Q^T = I``. Each 16-element block of a row is multiplied by ``Q``;
applied to both operands of a GEMM along the reduction dim, ``(A Q)(B Q)^T = A B^T`` — the product is
unchanged while outliers are spread over their block before FP4 quantization. The recipe applies it
to the weight-gradient GEMM only, with one sign vector shared by both operands (TE's docs: shared by
all modules and redrawn each iteration, so the caller owns the generator).
"""

from __future__ import annotations

from typing import Optional

import torch

HADAMARD_SIZE = 16


def hadamard_matrix(n: int = HADAMARD_SIZE, device: Optional[torch.device] = None) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix scaled by ``1/sqrt(n)`` (orthonormal), fp32, built on
    ``device`` (no host-to-device copy); ``n`` a power of 2."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"n={n} must be a power of two")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)  # [2k, 2k]
    return h / n**0.5


def random_signs(generator: Optional[torch.Generator] = None, n: int = HADAMARD_SIZE) -> torch.Tensor:
    """A random ±1 vector ``[n]`` (fp32) drawn from ``generator``."""
    return torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1


def random_hadamard_transform(x: torch.Tensor, signs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Multiply every 16-element block of ``x [rows, cols]``'s rows by ``Q = H diag(signs)`` (or ``Q^T``).

    ``cols`` must be a multiple of 16. Computed in fp32; returns ``[rows, cols]`` fp32.
    """
    n = signs.numel()
    if x.dim() != 2 or x.shape[1] % n:
        raise ValueError(f"random_hadamard_transform needs [rows, cols] with cols % {n} == 0, got {tuple(x.shape)}")
    q = hadamard_matrix(n, x.device) * signs.to(x.device, torch.float32)  # [n, n]: H diag(s)
    if inverse:
        q = q.T
    blocks = x.float().reshape(x.shape[0], -1, n)  # [rows, cols/n, n]
    return (blocks @ q).reshape(x.shape)  # [rows, cols]
