"""What GPT and BERT share: the vocab-parallel LM loss and the tied word-embedding / output weight."""

from __future__ import annotations

from typing import List, Optional

import torch

from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.transformer.module import MegatronModule


class LanguageModule(MegatronModule):
    """Base of the language models. Subclasses set ``pg_collection``, ``pre_process``,
    ``post_process``, ``embedding`` (first stage, and the last with ``mtp_process``) and
    ``output_layer`` (last stage)."""

    pg_collection: ProcessGroupCollection
    pre_process: bool
    post_process: bool
    mtp_process: bool = False  # GPT's multi-token prediction on this (last) stage: it embeds too

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        """The word-embedding weight on a stage that embeds, else the output weight on the last."""
        if self.pre_process or self.mtp_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def cross_stage_embedding_weights(self) -> List[torch.nn.Parameter]:
        """This stage's weights that have a copy on another pipeline stage, in the same order on the
        first and the last stage (the embedding group keeps the copies equal, as Megatron does): the
        word embedding when it is tied to the output layer or the last stage runs multi-token
        prediction, then for the latter the learned position embedding. Empty on one stage."""
        mtp_elsewhere = bool(getattr(self.config, "mtp_num_layers", None)) and self.pre_process != self.mtp_process
        tied = self.share_embeddings_and_output_weights and self.pre_process != self.post_process
        weights = [self.shared_embedding_or_output_weight()] if tied or mtp_elsewhere else []
        if mtp_elsewhere and getattr(self.embedding, "position_embeddings", None) is not None:
            weights.append(self.embedding.position_embeddings.weight)
        return weights

    def mark_tied_output_weight(self, share_embeddings_and_output_weights: bool) -> None:
        """After building ``output_layer`` (and ``embedding``): flag the weights that the tie or the
        last stage's embedding copy make one parameter."""
        if share_embeddings_and_output_weights and (self.pre_process or self.mtp_process):
            # With gradient_accumulation_fusion the output layer hands autograd a dummy weight
            # gradient that is summed with the embedding's: it must be zeros (DDP adds the sum).
            self.embedding.word_embeddings.weight.zero_out_wgrad = True
        if not self.pre_process:
            for weight in self.cross_stage_embedding_weights():
                # The last stage's copies; the training code keeps them equal to the first stage's.
                weight.shared_embedding = True

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy ``[b, s]`` from labels ``[b, s]`` and logits ``[s, b, vocab/tp]``.

        The logits go in their own dtype: the cross entropy computes in fp32 either way (bf16/fp16
        logits block by block), so ``fp16_lm_cross_entropy`` changes no number, and an fp32 copy of
        the whole ``[s, b, vocab/tp]`` tensor would only cost time and memory. ``config.cross_entropy_loss_fusion``
        picks the fused form (``fusions/fused_cross_entropy.py``: one region each way) over the reference.
        """
        fused = self.config.cross_entropy_loss_fusion
        cross_entropy = fused_vocab_parallel_cross_entropy if fused else vocab_parallel_cross_entropy
        loss = cross_entropy(logits, labels.transpose(0, 1).contiguous(), tp_group=self.pg_collection.tp)  # [s, b]
        return loss.transpose(0, 1).contiguous()  # [b, s]
