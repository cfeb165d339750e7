"""Switching a transformer layer's linears to FP8/FP4 GEMMs (Megatron's ``fp8_utils`` place).

Each local ``ColumnParallelLinear`` / ``RowParallelLinear`` of a layer (attention, MLP, MoE
experts) and each ``ReplicatedLinear`` (MLA's down projections) gets an explicit ``LinearQuantizer``
once, when the layer is built. A block whose layers hold Transformer Engine's
linears (``core/extensions/transformer_engine.py``) runs them inside one TE autocast with the mapped
recipe and Megatron's amax-reduction group (``block_quantization_context``), so delayed scaling's
amaxes are all-reduced once per block forward; bf16-window layers nest an ``enabled=False`` region.
Embeddings, the output layer and the first/last layers under ``first_last_layers_bf16`` keep their
high-precision GEMMs. Multi-token prediction modules (``attach_mtp_quantizers``) are FP8 whenever
the model is, as Megatron runs them in the global FP8 context (no layer number, so outside the bf16
window); under FP4 they stay in high precision, as Megatron leaves them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch

from megatron.core import compatibility
from megatron.core.extensions.transformer_engine import is_te_linear, te_autocast, te_recipe
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.quantization import fp8_params
from megatron.core.quantization.fp8_gemm import check_fp8_dims
from megatron.core.quantization.recipes import LinearQuantizer, QuantRecipe, recipe_from_config
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.multi_latent_attention import ReplicatedLinear
from megatron.core.transformer.transformer_config import TransformerConfig

_QUANTIZABLE = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)


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
    return _attach(layer, recipe, pg_collection, f"layer {layer_number}", 1000 * layer_number)


def attach_mtp_quantizers(
    mtp_layer: torch.nn.Module, config: TransformerConfig, pg_collection: ProcessGroupCollection
) -> int:
    """Quantizers for a multi-token prediction module (``eh_proj`` and its transformer layer): under
    FP8 always (Megatron's global FP8 context, outside ``first_last_layers_bf16``), never under FP4."""
    if not config.fp8:
        return 0
    return _attach(mtp_layer, recipe_from_config(config), pg_collection, "mtp", 1000 * (config.num_layers + 1))


def _attach(
    layer: torch.nn.Module, recipe: QuantRecipe, pg_collection: ProcessGroupCollection, where: str, seed_base: int
) -> int:
    """A ``LinearQuantizer`` for every quantizable linear of ``layer``, the k-th seeded ``seed_base + k``
    (nvfp4's stochastic-rounding streams); returns how many got one."""
    count = 0
    for name, module in layer.named_modules():
        if not isinstance(module, _QUANTIZABLE) or module.weight is None:
            continue
        check_fp8_dims(f"{where} {name}", *module.weight.shape)
        group = _amax_group(module, recipe, pg_collection)
        module.quantizer = LinearQuantizer(recipe, group, seed=seed_base + count)  # nvfp4's SR streams
        if getattr(module, "is_expert", False):  # per-expert checkpoint keys, like the expert weights
            for buffer in module.quantizer.buffers():
                buffer.allreduce = False
        count += 1
    return count


def _amax_group(module: torch.nn.Module, recipe: QuantRecipe, pg_collection: ProcessGroupCollection):
    """Delayed: TP x DP x CP. Current scaling: the linear's TP group; for a replicated linear the TP
    group too, so that under sequence parallelism (each rank its own tokens) every TP rank uses the
    scale one rank would (TE reduces no amax for a duplicated linear: equal without SP)."""
    if recipe.recipe == "delayed":
        return pg_collection.tp_dp_cp
    return pg_collection.tp if isinstance(module, ReplicatedLinear) else module.tp_group


def block_quantization_context(
    layers: Sequence[torch.nn.Module], config: TransformerConfig, pg_collection: ProcessGroupCollection
) -> Optional[Callable[..., ContextManager]]:
    """What to enter once around a transformer block's layers: TE's autocast with the mapped recipe and
    the TP x DP x CP group (Megatron's amax-reduction group) where a layer holds TE linears and the
    model runs in FP8/FP4, else None. One region per block forward (per microbatch and model chunk):
    TE all-reduces delayed scaling's amaxes when the outermost region exits, so once, not per layer
    (Megatron's outer FP8 context). Called with ``enabled=False`` it gives a nested high-precision region.
    """
    if recipe_from_config(config) is None:
        return None
    if not any(is_te_linear(type(m), "column") or is_te_linear(type(m), "row") for m in _modules(layers)):
        return None
    recipe = te_recipe(config)  # mapped once, when the model is built: a setting TE cannot take raises here
    if recipe_from_config(config).recipe == "delayed" and config.recompute_granularity == "full":
        raise NotImplementedError(
            "fp8_recipe='delayed' with recompute_granularity='full' under transformer_impl='transformer_engine': "
            "not supported yet (TE's delayed scaling needs its own handling of recomputed forwards); use "
            "--transformer-impl local, whose delayed scaling handles recomputation, or another --fp8-recipe"
        )
    return functools.partial(te_autocast, recipe, pg_collection.tp_dp_cp)


def layer_quantization_context(
    block_context: Optional[Callable[..., ContextManager]], config: TransformerConfig, layer_number: int
) -> Optional[Callable[[], ContextManager]]:
    """What layer ``layer_number`` enters inside the block's region: for a layer in the bf16 window a
    nested TE autocast with ``enabled=False`` (its TE linears run in high precision), else None."""
    if block_context is None or not is_layer_in_high_precision(config, layer_number):
        return None
    return functools.partial(block_context, enabled=False)


def _modules(layers: Sequence[torch.nn.Module]) -> Iterator[torch.nn.Module]:
    for layer in layers:
        yield from layer.modules()


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


def check_fp8_param_gather(config: TransformerConfig, ddp_config: Any) -> None:
    """The compatibility matrix's rows on ``fp8_param_gather`` across the model and DDP configs.

    Raises:
        ValueError: naming the settings and the reason (``megatron/core/compatibility.py``).
    """
    compatibility.check(
        config,
        fp8_param_gather=ddp_config.fp8_param_gather,
        use_distributed_optimizer=ddp_config.use_distributed_optimizer,
    )
