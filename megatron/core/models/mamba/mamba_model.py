"""Megatron-core's ``MambaModel``: a language model over a hybrid Mamba stack (``MambaStack``).

Embedding, output layer, loss, pipeline stages and tensor/sequence parallelism are ``GPTModel``'s; only
the decoder differs (``mamba_stack_spec`` with the hybrid pattern) and, as in Megatron-core, the default
position embedding is none (Mamba layers know positions from the scan; attention layers use none or RoPE).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig


class MambaModel(GPTModel):
    """Megatron-core's arguments; ``forward`` is ``GPTModel.forward`` (logits ``[b, s, vocab(/tp)]`` or the
    per-token loss). ``hybrid_override_pattern`` (e.g. ``"M-M*"``) or the two ratios choose the layer types."""

    def __init__(
        self,
        config: TransformerConfig,
        mamba_stack_spec: ModuleSpec,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        hybrid_attention_ratio: float = 0.0,
        hybrid_mlp_ratio: float = 0.0,
        hybrid_override_pattern: Optional[str] = None,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "none",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: Optional[float] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        vp_stage: Optional[int] = None,
    ) -> None:
        hybrid = {
            "hybrid_attention_ratio": hybrid_attention_ratio,
            "hybrid_mlp_ratio": hybrid_mlp_ratio,
            "hybrid_override_pattern": hybrid_override_pattern,
        }
        stack_spec = dataclasses.replace(mamba_stack_spec, params={**mamba_stack_spec.params, **hybrid})
        super().__init__(
            config=config,
            transformer_layer_spec=stack_spec,
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            fp16_lm_cross_entropy=fp16_lm_cross_entropy,
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type=position_embedding_type,
            rotary_percent=rotary_percent,
            rotary_base=rotary_base,
            scatter_embedding_sequence_parallel=scatter_embedding_sequence_parallel,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )
