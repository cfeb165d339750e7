"""Point-to-point transfers between neighbouring pipeline stages.

A ``P2PCommunicator`` holds the pipeline group (passed in), its global ranks and the
activation shape and dtype. ``exchange`` posts any mix of sends and receives as one
``batch_isend_irecv`` and waits for all of them (``post`` returns without waiting, for
``overlap_p2p_comm``); a rank and its neighbour post matching
batches (see ``schedule_table.comm_plan``), which keeps gloo and NCCL free of deadlock.
Megatron's helpers (``send_forward``, ``recv_backward``, ``send_forward_recv_backward``
...) are thin wrappers over ``exchange``.

With ``variable_seq_lengths`` the shapes are not known in advance: every exchange is
preceded by a batch of the same pattern carrying each tensor's shape (``SHAPE_RANK``
int64 values), so receivers allocate buffers of the right size.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.context_parallel import local_sequence_length
from megatron.core.parallel_state import ProcessGroupCollection

Shape = Tuple[int, ...]
SHAPE_RANK = 3  # activations between stages are [s, b, h] (with hyper-connections [s, b, n * h])


def stage_hidden_size(config: Any) -> int:
    """Width of the activation passed between stages: ``hidden_size``, times ``n = hyper_connection_streams``
    with DeepSeek-V4's hyper-connections, whose ``n`` residual streams travel packed as ``[s, b, n * h]``
    (stream-major: ``[..., i * h : (i + 1) * h]`` is stream ``i``), the layout the layers use, as Megatron's
    mHC keeps the expanded streams across stage boundaries."""
    return config.hidden_size * getattr(config, "hyper_connection_streams", 1)


def activation_shape(seq_length: int, micro_batch_size: int, config: Any, groups: ProcessGroupCollection) -> Shape:
    """Shape of the tensor passed between stages: ``[s / cp (/ tp with SP), b, h (* n streams)]``."""
    sp = getattr(config, "sequence_parallel", False)
    seq = local_sequence_length(seq_length, groups.size_of("cp"), groups.size_of("tp"), sp)
    return (seq, micro_batch_size, stage_hidden_size(config))


def wait_all(works: Sequence[dist.Work]) -> None:
    """Wait for every posted transfer."""
    for work in works:
        work.wait()


class P2PCommunicator:
    """Sends and receives activations / gradients to the previous and next pipeline rank.

    ``prev``/``next`` wrap around the ring (the last rank's next is rank 0), which the
    interleaved schedule uses to pass activations from one model chunk to the next.
    """

    def __init__(
        self,
        pp_group: dist.ProcessGroup,
        pp_ranks: Sequence[int],
        tensor_shape: Shape,
        dtype: torch.dtype,
        device: Optional[torch.device] = None,
        variable_shapes: bool = False,
    ) -> None:
        self.group, self.ranks = pp_group, list(pp_ranks)
        self.variable_shapes = variable_shapes
        self.rank_in_group = self.ranks.index(dist.get_rank())
        self.tensor_shape, self.dtype = tuple(tensor_shape), dtype
        self.device = device or (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(pp_group) == "nccl"
            else torch.device("cpu")
        )

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

    def exchange(
        self, sends: Sequence[Tuple[torch.Tensor, int]], recvs: Sequence[Tuple[int, Optional[Shape]]]
    ) -> List[torch.Tensor]:
        """Post ``sends`` (tensor, global rank) and ``recvs`` (global rank, shape) as one batch; wait.

        Returns:
            The received tensors, in the order of ``recvs``.
        """
        buffers, works = self.post(sends, recvs)
        wait_all(works)
        return buffers

    def post(
        self, sends: Sequence[Tuple[torch.Tensor, int]], recvs: Sequence[Tuple[int, Optional[Shape]]]
    ) -> Tuple[List[torch.Tensor], List[dist.Work]]:
        """``exchange`` without the wait: the receive buffers (filled once ``works`` are waited for) and
        the works. A sent tensor must stay unchanged until then. Shapes of variable-length transfers
        are exchanged first, blocking (the buffers need them)."""
        for tensor, _ in sends:
            if tensor.dtype != self.dtype:
                raise TypeError(f"pipeline send of dtype {tensor.dtype}, expected pipeline_dtype={self.dtype}")
        if self.variable_shapes:
            recvs = self._exchange_shapes(sends, recvs)
        buffers = [self.empty(shape) for _, shape in recvs]
        send_tensors = [t.detach().contiguous() for t, _ in sends]
        return buffers, self._post(send_tensors, [p for _, p in sends], buffers, [p for p, _ in recvs])

    def _exchange_shapes(
        self, sends: Sequence[Tuple[torch.Tensor, int]], recvs: Sequence[Tuple[int, Optional[Shape]]]
    ) -> List[Tuple[int, Shape]]:
        """Tell each receiver the shape of what follows; returns ``recvs`` with the shapes received."""
        outgoing = []
        for tensor, _ in sends:
            if tensor.dim() != SHAPE_RANK:
                raise ValueError(
                    f"variable_seq_lengths: stage outputs must have {SHAPE_RANK} dims, got shape {tuple(tensor.shape)}"
                )
            outgoing.append(torch.tensor(tensor.shape, dtype=torch.int64, device=self.device))
        incoming = [torch.empty(SHAPE_RANK, dtype=torch.int64, device=self.device) for _ in recvs]
        wait_all(self._post(outgoing, [p for _, p in sends], incoming, [p for p, _ in recvs]))
        return [(peer, tuple(int(v) for v in shape.tolist())) for (peer, _), shape in zip(recvs, incoming)]

    def _post(
        self,
        send_tensors: Sequence[torch.Tensor],
        send_peers: Sequence[int],
        recv_buffers: Sequence[torch.Tensor],
        recv_peers: Sequence[int],
    ) -> List[dist.Work]:
        """One ``batch_isend_irecv`` of all sends then all receives; returns their works."""
        ops = [dist.P2POp(dist.isend, t, peer, group=self.group) for t, peer in zip(send_tensors, send_peers)]
        ops += [dist.P2POp(dist.irecv, b, peer, group=self.group) for b, peer in zip(recv_buffers, recv_peers)]
        return list(dist.batch_isend_irecv(ops)) if ops else []

    # Megatron's named helpers. ``None`` tensors (first / last stage) send nothing.
    def _exchange_optional(
        self, send: Optional[torch.Tensor], send_to: int, recv_from: Optional[int]
    ) -> Optional[torch.Tensor]:
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
