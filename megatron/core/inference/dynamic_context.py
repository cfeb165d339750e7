"""The paged KV cache of the dynamic engine (megatron-core's ``DynamicInferenceContext``).

Keys and values live in a pool of fixed-size blocks per layer, ``[num_blocks, block_size_tokens,
groups/tp, d]`` (allocated on the layer's first call, zeroed: a masked key must still be finite). A
forward step covers a flat row of tokens ``[1, T]`` from several requests: a prompt chunk of one
(prefill) beside the single newest token of another (decode). ``initialize_attention_state`` tells the
context which requests the step holds (their blocks, the position of their first token this step and
how many tokens); attention then

1. writes each token's key and value into its request's block (``slots``, ``[T]`` flat slot ids),
2. gathers every request's cached positions into a contiguous, right-aligned ``[maxk, B, groups/tp, d]``
   (request b's positions ``0 .. L_b - 1`` end at index ``maxk - 1``; the left padding is masked),
3. scatters the queries into the same right-aligned layout ``[maxq, B, heads/tp, d]``,

so the queries of a request are the last ones of its keys, as with a static cache: the core attention's
causal mask and sliding window are right, and the mask adds only the padding. The output is gathered
back to the flat ``[T, 1, heads/tp * d]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron.core.inference.block_allocator import BlockAllocator
from megatron.core.parallel_state import ProcessGroupCollection


@dataclass
class StepEntry:
    """One request's part of a step: its blocks, the position of its first token this step, its token count."""

    block_ids: Sequence[int]
    start: int
    length: int


class DynamicInferenceContext:
    """Paged KV cache and the per-step attention layout of continuous batching.

    Args:
        params_dtype: dtype of the cached keys and values (sizes the pool).
        num_layers: the model's layers (this pipeline stage holds ``num_layers / pp`` of them).
        kv_channels: head dimension.
        num_attention_heads: key/value heads (the model's query groups) over all TP ranks.
        max_sequence_length: longest prompt plus generation a request may have.
        buffer_size_gb: memory of the pool on this rank (every layer of this stage, keys and values).
        max_requests: requests in flight at once (default: as many as ``max_tokens``).
        max_tokens: tokens one forward step may hold (prefill chunks plus one token per decoding request).
        block_size_tokens: positions per block.
        tensor_model_parallel_size, pipeline_model_parallel_size: default 1, or ``pg_collection``'s.
        materialize_only_last_token_logits: logits only at the positions whose next token is chosen
            (and every position of requests that ask for log-probabilities).
        enable_prefix_caching: share the blocks of common prompt prefixes (``BlockAllocator``).
    """

    def __init__(
        self,
        params_dtype: torch.dtype,
        num_layers: int,
        kv_channels: int,
        num_attention_heads: int,
        max_sequence_length: int,
        buffer_size_gb: float,
        max_requests: Optional[int] = None,
        max_tokens: int = 16384,
        block_size_tokens: int = 256,
        tensor_model_parallel_size: Optional[int] = None,
        pipeline_model_parallel_size: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        materialize_only_last_token_logits: bool = True,
        *,
        enable_prefix_caching: bool = True,
    ) -> None:
        tp = tensor_model_parallel_size or (pg_collection.size_of("tp") if pg_collection is not None else 1)
        pp = pipeline_model_parallel_size or (pg_collection.size_of("pp") if pg_collection is not None else 1)
        self.max_tokens = max_tokens
        self.max_requests = max_requests or max_tokens
        self.max_sequence_length = max_sequence_length
        self.block_size_tokens = block_size_tokens
        self.materialize_only_last_token_logits = materialize_only_last_token_logits
        self._check(num_attention_heads, tp, num_layers, pp, buffer_size_gb)
        layers_here = num_layers // pp
        itemsize = torch.empty((), dtype=params_dtype).element_size()
        block_bytes = 2 * layers_here * block_size_tokens * (num_attention_heads // tp) * kv_channels * itemsize
        num_blocks = int(buffer_size_gb * 1024**3 // block_bytes)
        if num_blocks < 1:
            raise ValueError(
                f"DynamicInferenceContext: buffer_size_gb={buffer_size_gb} holds no block of {block_bytes} bytes "
                f"(block_size_tokens={block_size_tokens}, {layers_here} layers on this stage)"
            )
        self.allocator = BlockAllocator(num_blocks, block_size_tokens, enable_prefix_caching)
        self.memory_buffer: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (keys, values)
        self.step_entries: List[StepEntry] = []
        self.logit_rows: Optional[torch.Tensor] = None

    def _check(self, heads: int, tp: int, num_layers: int, pp: int, buffer_size_gb: float) -> None:
        rules = (
            ("max_tokens", self.max_tokens, self.max_tokens >= 1, "must be >= 1"),
            (
                "max_requests",
                self.max_requests,
                1 <= self.max_requests <= self.max_tokens,
                "must be in [1, max_tokens]",
            ),
            ("block_size_tokens", self.block_size_tokens, self.block_size_tokens >= 1, "must be >= 1"),
            ("num_attention_heads", heads, heads % tp == 0, f"must be divisible by the TP size {tp}"),
            ("num_layers", num_layers, num_layers % pp == 0, f"must be divisible by the PP size {pp}"),
            ("buffer_size_gb", buffer_size_gb, buffer_size_gb > 0, "must be > 0"),
        )
        for name, value, ok, rule in rules:
            if not ok:
                raise ValueError(f"DynamicInferenceContext.{name}={value!r}: {rule}")

    @property
    def block_count(self) -> int:
        return self.allocator.num_blocks

    def blocks_for(self, num_positions: int) -> int:
        """Blocks that hold ``num_positions`` positions."""
        return -(-num_positions // self.block_size_tokens)

    def is_static_batching(self) -> bool:
        return False

    def is_decode_only(self) -> bool:
        """Whether every request of the current step adds one token."""
        return all(e.length == 1 for e in self.step_entries)

    def initialize_attention_state(self, entries: Sequence[StepEntry], logit_rows: Sequence[int], device) -> None:
        """The layout of the next forward step: ``entries`` in the order of their tokens in the flat row;
        ``logit_rows``: the rows of that row whose logits the step returns."""
        self.step_entries = list(entries)
        self.logit_rows = torch.tensor(list(logit_rows), dtype=torch.long, device=device)  # [R]
        self._build_layout(device)

    def _build_layout(self, device) -> None:
        """Index tensors of the step, shared by every layer (see the module docstring)."""
        entries, B = self.step_entries, len(self.step_entries)
        widest = max(len(e.block_ids) for e in entries)
        table = torch.tensor([list(e.block_ids) + [0] * (widest - len(e.block_ids)) for e in entries], device=device)
        starts = torch.tensor([e.start for e in entries], device=device)  # [B]
        lengths = torch.tensor([e.length for e in entries], device=device)  # [B]
        seen = starts + lengths  # [B] L_b: positions cached after this step
        maxq, maxk = int(lengths.max()), int(seen.max())
        owner = torch.repeat_interleave(torch.arange(B, device=device), lengths)  # [T] request of each token
        first = torch.cumsum(lengths, 0) - lengths  # [B] row of each request's first token
        within = torch.arange(owner.numel(), device=device) - first[owner]  # [T] index among its request's tokens
        self.positions = starts[owner] + within  # [T]
        self.slots = self._slots(table, owner, self.positions)  # [T]
        self.query_rows = (maxq - lengths[owner] + within) * B + owner  # [T] rows of [maxq * B]
        key_positions = torch.arange(maxk, device=device)[None, :] - (maxk - seen)[:, None]  # [B, maxk]
        padding = key_positions < 0  # [B, maxk]: the left padding of the right-aligned keys
        rows = torch.arange(B, device=device)[:, None].expand(B, maxk)
        kv_index = self._slots(table, rows, key_positions.clamp(min=0)).masked_fill(padding, 0)  # [B, maxk]
        self.kv_index = kv_index.t().contiguous()  # [maxk, B]
        key_index, query_row = torch.arange(maxk, device=device), torch.arange(maxq, device=device)
        future = key_index[None, :] > query_row[:, None] + (maxk - maxq)  # [maxq, maxk] (right-aligned causal)
        self.attention_mask = (padding[:, None, None, :] | future[None, None]).contiguous()  # [B, 1, maxq, maxk]
        self.shape = (maxq, B, maxk)

    def _slots(self, table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat pool slot of each position (``rows``: which request's ``table`` row), any shape."""
        bs = self.block_size_tokens
        return table[rows, positions // bs] * bs + positions % bs

    def query_positions(self, length: int, device: torch.device) -> torch.Tensor:
        """Position ``[T]`` of every token of the step, within its own request."""
        if length != self.positions.numel():
            raise ValueError(
                f"DynamicInferenceContext: a step of {length} tokens; the layout has {self.positions.numel()}"
            )
        return self.positions.to(device)

    def paged_attention_inputs(
        self, layer_number: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store this step's ``key``/``value`` ``[T, 1, g, d]``; return the right-aligned query ``[maxq, B, heads, d]``,
        keys and values ``[maxk, B, g, d]`` and the padding+causal mask ``[B, 1, maxq, maxk]`` (True = blocked)."""
        maxq, B, maxk = self.shape
        key_pool, value_pool = self._pool(layer_number, key)
        flat_k = key_pool.view(-1, *key.shape[2:])  # [num_blocks * block_size, g, d]
        flat_v = value_pool.view(-1, *value.shape[2:])
        flat_k[self.slots] = key[:, 0]
        flat_v[self.slots] = value[:, 0]
        keys = flat_k[self.kv_index]  # [maxk, B, g, d]
        values = flat_v[self.kv_index]
        padded = query.new_zeros(maxq * B, *query.shape[2:])  # [maxq * B, heads, d]
        padded[self.query_rows] = query[:, 0]
        return padded.view(maxq, B, *query.shape[2:]), keys, values, self.attention_mask

    def unpad_attention_output(self, context: torch.Tensor) -> torch.Tensor:
        """``[maxq, B, heads * d]`` -> the flat step's ``[T, 1, heads * d]``."""
        return context.reshape(-1, context.shape[-1]).index_select(0, self.query_rows)[:, None]

    def _pool(self, layer_number: int, key: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if layer_number not in self.memory_buffer:
            shape = (self.block_count, self.block_size_tokens, *key.shape[2:])
            self.memory_buffer[layer_number] = (
                torch.zeros(shape, dtype=key.dtype, device=key.device),
                torch.zeros(shape, dtype=key.dtype, device=key.device),
            )
        return self.memory_buffer[layer_number]

    def select_logit_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[T, 1, h]`` -> the rows whose logits the step needs ``[R, 1, h]``."""
        return hidden.index_select(0, self.logit_rows.to(hidden.device))
