"""Switching a transformer layer's linears to FP8/FP4 GEMMs (Megatron's ``fp8_utils`` place).

Megatron enters Transformer Engine's ``fp8_autocast`` around each layer; here each
``ColumnParallelLinear`` / ``RowParallelLinear`` of a layer (attention, MLP, MoE experts) gets an
explicit ``LinearQuantizer`` once, when the layer is built. Embeddings, the output layer and the
first/last layers under ``first_last_layers_bf16`` keep their high-precision GEMMs.
"""

from __future__ import annotations

import torch

from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.quantization.fp8_gemm import check_fp8_dims
from megatron.core.quantization.recipes import LinearQuantizer, recipe_from_config
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig


def is_layer_in_high_precision(config: TransformerConfig, layer_number: int) -> bool:
    """Whether global layer ``layer_number`` (1-based) stays out of FP8 (Megatron's bf16 window)."""
    if not config.first_last_layers_bf16:
        return False
    index = layer_number - 1
    return index < config.num_layers_at_start_in_bf16 or index >= config.num_layers - config.num_layers_at_end_in_bf16


def attach_quantizers(
    layer: torch.nn.Module, config: TransformerConfig, pg_collection: ProcessGroupCollection, layer_number: int
) -> int:
    """Give every parallel linear of ``layer`` the config's quantizer; returns how many got one.

    The amax group: under delayed scaling the TP x DP x CP group (Megatron's default amax
    reduction group, so data-parallel replicas keep equal scales and equal checkpointed state);
    under current scaling the linear's own TP group (expert-TP for experts), as in TE.
    """
    recipe = recipe_from_config(config)
    if recipe is None or is_layer_in_high_precision(config, layer_number):
        return 0
    count = 0
    for name, module in layer.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or module.weight is None:
            continue
        check_fp8_dims(f"layer {layer_number} {name}", *module.weight.shape)
        group = pg_collection.tp_dp_cp if recipe.recipe == "delayed" else module.tp_group
        module.quantizer = LinearQuantizer(recipe, group, seed=1000 * layer_number + count)  # nvfp4's SR streams
        if module.is_expert:  # per-expert checkpoint keys, like the expert weights
            for buffer in module.quantizer.buffers():
                buffer.allreduce = False
        count += 1
    return count
