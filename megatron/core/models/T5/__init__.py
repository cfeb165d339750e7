"""T5: ``T5Model``, its layer specs (Megatron-core's and Hugging Face T5 v1.1's) and the HF state-dict mapping."""

from megatron.core.models.T5.t5_model import (
    T5LMHead,
    T5Model,
    t5_extended_attention_mask,
    t5_padding_attention_masks,
    t5_position_ids,
)
from megatron.core.models.T5.t5_spec import (
    get_t5_decoder_with_local_block_spec,
    get_t5_decoder_with_transformer_engine_block_spec,
    get_t5_encoder_with_local_block_spec,
    get_t5_encoder_with_transformer_engine_block_spec,
    get_t5_v11_decoder_block_spec,
    get_t5_v11_encoder_block_spec,
    t5_v11_config,
)

__all__ = [
    "T5LMHead",
    "T5Model",
    "get_t5_decoder_with_local_block_spec",
    "get_t5_decoder_with_transformer_engine_block_spec",
    "get_t5_encoder_with_local_block_spec",
    "get_t5_encoder_with_transformer_engine_block_spec",
    "get_t5_v11_decoder_block_spec",
    "get_t5_v11_encoder_block_spec",
    "t5_extended_attention_mask",
    "t5_padding_attention_masks",
    "t5_position_ids",
    "t5_v11_config",
]
