"""Token (vocab-parallel) plus optional learned position and token-type embeddings, output ``[s, b, h]``."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    VocabParallelEmbedding,
    get_cuda_rng_tracker,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_tensor_model_parallel_group_if_none

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


class LanguageModelEmbedding(MegatronModule):
    """Embeds token ids ``[b, s]`` into ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism).

    With sequence parallelism the word embedding is reduce-scattered straight into
    sequence shards (no all-reduce), and the replicated position (and token-type)
    embeddings are sliced to the same shard before they are added.

    Megatron-core's signature: the TP group comes from ``pg_collection`` (our models pass it),
    ``tp_group``, or, when neither is given, the groups ``initialize_model_parallel`` built.

    ``num_tokentypes > 0`` builds BERT's ``tokentype_embeddings`` (replicated over TP);
    ``forward`` then needs ``tokentype_ids [b, s]``. ``embedding_layernorm=True`` (ours, for
    post-LN BERT as in Hugging Face) normalizes the sum before dropout.
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str = "learned_absolute",
        num_tokentypes: int = 0,
        scatter_to_sequence_parallel: bool = True,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        *,
        pg_collection: Optional[ProcessGroupCollection] = None,
        embedding_layernorm: bool = False,
    ) -> None:
        super().__init__(config)
        config.require_width("LanguageModelEmbedding")
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type={position_embedding_type!r}: must be one of {POSITION_EMBEDDING_TYPES}"
            )
        if num_tokentypes < 0:
            raise ValueError(f"num_tokentypes={num_tokentypes}: must be >= 0")
        self.num_tokentypes = num_tokentypes
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        if pg_collection is not None and tp_group is not None and tp_group is not pg_collection.tp:
            raise ValueError("LanguageModelEmbedding: tp_group and pg_collection.tp name different groups")
        # Upstream's boundary: our models pass pg_collection; a library caller may pass tp_group or neither.
        self.tp_group = get_tensor_model_parallel_group_if_none(pg_collection.tp if pg_collection else tp_group)
        # scatter_to_sequence_parallel=False keeps the whole sequence on every rank even under SP.
        self.sequence_parallel = config.sequence_parallel and scatter_to_sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size,
            config.hidden_size,
            init_method=config.embedding_init_method,
            config=config,
            reduce_scatter_embeddings=self.sequence_parallel,
            tp_group=self.tp_group,
        )
        # Position and token-type embeddings are replicated over TP. Under SP their output is
        # scattered along the sequence, and the scatter's backward all-gathers, so every rank
        # already gets the whole gradient.
        self.position_embeddings = None
        if position_embedding_type == "learned_absolute":
            self.position_embeddings = self._replicated_embedding(max_sequence_length)
        self.tokentype_embeddings = self._replicated_embedding(num_tokentypes) if num_tokentypes else None
        self.embedding_layernorm = build_norm(config, config.hidden_size) if embedding_layernorm else None
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    def _replicated_embedding(self, rows: int) -> torch.nn.Embedding:
        table = torch.nn.Embedding(rows, self.config.hidden_size, dtype=self.config.params_dtype)
        if self.config.perform_initialization:
            self.config.embedding_init_method(table.weight)
        return table

    def zero_parameters(self) -> None:
        """Megatron-core's ``zero_parameters``: zero every embedding table and mark it ``shared``.

        ``shared`` tables are left out of gradient-norm clipping and of the shared-parameter checks
        (``param.shared``), as upstream does for a stage whose embedding copy is not the owner.
        """
        tables = (self.word_embeddings, self.position_embeddings, self.tokentype_embeddings)
        with torch.no_grad():
            for table in (t for t in tables if t is not None):
                table.weight.zero_()
                table.weight.shared = True

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor],
        tokentype_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``input_ids``, ``position_ids``, ``tokentype_ids`` ``[b, s]`` -> ``[s(/tp with SP), b, h]``."""
        if (tokentype_ids is None) != (self.tokentype_embeddings is None):
            raise ValueError(
                f"tokentype_ids must be given exactly when num_tokentypes > 0 (num_tokentypes={self.num_tokentypes})"
            )
        if self.sequence_parallel:
            words = self.word_embeddings(input_ids)  # [s/tp, b, h]: transposed before the reduce-scatter
        else:
            # Looked up in [s, b] order, so the rows land contiguous as [s, b, h]: a transposed [b, s, h]
            # view would give the whole residual stream, and every gradient flowing back along it, a
            # [b, s, h] memory layout, which the GEMMs on those gradients (proj, fc2) would then copy.
            words = self.word_embeddings(input_ids.t())  # [s, b, h], contiguous
        replicated = self._replicated_sum(input_ids, position_ids, tokentype_ids)  # [s, b, h] or None
        if replicated is not None:
            if self.sequence_parallel:
                replicated = scatter_to_sequence_parallel_region(replicated, group=self.tp_group)  # [s/tp, b, h]
            words = words + replicated
        if self.embedding_layernorm is not None:
            words = self.embedding_layernorm(words)
        dropping = self.training and self.embedding_dropout.p > 0
        # Sequence shards differ per TP rank, so their dropout masks must too.
        rng = get_cuda_rng_tracker().fork() if self.sequence_parallel and dropping else contextlib.nullcontext()
        with rng:
            words = self.embedding_dropout(words)
        # fp32_residual_connection: the residual stream starts here, in fp32.
        return words.float() if self.config.fp32_residual_connection else words

    def _replicated_sum(
        self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor], tokentype_ids: Optional[torch.Tensor]
    ) -> Optional[torch.Tensor]:
        """Position plus token-type embeddings ``[s, b, h]`` (None when neither is built)."""
        total = None
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            total = self.position_embeddings(position_ids).transpose(0, 1)  # [s, b, h]
        if self.tokentype_embeddings is not None:
            types = self.tokentype_embeddings(tokentype_ids).transpose(0, 1)  # [s, b, h]
            total = types if total is None else total + types
        return total
