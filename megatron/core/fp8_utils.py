"""Switching a transformer layer's linears to FP8/FP4 GEMMs (Megatron's ``fp8_utils`` place).

Megatron enters Transformer Engine's ``fp8_autocast`` around each layer; here each
``ColumnParallelLinear`` / ``RowParallelLinear`` of a layer (attention, MLP, MoE experts) gets an
explicit ``LinearQuantizer`` once, when the layer is built. Embeddings, the output layer and the
first/last layers under ``first_last_layers_bf16`` keep their high-precision GEMMs.
"""

from __future__ import annotations

import torch

from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.quantization import fp8_params
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
        module.quantizer = LinearQuantizer(recipe, group)
        if module.is_expert:  # per-expert checkpoint keys, like the expert weights
            for buffer in module.quantizer.buffers():
                buffer.allreduce = False
        count += 1
    return count


def convert_weights_to_fp8(model: torch.nn.Module) -> int:
    """Store the weight of every linear with a per-tensor quantizer as FP8 (``--fp8-param-gather``).

    Each such weight becomes ``quantization.fp8_params.to_fp8_param``'s FP8 parameter; the linear's
    ``state_dict`` then holds the dequantized high-precision values (what a run without the flag
    loads) and ``load_state_dict`` casts what it is given. Returns how many weights were converted.

    Raises:
        ValueError: a linear has a quantizer of a recipe other than tensorwise/delayed.
    """
    count = 0
    for module in model.modules():
        quantizer = getattr(module, "quantizer", None)
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or quantizer is None:
            continue
        if fp8_params.is_fp8_param(module.weight):
            continue
        module.weight = fp8_params.to_fp8_param(module.weight, quantizer)
        module.register_state_dict_post_hook(_dequantized_weight_in_state_dict)
        module.register_load_state_dict_pre_hook(_cast_loaded_weight)
        count += 1
    return count


def _dequantized_weight_in_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """``weight`` as high-precision values, kept on the parameter for a sharded load to write into
    until ``load_fp8_checkpoint_values`` or ``drop_fp8_checkpoint_values`` (one copy per weight)."""
    values = fp8_params.dequantize(module.weight)
    module.weight.fp8_meta.checkpoint_values = values
    state_dict[prefix + "weight"] = values


def _cast_loaded_weight(module, state_dict, prefix, *args) -> None:
    """Cast a high-precision ``weight`` entry into the FP8 parameter; the entry becomes its bytes."""
    values = state_dict.get(prefix + "weight")
    if values is None or fp8_params.is_fp8_param(values):
        return
    fp8_params.load_values(module.weight, values, state_dict.get(prefix + "quantizer.delayed.weight.scale"))
    state_dict[prefix + "weight"] = module.weight.detach()


def load_fp8_checkpoint_values(model_chunks) -> None:
    """After a sharded load filled the high-precision tensors ``state_dict`` handed out for FP8
    weights, cast them into the weights (the delayed state is loaded by then); drop them."""
    for chunk in model_chunks:
        for param in chunk.parameters():
            meta = getattr(param, "fp8_meta", None)
            if meta is not None and meta.checkpoint_values is not None:
                fp8_params.load_values(param, meta.checkpoint_values)
                meta.checkpoint_values = None


def drop_fp8_checkpoint_values(model_chunks) -> None:
    """Free the high-precision copies ``state_dict`` made of FP8 weights (after a save)."""
    for chunk in model_chunks:
        for param in chunk.parameters():
            if getattr(param, "fp8_meta", None) is not None:
                param.fp8_meta.checkpoint_values = None


def check_fp8_param_gather(config: TransformerConfig) -> None:
    """``fp8_param_gather`` needs a per-tensor FP8 recipe (Megatron refuses it without ``--fp8-format``).

    ``config``: a ``TransformerConfig``, or anything with its ``fp8``, ``fp8_recipe`` and ``fp4`` (the
    parsed flags, so the command line states the same rule).

    Raises:
        ValueError: naming the setting and the rule.
    """
    if config.fp4:
        raise ValueError(f"fp8_param_gather=True with fp4={config.fp4!r}: not supported yet (FP4 weights)")
    if not config.fp8:
        raise ValueError("fp8_param_gather=True requires FP8 training: set --fp8-format (as Megatron does)")
    if config.fp8_recipe not in fp8_params.PARAM_GATHER_RECIPES:
        raise ValueError(
            f"fp8_param_gather=True with fp8_recipe={config.fp8_recipe!r}: not supported yet "
            f"(only {fp8_params.PARAM_GATHER_RECIPES})"
        )
