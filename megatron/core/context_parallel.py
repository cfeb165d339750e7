"""Context parallelism (CP): the sequence of every layer split over the ranks of the ``cp`` group.

Every sequence is cut into ``2 * cp`` equal chunks and CP rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r``, in that order, so that under the causal mask every rank has the same
amount of attention work (an early chunk with few keys, a late one with many).

* ``get_batch_on_this_cp_rank`` slices a micro batch (tokens, labels, loss mask, position ids
  along the sequence; an explicit attention mask along its query dimension) this way.
* ``gather_kv_over_cp`` all-gathers keys or values over CP and puts them back in sequence order;
  its backward reduce-scatters the gradients (every rank's queries used every key).
* attention (``transformer/attention.py``) builds its mask from the *global* positions of this
  rank's queries with ``transformer.masks.build_attention_mask`` (causal, optionally a sliding window).

This is the "all_gather" scheme of Megatron's ``--cp-comm-type``; ``transformer/cp_attention.py``
computes the ring (``p2p``) and all-to-all (``a2a``) schemes, which never hold whole-sequence keys.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def local_sequence_length(seq_length: int, cp_size: int, tp_size: int, sequence_parallel: bool) -> int:
    """Tokens of one sequence a rank holds between layers: s / cp, then / tp under sequence parallelism.

    The one home of the rule: CP cuts 2 x cp equal chunks, and under sequence parallelism each
    chunk is split evenly over TP as well. Raises a ValueError naming the settings otherwise.
    """
    chunks = 2 * cp_size if cp_size > 1 else 1
    if seq_length % chunks:
        raise ValueError(f"seq_length={seq_length} must be divisible by 2 x context_parallel_size={cp_size} = {chunks}")
    if sequence_parallel and seq_length % (chunks * tp_size):
        raise ValueError(
            f"seq_length={seq_length} must be divisible by "
            + (f"2 x context_parallel_size={cp_size} x " if cp_size > 1 else "")
            + f"tensor_model_parallel_size={tp_size} = {chunks * tp_size} with sequence_parallel=True"
        )
    return seq_length // cp_size // (tp_size if sequence_parallel else 1)


def cp_chunk_positions(
    seq_length: int, cp_size: int, cp_rank: int, device: Optional[torch.device] = None
) -> torch.Tensor:
    """Global positions ``[s/cp]`` held by CP rank ``cp_rank``: chunk r, then chunk 2cp-1-r."""
    local_sequence_length(seq_length, cp_size, 1, False)  # raises unless 2 x cp chunks are equal
    chunk = seq_length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, torch.arange(last_start, last_start + chunk, device=device)])  # [s/cp]


def gathered_order(local_length: int, cp_size: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """Index ``[s]`` that puts the rank-ordered all-gather of every rank's ``[s/cp]`` back in sequence order.

    The all-gather holds rank 0's positions, then rank 1's, ...; entry ``p`` of the result is
    where global position ``p`` lies in it.
    """
    seq = local_length * cp_size
    gathered_positions = torch.cat([cp_chunk_positions(seq, cp_size, r, device) for r in range(cp_size)])  # [s]
    return torch.argsort(gathered_positions)


def packed_cp_indices(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Packed-row indices ``[t/cp]`` held by CP rank ``cp_rank``: chunks r and 2cp-1-r of each sequence in turn.

    ``cu_seqlens`` ``[n + 1]`` are the layout (padded) boundaries; every length must divide into ``2 * cp``.
    """
    starts, ends = cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()
    pieces = []
    for start, end in zip(starts, ends):
        if (end - start) % (2 * cp_size):
            raise ValueError(
                f"packed sequence of length {end - start} (tokens {start}..{end - 1}) must be divisible by "
                f"2 x context_parallel_size={cp_size}: pad it (cu_seqlens_q_padded)"
            )
        pieces.append(start + cp_chunk_positions(end - start, cp_size, cp_rank, cu_seqlens.device))
    return torch.cat(pieces).long()  # [t/cp]


def _cp_size_rank(cp_group: Optional[dist.ProcessGroup]) -> tuple:
    if cp_group is None:
        return 1, 0
    return dist.get_world_size(cp_group), dist.get_rank(cp_group)


def get_batch_on_this_cp_rank(
    batch: Dict[str, Optional[torch.Tensor]],
    cp_group: Optional[dist.ProcessGroup],
    packed_cu_seqlens: Optional[torch.Tensor] = None,
) -> Dict[str, Optional[torch.Tensor]]:
    """This CP rank's part of a micro batch (a new dict; the batch itself is unchanged).

    ``[b, s]`` entries (tokens, labels, loss_mask, position_ids, ...) keep their columns at
    ``cp_chunk_positions``; an ``attention_mask`` ``[b, 1, s, s]`` keeps those query rows and all
    keys (in sequence order, as ``gather_kv_over_cp`` delivers them). A packed batch (``[1, t]``
    entries with the layout boundaries ``packed_cu_seqlens``) keeps ``packed_cp_indices``: every
    sequence is split on its own. Identity without CP.
    """
    cp_size, cp_rank = _cp_size_rank(cp_group)
    if cp_size == 1:
        return dict(batch)
    out: Dict[str, Optional[torch.Tensor]] = {}
    for key, value in batch.items():
        if value is None:
            out[key] = None
            continue
        dim = 2 if key == "attention_mask" else 1
        if packed_cu_seqlens is not None:
            if key == "attention_mask":
                raise ValueError("get_batch_on_this_cp_rank: a packed batch has no attention_mask")
            index = packed_cp_indices(packed_cu_seqlens, cp_size, cp_rank).to(value.device)  # [t/cp]
        else:
            index = cp_chunk_positions(value.shape[dim], cp_size, cp_rank, value.device)  # [s/cp]
        out[key] = value.index_select(dim, index)
    return out


def gather_kv_over_cp(
    t: torch.Tensor, cp_group: dist.ProcessGroup, packed_cu_seqlens: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Keys or values ``[s/cp, b, g, d]`` of this rank -> ``[s, b, g, d]`` of the whole sequence, in order.

    With ``packed_cu_seqlens`` (a packed row, ``packed_cp_indices`` layout) the result is the packed
    row in order. Backward reduce-scatters: each key's gradient sums all ranks' queries' contributions.
    """
    cp_size = dist.get_world_size(cp_group)
    if cp_size == 1:
        return t
    gathered = gather_from_sequence_parallel_region(t, True, group=cp_group)  # [s, b, g, d], rank order
    if packed_cu_seqlens is None:
        order = gathered_order(t.shape[0], cp_size, t.device)  # [s]
    else:
        held = [packed_cp_indices(packed_cu_seqlens, cp_size, r) for r in range(cp_size)]
        order = torch.argsort(torch.cat(held)).to(t.device)  # [s]
    return gathered.index_select(0, order)  # [s, b, g, d]


def roll_left_over_cp(t: torch.Tensor, cp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The whole sequence shifted left by one token (the last position gets 0), on this rank's chunks.

    ``t`` ``[..., s/cp]`` holds chunks ``r`` and ``2cp-1-r`` (``get_batch_on_this_cp_rank``). Each local
    chunk's last position takes the first value of the global chunk after it, which another rank may
    hold: one all-gather of every rank's two chunk heads ``[..., 2]``. Not differentiable (token ids,
    labels, loss masks and positions). Without CP, a plain roll.
    """
    cp_size, cp_rank = _cp_size_rank(cp_group)
    if cp_size == 1:
        rolled = torch.roll(t, shifts=-1, dims=-1)
        rolled[..., -1] = 0
        return rolled
    c = t.shape[-1] // 2
    heads = torch.stack([t[..., 0], t[..., c]], dim=-1).contiguous()  # [..., 2]
    gathered = [torch.empty_like(heads) for _ in range(cp_size)]
    dist.all_gather(gathered, heads, group=cp_group)
    by_chunk = {}  # global chunk index -> its first value [...]
    for rank, pair in enumerate(gathered):
        by_chunk[rank], by_chunk[2 * cp_size - 1 - rank] = pair[..., 0], pair[..., 1]
    by_chunk[2 * cp_size] = torch.zeros_like(heads[..., 0])  # past the end
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    nexts = by_chunk[first + 1].unsqueeze(-1), by_chunk[second + 1].unsqueeze(-1)  # [..., 1] each
    return torch.cat([t[..., 1:c], nexts[0], t[..., c + 1 :], nexts[1]], dim=-1)  # [..., s/cp]
