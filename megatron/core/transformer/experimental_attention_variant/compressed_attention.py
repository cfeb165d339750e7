"""DeepSeek-V4's attention: shared-KV multi-query attention over a sliding window and compressed entries.

Per token, with ``n`` heads of ``d = kv_channels`` channels, of which the last ``r`` are rotated
(``r`` = the model's RoPE width, ``rotary_percent * d``, interleaved pairs):

* queries ``x -> [q_lora_rank] -> RMSNorm -> [n, d]``, each head RMS-normalised without gain;
* one key/value head ``x -> [d] -> RMSNorm``, read as both key and value (shared-KV MQA);
* queries and the key are rotated at their positions; the attention output is rotated back
  (angle ``-pos``) so each value contributes as a function of the relative distance;
* keys: the last ``W`` tokens (``window_size = (W - 1, 0)``), plus per layer type
  - ``sliding_attention``: nothing else (angles of ``rotary_base``, the model's);
  - ``heavily_compressed_attention`` (HCA): every ``hca_compress_rate`` tokens pooled into one entry
    (``KVCompressor``); a query sees the entries of windows it has fully read;
  - ``compressed_sparse_attention`` (CSA): entries of ``csa_compress_rate`` tokens over overlapping
    windows (each pools its own tokens and the previous window's), of which a lightning indexer
    (``CompressedIndexer``, its own heads ``dsa_indexer_*``, pooled keys) keeps ``dsa_indexer_topk``
    per query; both compressed types use ``compressed_attention_rotary_base``;
* softmax over the window logits, the compressed logits and a learned per-head sink logit
  (``attention_sinks``, which takes probability but carries no value), scale ``d^-1/2``;
* grouped low-rank output: heads in ``attention_output_groups`` groups, each group's ``n d / g``
  channels projected to ``attention_output_lora_rank`` (``linear_o_group_proj``), then all groups to
  ``h`` (``linear_proj``).

No ``s x s`` tensor: the window's keys are gathered per query (``[s, W]`` logits), HCA has ``s x s/m``
logits, CSA gathers its ``k`` chosen entries (the indexer's scores are ``s x s/m``, as DSA's).

Tensor parallelism: the whole attention is replicated on every TP rank, as ``transformers``' TP plan
leaves it: the single key/value head, the compressors and the indexer act per token, not per head, so
splitting heads would leave only the query up-projection and the first output projection to shard.
Under sequence parallelism the input is all-gathered (its gradient is complete on every rank, so the
backward keeps this rank's piece) and the output is scattered back; the parameters' gradients are
then complete on every rank and are not summed over TP. The indexer's top-k is the same on every rank
(identical weights and inputs). Context parallelism is refused (``deepseek_v4_checks``).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.dsa import lightning_index_scores
from megatron.core.transformer.hyper_connection import unweighted_rms_norm
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import ReplicatedLinear
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.rope_utils import apply_rotary_pos_emb, rotary_angles, rotary_inverse_frequencies
from megatron.core.transformer.transformer_config import TransformerConfig

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def rotate_tail(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``r`` channels of ``x`` ``[s, b, m, d]`` by interleaved angles ``freqs`` ``[s, 1, 1, r]``
    (in fp32; ``inverse``: by the opposite angles)."""
    r = freqs.shape[-1]
    tail = apply_rotary_pos_emb(x[..., -r:].float(), -freqs if inverse else freqs, interleaved=True)
    return torch.cat([x[..., :-r], tail.to(x.dtype)], dim=-1)


def compressed_freqs(freqs: torch.Tensor, base: float, length: int) -> torch.Tensor:
    """Angles ``[length, 1, 1, r]`` of base ``base`` for positions ``0..length-1``, as wide as ``freqs``."""
    inv_freq = rotary_inverse_frequencies(freqs.shape[-1], base, device=freqs.device)
    return rotary_angles(inv_freq, torch.arange(length, dtype=torch.float32, device=freqs.device), interleaved=True)


class KVCompressor(MegatronModule):
    """Pools every ``rate`` tokens into one entry: a softmax over the window's tokens (gate logits plus
    a learned per-slot ``position_bias``) weighting their projected values, then an RMSNorm and RoPE
    at the window's first position.

    ``overlap`` (CSA): each token projects two series; entry ``w`` pools the first series of window
    ``w - 1`` and the second of window ``w`` (``2 rate`` slots; window 0 has only its own).
    """

    def __init__(self, config: TransformerConfig, dim: int, rate: int, overlap: bool) -> None:
        super().__init__(config)
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = (2 if overlap else 1) * dim
        self.linear_kv = ReplicatedLinear(config, config.hidden_size, width)
        self.linear_gate = ReplicatedLinear(config, config.hidden_size, width)
        self.position_bias = torch.nn.Parameter(torch.zeros(rate, width, dtype=config.params_dtype))
        self.kv_layernorm = attention_norm(config, dim)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """``x`` ``[s, b, h]``, angles ``[s, 1, 1, r]`` of the compressed base -> entries ``[s // rate, b, dim]``."""
        s, b, _ = x.shape
        count, m, d = s // self.rate, self.rate, self.dim
        used = x[: count * m]
        kv = self.linear_kv(used)[0].view(count, m, b, -1)  # [T, m, b, (2)d]
        gate = self.linear_gate(used)[0].view(count, m, b, -1) + self.position_bias[None, :, None, :]
        if self.overlap:
            (prev_kv, kv), (prev_gate, gate) = kv.split(d, dim=-1), gate.split(d, dim=-1)
            prev_kv = torch.cat([torch.zeros_like(prev_kv[:1]), prev_kv[:-1]])  # window w-1's first series
            prev_gate = torch.cat([torch.full_like(prev_gate[:1], float("-inf")), prev_gate[:-1]])
            kv, gate = torch.cat([prev_kv, kv], dim=1), torch.cat([prev_gate, gate], dim=1)  # [T, 2m, b, d]
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        pooled = self.kv_layernorm((kv * weights).sum(dim=1))  # [T, b, d]
        starts = freqs[: count * m : m]  # [T, 1, 1, r]: the windows' first positions
        return rotate_tail(pooled.unsqueeze(2), starts).squeeze(2)  # [T, b, d]


def attention_norm(config: TransformerConfig, dim: int) -> torch.nn.Module:
    """The RMSNorm of a latent, key or pooled entry, unfused: the compiled kernel of ``persist_layer_norm``
    would recompile for each of the attention's widths and entry counts (over dynamo's limit)."""
    norm = build_norm(config, dim)
    norm.fused = False
    return norm


def visible_entries(s: int, rate: int, device: torch.device) -> torch.Tensor:
    """``[s]``: how many compressed entries query ``i`` may see (windows it has read to the end)."""
    return (torch.arange(s, device=device) + 1) // rate


class CompressedIndexer(MegatronModule):
    """CSA's lightning indexer: its own overlapping compressor at ``dsa_indexer_head_dim``, queries from
    the query latent, DSA's score (``lightning_index_scores``); top-``dsa_indexer_topk`` visible entries
    per query, ``-1`` where a query sees fewer. No gradient (as ``transformers``; Megatron trains the
    indexer by a separate loss, not implemented)."""

    def __init__(self, config: TransformerConfig, rate: int) -> None:
        super().__init__(config)
        self.n_heads, self.head_dim, self.topk = (
            config.dsa_indexer_n_heads,
            config.dsa_indexer_head_dim,
            config.dsa_indexer_topk,
        )
        self.rate = rate
        self.compressor = KVCompressor(config, self.head_dim, rate, overlap=True)
        self.linear_wq_b = ReplicatedLinear(config, config.q_lora_rank, self.n_heads * self.head_dim)
        self.linear_weights_proj = ReplicatedLinear(config, config.hidden_size, self.n_heads)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """``x`` ``[s, b, h]``, ``q_latent`` ``[s, b, q_lora_rank]``, angles ``[s, 1, 1, r]`` -> ``[b, s, k]``."""
        s, b, _ = x.shape
        keys = self.compressor(x, freqs)  # [T, b, di]
        q = self.linear_wq_b(q_latent)[0].view(s, b, self.n_heads, self.head_dim)
        weights, _ = self.linear_weights_proj(x)  # [s, b, hi]
        scores = lightning_index_scores(rotate_tail(q, freqs), keys, weights)  # [b, s, T]
        visible = visible_entries(s, self.rate, x.device)  # [s]
        future = torch.arange(keys.shape[0], device=x.device)[None, :] >= visible[:, None]  # [s, T]
        top = scores.masked_fill(future, float("-inf")).topk(min(self.topk, keys.shape[0]), dim=-1).indices
        return torch.where(top >= visible[None, :, None], torch.full_like(top, -1), top)  # [b, s, k]


class CompressedAttention(MegatronModule):
    """DeepSeek-V4's attention of one layer type (see the module docstring).

    Parameters: ``linear_q_down_proj``, ``q_layernorm``, ``linear_q_up_proj``, ``linear_kv_proj``,
    ``kv_layernorm``, ``attention_sinks`` ``[n]``, ``linear_o_group_proj`` ``[g r, n d / g]``,
    ``linear_proj``; CSA/HCA: ``compressor`` (``KVCompressor``); CSA: ``indexer`` (``CompressedIndexer``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int = 1,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        layer_type: Optional[str] = None,
        *,
        pg_collection: ProcessGroupCollection,
    ) -> None:
        super().__init__(config)
        if attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"CompressedAttention: attn_mask_type={attn_mask_type.name} (causal only)")
        self.layer_number = layer_number
        # The spec names the type (an MTP layer reuses the last layer's); else the config's entry of this layer.
        self.layer_type = layer_type or config.compressed_attention_layer_types[layer_number - 1]
        if self.layer_type not in (SLIDING, CSA, HCA):
            raise ValueError(f"CompressedAttention: layer_type={self.layer_type!r}: must be one of {SLIDING, CSA, HCA}")
        self.tp_group, self.tp_size = pg_collection.tp, pg_collection.size_of("tp")
        self._build(config)
        for param in self.parameters():  # the whole attention runs on the whole sequence on every TP rank
            param.sequence_parallel = False

    def _build(self, config: TransformerConfig) -> None:
        n, d, h = config.num_attention_heads, config.kv_channels, config.hidden_size
        g, rank = config.attention_output_groups, config.attention_output_lora_rank
        self.linear_q_down_proj = ReplicatedLinear(config, h, config.q_lora_rank)
        self.q_layernorm = attention_norm(config, config.q_lora_rank)
        self.linear_q_up_proj = ReplicatedLinear(config, config.q_lora_rank, n * d)
        self.linear_kv_proj = ReplicatedLinear(config, h, d)
        self.kv_layernorm = attention_norm(config, d)
        self.attention_sinks = torch.nn.Parameter(torch.zeros(n, dtype=config.params_dtype))
        self.linear_o_group_proj = ReplicatedLinear(config, n * d // g, g * rank)
        self.linear_proj = ReplicatedLinear(config, g * rank, h)
        self.compressor = self.indexer = None
        if self.layer_type == CSA:
            self.compressor = KVCompressor(config, d, config.csa_compress_rate, overlap=True)
            self.indexer = CompressedIndexer(config, config.csa_compress_rate)
        elif self.layer_type == HCA:
            self.compressor = KVCompressor(config, d, config.hca_compress_rate, overlap=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        **unsupported: Any,
    ) -> Tuple[torch.Tensor, None]:
        """``[s(/tp with SP), b, h]`` and the model's angles ``[s, 1, 1, r]`` -> (``[s(/tp), b, h]``, None)."""
        if attention_mask is not None or unsupported:
            raise NotImplementedError(
                "CompressedAttention: its mask is causal + window + compressed visibility; attention_mask and "
                f"{sorted(unsupported)} are not supported"
            )
        if rotary_pos_emb is None:
            raise ValueError("CompressedAttention needs rotary_pos_emb (GPTModel with position_embedding_type='rope')")
        sp = self.config.sequence_parallel and self.tp_size > 1
        x = gather_from_sequence_parallel_region(hidden_states, False, self.tp_group) if sp else hidden_states
        freqs = rotary_pos_emb
        if self.layer_type != SLIDING:
            freqs = compressed_freqs(rotary_pos_emb, self.config.compressed_attention_rotary_base, x.shape[0])
        out = self._attention(x, freqs)  # [s, b, h]
        return (scatter_to_sequence_parallel_region(out, self.tp_group) if sp else out), None

    def _attention(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` -> ``[s, b, h]`` on the whole sequence."""
        s, b, _ = x.shape
        c, n, d = self.config, self.config.num_attention_heads, self.config.kv_channels
        latent = self.q_layernorm(self.linear_q_down_proj(x)[0])  # [s, b, q_lora_rank]
        q = unweighted_rms_norm(self.linear_q_up_proj(latent)[0].view(s, b, n, d), c.layernorm_epsilon)
        q = rotate_tail(q, freqs)  # [s, b, n, d]
        kv = rotate_tail(self.kv_layernorm(self.linear_kv_proj(x)[0]).unsqueeze(2), freqs).squeeze(2)  # [s, b, d]
        logits, values = [self._window_logits(q, kv)], [kv]
        if self.compressor is not None:
            entries = self.compressor(x, freqs)  # [T, b, d]
            chosen = self.indexer(x, latent, freqs) if self.indexer is not None else None  # [b, s, k]
            logits.append(self._compressed_logits(q, entries, chosen))
            values.append(entries if chosen is None else (entries, chosen))
        probs = self._softmax_with_sinks(logits)
        out = self._window_values(probs[0], kv)
        if self.compressor is not None:
            out = out + self._compressed_values(probs[1], *((values[1],) if chosen is None else values[1]))
        out = rotate_tail(out, freqs, inverse=True)  # [s, b, n, d]
        return self._grouped_output(out)

    def _window(self, kv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The last ``W`` keys of every query ``[s, b, d, W]`` (zeros before the start) and their
        validity ``[s, W]``."""
        s = kv.shape[0]
        width = min(self.config.window_size[0] + 1, s)
        padded = torch.cat([kv.new_zeros(width - 1, *kv.shape[1:]), kv])  # [s + W - 1, b, d]
        offsets = torch.arange(width, device=kv.device) - (width - 1)  # [W]: key position - query position
        valid = (torch.arange(s, device=kv.device)[:, None] + offsets[None, :]) >= 0  # [s, W]
        return padded.unfold(0, width, 1), valid

    def _window_logits(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        windows, valid = self._window(kv)
        logits = torch.einsum("sbnd,sbdw->bnsw", q, windows) * self.config.kv_channels**-0.5  # [b, n, s, W]
        return logits.masked_fill(~valid, float("-inf"))

    def _window_values(self, probs: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        windows, _ = self._window(kv)
        return torch.einsum("bnsw,sbdw->sbnd", probs, windows)  # [s, b, n, d]

    def _compressed_logits(
        self, q: torch.Tensor, entries: torch.Tensor, chosen: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """HCA: ``[b, n, s, T]`` over every entry (future ones masked); CSA: ``[b, n, s, k]`` over the chosen."""
        scale = self.config.kv_channels**-0.5
        if chosen is None:
            visible = visible_entries(q.shape[0], self.compressor.rate, q.device)  # [s]
            future = torch.arange(entries.shape[0], device=q.device)[None, :] >= visible[:, None]  # [s, T]
            return (torch.einsum("sbnd,tbd->bnst", q, entries) * scale).masked_fill(future, float("-inf"))
        picked = _gather_entries(entries, chosen)  # [b, s, k, d]
        logits = torch.einsum("sbnd,bskd->bnsk", q, picked) * scale
        return logits.masked_fill((chosen < 0).unsqueeze(1), float("-inf"))

    def _compressed_values(
        self, probs: torch.Tensor, entries: torch.Tensor, chosen: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        if chosen is None:
            return torch.einsum("bnst,tbd->sbnd", probs, entries)  # [s, b, n, d]
        return torch.einsum("bnsk,bskd->sbnd", probs, _gather_entries(entries, chosen))

    def _softmax_with_sinks(self, logits: list) -> list:
        """Softmax over all pieces' last dims and the per-head sink; the pieces' probabilities (dropout
        applied in training)."""
        b, n, s = logits[0].shape[:3]
        sink = self.attention_sinks.view(1, n, 1, 1).expand(b, n, s, 1).to(logits[0].dtype)
        joined = torch.cat([*logits, sink], dim=-1)  # [b, n, s, W + T|k + 1]
        joined = joined - joined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(joined, dim=-1)[..., :-1]
        probs = F.dropout(probs, p=self.config.attention_dropout, training=self.training)
        return list(probs.split([piece.shape[-1] for piece in logits], dim=-1))

    def _grouped_output(self, out: torch.Tensor) -> torch.Tensor:
        """``[s, b, n, d]`` -> ``[s, b, h]``: per head group a rank-``r`` projection, then all groups to ``h``."""
        s, b = out.shape[:2]
        g = self.config.attention_output_groups
        grouped = out.reshape(s, b, g, -1)  # [s, b, g, n d / g]
        weight = self.linear_o_group_proj.weight.view(g, -1, grouped.shape[-1])  # [g, r, n d / g]
        low_rank = torch.einsum("sbgi,gri->sbgr", grouped, weight).reshape(s, b, -1)  # [s, b, g r]
        return self.linear_proj(low_rank)[0]  # [s, b, h]


def _gather_entries(entries: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Entries ``[T, b, d]`` at indices ``[b, s, k]`` (``-1``: any, masked by the caller) -> ``[b, s, k, d]``."""
    b = chosen.shape[0]
    batch = torch.arange(b, device=chosen.device).view(b, 1, 1)
    return entries.transpose(0, 1)[batch, chosen.clamp(min=0)]
