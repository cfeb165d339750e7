"""Token (vocab-parallel) plus optional learned position embeddings, output ``[s, b, h]``."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    VocabParallelEmbedding,
    get_cuda_rng_tracker,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


class LanguageModelEmbedding(MegatronModule):
    """Embeds token ids ``[b, s]`` into ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism).

    With sequence parallelism the word embedding is reduce-scattered straight into
    sequence shards (no all-reduce), and the replicated position embedding is sliced
    to the same shard before the two are added.
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str = "learned_absolute",
        num_tokentypes: int = 0,
        *,
        pg_collection: ProcessGroupCollection,
    ) -> None:
        super().__init__(config)
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type={position_embedding_type!r}: must be one of {POSITION_EMBEDDING_TYPES}"
            )
        if num_tokentypes:
            raise ValueError("num_tokentypes > 0 (BERT token types) is not supported yet")
        self.tp_group = pg_collection.tp
        self.sequence_parallel = config.sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size,
            config.hidden_size,
            init_method=config.embedding_init_method,
            config=config,
            reduce_scatter_embeddings=self.sequence_parallel,
            tp_group=self.tp_group,
        )
        self.position_embeddings = None
        if position_embedding_type == "learned_absolute":
            self.position_embeddings = torch.nn.Embedding(
                max_sequence_length, config.hidden_size, dtype=config.params_dtype
            )
            if config.perform_initialization:
                config.embedding_init_method(self.position_embeddings.weight)
            # Replicated over TP. Under SP its output is scattered along the sequence, and the
            # scatter's backward all-gathers, so every rank already gets the whole gradient.

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
        words = self.word_embeddings(input_ids)  # [s/tp, b, h] with SP, else [b, s, h]
        if not self.sequence_parallel:
            words = words.transpose(0, 1)  # [s, b, h]
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            positions = self.position_embeddings(position_ids).transpose(0, 1)  # [s, b, h]
            if self.sequence_parallel:
                positions = scatter_to_sequence_parallel_region(positions, group=self.tp_group)  # [s/tp, b, h]
            words = words + positions
        p = self.config.hidden_dropout if self.training else 0.0
        # Sequence shards differ per TP rank, so their dropout masks must too.
        rng = get_cuda_rng_tracker().fork() if self.sequence_parallel and p > 0 else contextlib.nullcontext()
        with rng:
            words = F.dropout(words, p=p, training=p > 0)
        # fp32_residual_connection: the residual stream starts here, in fp32.
        return words.float() if self.config.fp32_residual_connection else words
