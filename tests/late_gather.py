"""Parameter all-gathers that land late: a test-only stand-in for a slow network.

``late_parameter_gathers()`` replaces the distributed optimizer's all-gather
(``param_and_grad_buffer.all_gather_into_tensor``) so that an asynchronous gather's result is
copied into the bucket only when the gather is waited for. A read of a gathered parameter before
that wait sees the previous step's values on every other rank's shard, deterministically, however
fast the machine is.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from megatron.core.distributed import param_and_grad_buffer


class LateWork:
    """An all-gather whose result lands in ``output`` only when it is waited for."""

    def __init__(self, output: torch.Tensor, gathered: torch.Tensor) -> None:
        self.output, self.gathered = output, gathered

    def wait(self) -> bool:
        self.output.copy_(self.gathered)
        return True


@contextlib.contextmanager
def late_parameter_gathers() -> Iterator[None]:
    """Within the block, asynchronous parameter all-gathers land at their ``wait()``."""
    real = param_and_grad_buffer.all_gather_into_tensor

    def gather(output, inp, group=None, async_op=False):
        if not async_op:
            return real(output, inp, group=group)
        gathered = torch.empty_like(output)
        real(gathered, inp, group=group)  # [numel] every rank's shard, held back until wait()
        return LateWork(output, gathered)

    param_and_grad_buffer.all_gather_into_tensor = gather
    try:
        yield
    finally:
        param_and_grad_buffer.all_gather_into_tensor = real
