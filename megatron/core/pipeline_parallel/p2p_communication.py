"""Point-to-point transfers between neighbouring pipeline stages.

A ``P2PCommunicator`` holds the pipeline group (passed in), its global ranks and the
activation shape and dtype. ``exchange`` posts any mix of sends and receives as one
``batch_isend_irecv`` and waits for all of them; a rank and its neighbour post matching
batches (see ``schedule_table.comm_plan``), which keeps gloo and NCCL free of deadlock.
Megatron's helpers (``send_forward``, ``recv_backward``, ``send_forward_recv_backward``
...) are thin wrappers over ``exchange``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.parallel_state import ProcessGroupCollection

Shape = Tuple[int, ...]


def activation_shape(seq_length: int, micro_batch_size: int, config: Any,
                     groups: ProcessGroupCollection) -> Shape:
    """Shape of the tensor passed between stages: ``[s / cp (/ tp with SP), b, h]``."""
    seq = seq_length // groups.size_of("cp")
    if getattr(config, "sequence_parallel", False):
        tp = groups.size_of("tp")
        if seq % tp:
            raise ValueError(f"seq_length={seq_length} (per context-parallel rank: {seq}) must be divisible by "
                             f"tensor_model_parallel_size={tp} with sequence_parallel=True")
        seq //= tp
    return (seq, micro_batch_size, config.hidden_size)


class P2PCommunicator:
    """Sends and receives activations / gradients to the previous and next pipeline rank.

    ``prev``/``next`` wrap around the ring (the last rank's next is rank 0), which the
    interleaved schedule uses to pass activations from one model chunk to the next.
    """

    def __init__(self, pp_group: dist.ProcessGroup, pp_ranks: Sequence[int], tensor_shape: Shape,
                 dtype: torch.dtype, device: Optional[torch.device] = None) -> None:
        self.group, self.ranks = pp_group, list(pp_ranks)
        self.rank_in_group = self.ranks.index(dist.get_rank())
        self.tensor_shape, self.dtype = tuple(tensor_shape), dtype
        self.device = device or (torch.device("cuda", torch.cuda.current_device())
                                 if dist.get_backend(pp_group) == "nccl" else torch.device("cpu"))

    def global_rank(self, pp_index: int) -> int:
        """Global rank of pipeline index ``pp_index`` (taken modulo the pipeline size)."""
        return self.ranks[pp_index % len(self.ranks)]

    @property
    def next_rank(self) -> int:
        return self.global_rank(self.rank_in_group + 1)

    @property
    def prev_rank(self) -> int:
        return self.global_rank(self.rank_in_group - 1)

    def empty(self, shape: Optional[Shape] = None) -> torch.Tensor:
        """A receive buffer of the activation shape (or ``shape``) and pipeline dtype."""
        return torch.empty(shape or self.tensor_shape, dtype=self.dtype, device=self.device)

    def exchange(self, sends: Sequence[Tuple[torch.Tensor, int]],
                 recvs: Sequence[Tuple[int, Optional[Shape]]]) -> List[torch.Tensor]:
        """Post ``sends`` (tensor, global rank) and ``recvs`` (global rank, shape) as one batch; wait.

        Returns:
            The received tensors, in the order of ``recvs``.
        """
        ops, received = [], []
        for tensor, peer in sends:
            if tensor.dtype != self.dtype:
                raise TypeError(f"pipeline send of dtype {tensor.dtype}, expected pipeline_dtype={self.dtype}")
            ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), peer, group=self.group))
        for peer, shape in recvs:
            buffer = self.empty(shape)
            received.append(buffer)
            ops.append(dist.P2POp(dist.irecv, buffer, peer, group=self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received

    # Megatron's named helpers. ``None`` tensors (first / last stage) send nothing.
    def _exchange_optional(self, send: Optional[torch.Tensor], send_to: int,
                           recv_from: Optional[int]) -> Optional[torch.Tensor]:
        sends = [(send, send_to)] if send is not None else []
        recvs = [(recv_from, None)] if recv_from is not None else []
        got = self.exchange(sends, recvs)
        return got[0] if got else None

    def recv_forward(self) -> torch.Tensor:
        return self._exchange_optional(None, self.next_rank, self.prev_rank)

    def recv_backward(self) -> torch.Tensor:
        return self._exchange_optional(None, self.prev_rank, self.next_rank)

    def send_forward(self, output_tensor: torch.Tensor) -> None:
        self._exchange_optional(output_tensor, self.next_rank, None)

    def send_backward(self, input_tensor_grad: torch.Tensor) -> None:
        self._exchange_optional(input_tensor_grad, self.prev_rank, None)

    def send_forward_recv_backward(self, output_tensor: torch.Tensor) -> torch.Tensor:
        return self._exchange_optional(output_tensor, self.next_rank, self.next_rank)

    def send_backward_recv_forward(self, input_tensor_grad: torch.Tensor) -> torch.Tensor:
        return self._exchange_optional(input_tensor_grad, self.prev_rank, self.prev_rank)
