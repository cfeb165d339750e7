"""What GPT and BERT share: the vocab-parallel LM loss and the tied word-embedding / output weight."""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.transformer.module import MegatronModule


class LanguageModule(MegatronModule):
    """Base of the language models. Subclasses set ``pg_collection``, ``pre_process``,
    ``post_process``, ``embedding`` (first stage) and ``output_layer`` (last stage)."""

    pg_collection: ProcessGroupCollection
    pre_process: bool
    post_process: bool

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        """The word-embedding weight on the first stage, the output weight on the last."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def mark_tied_output_weight(self, share_embeddings_and_output_weights: bool) -> None:
        """After building ``output_layer``: flag the weights that the tie makes one parameter."""
        if not share_embeddings_and_output_weights:
            return
        if self.pre_process:
            # With gradient_accumulation_fusion the output layer hands autograd a dummy weight
            # gradient that is summed with the embedding's: it must be zeros (DDP adds the sum).
            self.embedding.word_embeddings.weight.zero_out_wgrad = True
        else:
            # The last stage's copy; the training code keeps it equal to the first stage's.
            self.output_layer.weight.shared_embedding = True

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy ``[b, s]`` from labels ``[b, s]`` and logits ``[s, b, vocab/tp]``.

        The logits go in their own dtype: the cross entropy computes in fp32 either way (bf16/fp16
        logits block by block), so ``fp16_lm_cross_entropy`` changes no number, and an fp32 copy of
        the whole ``[s, b, vocab/tp]`` tensor would only cost time and memory.
        """
        loss = vocab_parallel_cross_entropy(
            logits, labels.transpose(0, 1).contiguous(), tp_group=self.pg_collection.tp
        )  # [s, b]
        return loss.transpose(0, 1).contiguous()  # [b, s]
