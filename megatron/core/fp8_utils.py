"""Megatron-core's ``megatron.core.fp8_utils`` import path: the code lives in ``transformer/fp8_utils.py``
(it imports the transformer's linears, and the transformer block imports it: one layer, not two)."""

from megatron.core.transformer.fp8_utils import (  # noqa: F401 - re-exported
    attach_mtp_quantizers,
    attach_quantizers,
    block_quantization_context,
    check_fp8_param_gather,
    convert_weights_to_fp8,
    drop_fp8_checkpoint_values,
    is_layer_in_high_precision,
    layer_quantization_context,
    load_fp8_checkpoint_values,
)
