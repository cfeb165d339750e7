"""Token dispatchers: move each rank's routed tokens to the ranks holding their experts, and back.

A dispatcher works on the expert grid (``ETP x EP x expert-DP``). Every rank enters with the tokens
it routed ``[n, h]`` (the same ``n`` on every rank: its sequence shard under SP), their routing probs
and map ``[n, E]``; the dispatcher treats the ranks' tokens as distinct. ``dispatch`` returns what
this rank's experts run on: tokens ``[R, h]`` with probs and map ``[R, E_local]`` (the expert MLPs
take that triple); ``combine`` turns the experts' output ``[R, h]`` (prob-weighted, a partial sum
over expert-TP) into the summed output of this rank's own tokens ``[n, h]``.
Both chosen by ``config.moe_token_dispatcher_type``:

* ``AllGatherDispatcher`` (``allgather``): all-gather tokens, probs and map over ``tp_ep``; every
  rank runs its local experts on all of them; reduce-scatter the outputs back over ``tp_ep``.
* ``AllToAllDispatcher`` (``alltoall``, Megatron's ``MoEAlltoAllTokenDispatcher`` steps): permute
  tokens by expert; all-gather the per-expert counts over ``tp_ep``; all-to-all over EP with
  per-rank split sizes; with ETP > 1 all-gather over expert-TP (uneven sizes); the experts run;
  then the reverse: reduce-scatter over expert-TP, the reverse all-to-all, unpermute with a sum.

Every collective is an autograd function of ``tensor_parallel.mappings`` (the all-to-all's backward
is the reverse all-to-all; an all-gather's backward reduce-scatters), so gradients flow back to
each rank's own tokens and probs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Deque, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.random import checkpointed_forward_reruns, is_checkpointing
from megatron.core.transformer.moe.experts import expert_counts, permute_by_expert
from megatron.core.transformer.moe_choices import DISPATCHER_TYPES


@dataclass
class Dispatched:
    """What the experts run on, and what ``combine`` needs to bring their output back."""

    tokens: torch.Tensor  # [R, h]
    probs: torch.Tensor  # [R, E_local]
    routing_map: torch.Tensor  # [R, E_local] bool
    num_tokens: int  # n: this rank's own tokens
    token_ids: Optional[torch.Tensor] = None  # alltoall: [N] own token of each permuted row
    splits: dict = field(default_factory=dict)  # collective split sizes (host lists)
    tokens_per_expert: Optional[List[int]] = None  # alltoall: rows per local expert, read with the splits


def gather_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather a count vector ``[k]`` (int64) over ``group`` -> ``[group size, k]``, on the device."""
    size = dist.get_world_size(group)
    if size == 1:
        return counts.view(1, -1)
    pieces = [torch.empty_like(counts) for _ in range(size)]
    dist.all_gather(pieces, counts.contiguous(), group=group)
    return torch.stack(pieces)  # [size, k]


class TokenDispatcher:
    """Common state: the groups and which experts this rank holds (``E_local`` from ``local_start``)."""

    def __init__(self, num_experts: int, num_local_experts: int, groups: ProcessGroupCollection) -> None:
        self.num_experts, self.num_local_experts = num_experts, num_local_experts
        self.local_start = groups.rank_in("ep") * num_local_experts
        self.ep_group, self.etp_group, self.tp_ep_group = groups.ep, groups.expt_tp, groups.tp_ep
        self.ep_size, self.etp_size = groups.size_of("ep"), groups.size_of("expt_tp")
        self.etp_rank = groups.rank_in("expt_tp")

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> Dispatched:
        """``tokens`` ``[n, h]``, ``probs`` / ``routing_map`` ``[n, E]``: the tokens this rank routed."""
        raise NotImplementedError

    def combine(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        raise NotImplementedError


class AllGatherDispatcher(TokenDispatcher):
    """Every rank of ``tp_ep`` sees every token of the group; outputs are reduce-scattered back."""

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> Dispatched:
        n = tokens.shape[0]
        group = self.tp_ep_group
        tokens = gather_from_sequence_parallel_region(tokens, True, group)  # [tp_ep * n, h]
        probs = gather_from_sequence_parallel_region(probs, True, group)  # [tp_ep * n, E]
        with torch.no_grad():
            routing_map = gather_from_sequence_parallel_region(routing_map.to(torch.uint8), True, group)
        local = slice(self.local_start, self.local_start + self.num_local_experts)
        return Dispatched(tokens, probs[:, local], routing_map[:, local].bool(), n)

    def combine(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """``[tp_ep * n, h]`` partial over ``tp_ep`` -> this rank's ``[n, h]``, summed."""
        return reduce_scatter_to_sequence_parallel_region(expert_output, self.tp_ep_group)


class AllToAllDispatcher(TokenDispatcher):
    """Tokens travel only to the EP ranks holding their experts (then to the expert-TP peers).

    Host syncs: one per layer and microbatch. The per-expert counts are computed and all-gathered on
    the device; every split size the collectives and the experts need is then read in one
    ``.tolist()`` (``_splits``). Under full recompute the rerun takes the sizes its first forward
    read (``replay``, first in, first out: every schedule runs a layer's backwards in the order of
    its forwards), so recomputing neither syncs nor exchanges again."""

    def __init__(self, num_experts: int, num_local_experts: int, groups: ProcessGroupCollection) -> None:
        super().__init__(num_experts, num_local_experts, groups)
        self.tp_ep_rank = groups.rank_in("tp_ep")
        self.replay: Deque[Tuple[dict, torch.Tensor]] = deque()  # (host splits, per-block counts) to recompute

    def _exchange(self, counts: torch.Tensor) -> Tuple[dict, torch.Tensor]:
        """This rank's per-expert counts ``[E]`` -> host split sizes, and the counts of the received
        blocks ``[etp*ep*E_local]`` on the device (sender block ``(etp rank, ep rank)``, local expert).

        The counts are all-gathered on the device and read once; every split is host arithmetic on
        that one read (so the sizes always agree with each other)."""
        every = gather_counts(counts, self.tp_ep_group)  # [ep*etp, E], tp_ep rank = ep rank * etp + etp rank
        lo, e_local = self.local_start, self.num_local_experts
        mine = every.view(self.ep_size, self.etp_size, self.num_experts)[:, :, lo : lo + e_local]  # [ep, etp, E_l]
        per_block = mine.permute(1, 0, 2).reshape(-1)  # [etp*ep*E_local] in received order
        rows = every.tolist()  # the one host sync of the layer
        own = rows[self.tp_ep_rank]  # [E]
        to_me = [
            [rows[p * self.etp_size + t][lo : lo + e_local] for t in range(self.etp_size)] for p in range(self.ep_size)
        ]
        host = {
            "own": own,  # this rank's routed pairs per expert
            "ep_in": [sum(own[p * e_local : (p + 1) * e_local]) for p in range(self.ep_size)],  # sent to EP rank p
            "ep_out": [sum(to_me[p][self.etp_rank]) for p in range(self.ep_size)],  # received from EP rank p
            "etp": [sum(sum(to_me[p][t]) for p in range(self.ep_size)) for t in range(self.etp_size)],  # per peer
            "per_expert": [sum(b[i] for blocks in to_me for b in blocks) for i in range(e_local)],  # rows per expert
        }
        return host, per_block

    def _splits(self, counts: torch.Tensor) -> Tuple[dict, torch.Tensor]:
        """``_exchange``, or under a recompute what the first forward read (no sync, no collective)."""
        if is_checkpointing() and torch.is_grad_enabled() and self.replay:
            return self.replay.popleft()
        splits = self._exchange(counts)
        if checkpointed_forward_reruns():  # a checkpointed forward whose backward reruns it
            self.replay.append(splits)
        return splits

    def _local_map(self, per_block: torch.Tensor, probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """One-hot routing map and probs ``[R, E_local]`` of the received rows (blocks of local experts),
        built on the device from the blocks' counts ``[etp*ep*E_local]``."""
        blocks = per_block.shape[0] // self.num_local_experts
        expert_of_block = torch.arange(self.num_local_experts, device=probs.device).repeat(blocks)  # [blocks*E_local]
        ids = torch.repeat_interleave(expert_of_block, per_block, output_size=probs.shape[0])  # [R]
        one_hot = torch.nn.functional.one_hot(ids, self.num_local_experts).to(torch.bool)  # [R, E_local]
        return probs.unsqueeze(-1) * one_hot.to(probs.dtype), one_hot

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> Dispatched:
        n = tokens.shape[0]
        splits, per_block = self._splits(expert_counts(routing_map))  # [E] counted on the device
        token_ids, permuted_probs, _ = permute_by_expert(probs, routing_map, splits["own"])  # [N] expert-major
        permuted = tokens[token_ids]  # [N, h]
        permuted_probs = permuted_probs.to(tokens.dtype)  # [N]
        received = all_to_all(self.ep_group, permuted, splits["ep_out"], splits["ep_in"])  # [M, h]
        received_probs = all_to_all(self.ep_group, permuted_probs, splits["ep_out"], splits["ep_in"])  # [M]
        if self.etp_size > 1:
            received = gather_from_sequence_parallel_region(received, True, self.etp_group, splits["etp"])
            received_probs = gather_from_sequence_parallel_region(received_probs, True, self.etp_group, splits["etp"])
        local_probs, local_map = self._local_map(per_block, received_probs)  # [R, E_local] each
        return Dispatched(received, local_probs, local_map, n, token_ids, splits, splits["per_expert"])

    def combine(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """``[R, h]`` prob-weighted, partial over expert-TP -> this rank's tokens ``[n, h]``."""
        splits = dispatched.splits
        if self.etp_size > 1:
            expert_output = reduce_scatter_to_sequence_parallel_region(
                expert_output, self.etp_group, splits["etp"]
            )  # [M, h]
        back = all_to_all(self.ep_group, expert_output, splits["ep_in"], splits["ep_out"])  # [N, h]
        output = back.new_zeros((dispatched.num_tokens, back.shape[-1]))  # [n, h]
        return output.index_add(0, dispatched.token_ids, back)  # top-k outputs of a token summed


def build_dispatcher(kind: str, num_experts: int, num_local_experts: int, groups: ProcessGroupCollection):
    """The dispatcher ``moe_token_dispatcher_type`` names."""
    classes = dict(zip(DISPATCHER_TYPES, (AllGatherDispatcher, AllToAllDispatcher)))  # in the list's order
    if kind not in classes:
        raise ValueError(f"moe_token_dispatcher_type={kind!r}: must be one of {DISPATCHER_TYPES}")
    return classes[kind](num_experts, num_local_experts, groups)


__all__: List[str] = [
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "Dispatched",
    "TokenDispatcher",
    "build_dispatcher",
]
