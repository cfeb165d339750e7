"""A stack of transformer layers (this pipeline stage's share) with the final norm on the last stage."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ContextManager, List, Optional, Union

import torch

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import checkpoint, get_cuda_rng_tracker, initialization_rng
from megatron.core.transformer.fp8_utils import (
    attach_quantizers,
    block_quantization_context,
    layer_quantization_context,
)
from megatron.core.transformer.hyper_connection import HyperHead
from megatron.core.transformer.layer_layout import config_layer_assignment
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import LayerNorm, Norm, RMSNorm, build_norm
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import config_stage, get_transformer_layer_offset

__all__ = [
    "TransformerBlock",
    "TransformerBlockSubmodules",
    "get_num_layers_to_build",
    "get_transformer_layer_offset",
    "layer_numbers_to_build",
]


@dataclass
class TransformerBlockSubmodules:
    """One layer spec per global layer (index ``layer_number - 1``), e.g. MoE and dense layers mixed."""

    layer_specs: List[ModuleSpec] = field(default_factory=list)
    layer_norm: Optional[Any] = None
    """Megatron-core's spec of the final norm: None or a class building ``config.normalization``'s norm
    (``Norm``, or ``LayerNorm`` / ``RMSNorm`` matching it); the block builds that norm either way."""

    def check_layer_norm(self, config: TransformerConfig) -> None:
        """Raise unless ``layer_norm`` names the norm the block builds."""
        matching = LayerNorm if config.normalization == "LayerNorm" else RMSNorm
        if self.layer_norm not in (None, Norm, matching):
            raise NotImplementedError(
                f"TransformerBlockSubmodules.layer_norm={self.layer_norm!r}: only the norm "
                f"config.normalization={config.normalization!r} names"
            )


def layer_numbers_to_build(
    config: TransformerConfig, pp_rank: int, pp_size: int, vp_stage: Optional[int] = None
) -> List[int]:
    """Global 1-based numbers of the layers that ``(pp_rank, vp_stage)`` holds."""
    layout = config_layer_assignment(config, pp_size)
    return layout[pp_rank][vp_stage or 0]


def get_num_layers_to_build(
    config: TransformerConfig, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
) -> int:
    """Megatron-core's helper: how many layers pipeline rank ``pp_rank`` (default: this rank, from
    ``parallel_state``) holds in virtual stage ``vp_stage``, by the config's sizes."""
    layout, pp_rank, chunk = config_stage(config, vp_stage, pp_rank)
    return len(layout[pp_rank][chunk])


class TransformerBlock(MegatronModule):
    """Runs this stage's layers. On non-first stages the input comes from ``set_input_tensor``."""

    final_norm_name = "final_layernorm"  # Megatron-core's MambaStack calls it final_norm

    def __init__(
        self,
        config: TransformerConfig,
        spec: Union[ModuleSpec, TransformerBlockSubmodules],
        post_layer_norm: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        pg_collection: Optional[ProcessGroupCollection] = None,
        vp_stage: Optional[int] = None,
        *,
        name: str = "decoder",
    ) -> None:
        super().__init__(config)
        self.name = name  # layer N is initialized from (initialization_seed, f"{name}.layers.{N}")
        # None: parallel_state's groups, for library callers (Megatron-core's signature); models pass theirs.
        groups = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
        self.tp_group = groups.tp  # activations saved for recompute are distributed over it
        self.pre_process, self.post_process = pre_process, post_process
        numbers = layer_numbers_to_build(config, groups.rank_in("pp"), groups.size_of("pp"), vp_stage)
        self.layers = torch.nn.ModuleList(self._build_layer(spec, n, groups) for n in numbers)
        # Transformer Engine's linears quantize inside one TE autocast around all layers (plain attributes:
        # not submodules); a bf16-window layer nests a disabled one.
        self.quantization_context = block_quantization_context(self.layers, config, groups)
        for layer, number in zip(self.layers, numbers):
            layer.quantization_context = layer_quantization_context(self.quantization_context, config, number)
        if isinstance(spec, TransformerBlockSubmodules):
            spec.check_layer_norm(config)
        final_norm = build_norm(config, config.hidden_size) if post_process and post_layer_norm else None
        self.hyper_head = None
        if post_process and config.hyper_connection_streams > 1:
            self.hyper_head = HyperHead(config, config.hyper_connection_streams, config.hyper_connection_eps)
        setattr(self, self.final_norm_name, final_norm)
        self.input_tensor: Optional[torch.Tensor] = None

    def _build_layer(
        self, spec: Union[ModuleSpec, TransformerBlockSubmodules], number: int, groups: ProcessGroupCollection
    ) -> torch.nn.Module:
        if isinstance(spec, TransformerBlockSubmodules):
            if len(spec.layer_specs) != self.config.num_layers:
                raise ValueError(
                    f"TransformerBlockSubmodules has {len(spec.layer_specs)} layer specs for "
                    f"num_layers={self.config.num_layers}"
                )
            spec = spec.layer_specs[number - 1]
        # A heterogeneous model (transformer/heterogeneous) builds each layer with its own shapes.
        config = self.config.get_config_for_layer(number) if self.config.heterogeneous_block_specs else self.config
        with initialization_rng(self.config.initialization_seed, f"{self.name}.layers.{number - 1}"):
            layer = build_module(spec, config, layer_number=number, pg_collection=groups, add_layer_offset=False)
        attach_quantizers(layer, self.config, groups, number)  # FP8/FP4 GEMMs, when the config asks
        return layer

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        """Activation received from the previous pipeline stage."""
        self.input_tensor = input_tensor

    def _run_layers(
        self,
        hidden: torch.Tensor,
        start: int,
        end: int,
        attention_mask: Optional[torch.Tensor],
        rotary_pos_emb: Optional[torch.Tensor],
        context: Optional[torch.Tensor] = None,
        context_mask: Optional[torch.Tensor] = None,
        attention_bias: Optional[torch.Tensor] = None,
        inference_context: Optional[Any] = None,
        reenter_quantization: bool = False,
        packed_seq_params: Optional[Any] = None,
        token_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Layers ``start:end``. ``reenter_quantization``: enter the block's TE autocast again, for a
        chunk under full recomputation (recomputed during backward, outside the block's region; nested,
        so no region of its own, in the first forward)."""
        if reenter_quantization:
            with self._quantization():
                return self._run_layers(
                    hidden, start, end, attention_mask, rotary_pos_emb, context, context_mask, attention_bias,
                    inference_context, packed_seq_params=packed_seq_params, token_ids=token_ids,
                )  # fmt: skip
        extra = {} if context is None else {"context": context, "context_mask": context_mask}
        if attention_bias is not None:
            extra["attention_bias"] = attention_bias
        if inference_context is not None:
            extra["inference_context"] = inference_context
        if packed_seq_params is not None:
            extra["packed_seq_params"] = packed_seq_params
        if token_ids is not None:
            extra["token_ids"] = token_ids
        for layer in self.layers[start:end]:
            context = getattr(layer, "quantization_context", None)
            with context() if context is not None else contextlib.nullcontext():
                hidden, _ = layer(hidden, attention_mask, rotary_pos_emb=rotary_pos_emb, **extra)
        return hidden

    def _quantization(self) -> ContextManager:
        """The block's one TE autocast region (``fp8_utils.block_quantization_context``), or nothing."""
        return self.quantization_context() if self.quantization_context is not None else contextlib.nullcontext()

    def _recomputed(self, start: int) -> bool:
        """Whether the layers starting at local index ``start`` are run under full recomputation."""
        c = self.config
        if c.recompute_granularity != "full" or not self.training:
            return False
        return c.recompute_method == "uniform" or start < c.recompute_num_layers

    def forward(
        self,
        hidden_states: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        context: Optional[torch.Tensor] = None,
        context_mask: Optional[torch.Tensor] = None,
        attention_bias: Optional[torch.Tensor] = None,
        inference_context: Optional[Any] = None,
        packed_seq_params: Optional[Any] = None,
        token_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``[s(/tp with SP), b, h]`` -> same shape.

        ``token_ids`` ``[b, s]`` go to every layer (hash-routed MoE layers). With
        ``config.hyper_connection_streams = n > 1`` the layers carry ``n`` packed streams ``[s, b, n * h]``:
        the first stage widens its input into ``n`` copies, the last collapses them (``hyper_head``)
        before the final norm; between pipeline stages the streams travel.

        ``context`` / ``context_mask``: the encoder output ``[sk(/tp), b, h]`` and the encoder-decoder
        mask (True = blocked) for layers with cross-attention. ``attention_bias`` ``[1|b, heads/tp, s, s]``
        is added to every layer's self-attention scores (T5's relative position bias, computed once).
        Under full recomputation both tensors enter the checkpoint as inputs, so their gradients flow.
        ``inference_context`` (the KV cache, ``megatron.core.inference``) and ``packed_seq_params``
        (packed sequences, ``megatron.core.packed_seq_params``) go to every layer.
        """
        if not self.pre_process:
            hidden_states = self.input_tensor
        elif self.config.hyper_connection_streams > 1:
            hidden_states = hidden_states.repeat(1, 1, self.config.hyper_connection_streams)  # [s, b, n * h]
        # With sequence parallelism each TP rank holds different tokens, so dropout there must
        # draw different masks: run the layers under the model-parallel RNG.
        dropout = self.training and (self.config.hidden_dropout > 0 or self.config.attention_dropout > 0)
        forked = self.config.sequence_parallel and dropout
        rng = get_cuda_rng_tracker().fork() if forked else contextlib.nullcontext()
        step = self.config.recompute_num_layers if self.config.recompute_method == "uniform" else 1
        with rng, self._quantization():  # one TE region: delayed scaling reduces amaxes once, at its exit
            start = 0
            while start < len(self.layers):
                end = min(start + (step or 1), len(self.layers))
                if self._recomputed(start):
                    hidden_states = checkpoint(
                        lambda h, c, a, s=start, e=end: self._run_layers(
                            h,
                            s,
                            e,
                            attention_mask,
                            rotary_pos_emb,
                            c,
                            context_mask,
                            a,
                            inference_context,
                            True,
                            packed_seq_params,
                            token_ids,
                        ),  # fmt: skip
                        bool(self.config.distribute_saved_activations),
                        hidden_states,
                        context,
                        attention_bias,
                        tp_group=self.tp_group,
                    )
                else:
                    hidden_states = self._run_layers(
                        hidden_states,
                        start,
                        end,
                        attention_mask,
                        rotary_pos_emb,
                        context,
                        context_mask,
                        attention_bias,
                        inference_context,
                        packed_seq_params=packed_seq_params,
                        token_ids=token_ids,
                    )
                start = end
        if getattr(self, "hyper_head", None) is not None:
            hidden_states = self.hyper_head(hidden_states)  # [s, b, h]
        final_norm = getattr(self, self.final_norm_name)
        if final_norm is not None:
            hidden_states = final_norm(hidden_states)
        return hidden_states
