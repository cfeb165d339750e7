"""GPTModel: embeddings, decoder block, output layer and vocab-parallel loss."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch

from megatron.core.context_parallel import cp_chunk_positions, packed_cp_indices
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.core.models.common.language_module import LanguageModule
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.packed_seq_params import PackedSeqParams, packed_position_ids
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    gather_from_tensor_model_parallel_region,
    initialization_rng,
)
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    mtp_loss_name,
    mtp_loss_terms,
    roll_left,
)
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import refuse_unimplemented

# Defaults of the short keyword form only (GPT-2's vocabulary padded to 128, its context).
SHORT_FORM_VOCAB_SIZE = 50304
SHORT_FORM_MAX_SEQUENCE_LENGTH = 1024
_CONFIG_FIELDS = {f.name for f in dataclasses.fields(TransformerConfig)}


def _config_from_keywords(config: Optional[TransformerConfig], fields: dict) -> TransformerConfig:
    unknown = set(fields) - _CONFIG_FIELDS
    if unknown:
        raise TypeError(f"GPTModel got unexpected keyword argument(s) {sorted(unknown)}")
    if config is not None:
        if fields:
            raise TypeError(f"pass either config= or TransformerConfig fields, not both (got {sorted(fields)})")
        return config
    return TransformerConfig(**fields)


def _latent_attention_rotary(
    config: TransformerConfig, rotary_percent: float, interpolation: Optional[float], rotary_base: float
) -> RotaryEmbedding:
    """Multi-latent attention's angles for its ``qk_pos_emb_head_dim`` channels (RoPE or YaRN), whatever
    ``position_embedding_type`` says, as in Megatron; MLA applies YaRN's cos/sin scale itself."""
    if config.rope_type == "yarn":
        return YarnRotaryEmbedding(
            config.qk_pos_emb_head_dim,
            rotary_base,
            config.rotary_scaling_factor,
            config.original_max_position_embeddings,
            config.beta_fast,
            config.beta_slow,
            interpolation,
        )
    return RotaryEmbedding(config.qk_pos_emb_head_dim, rotary_percent, False, interpolation, rotary_base)


def _is_block_spec(spec: object) -> bool:
    """Whether ``spec`` builds a whole block (a ``TransformerBlock`` subclass) rather than its layers."""
    module = spec.module if isinstance(spec, ModuleSpec) else None
    return isinstance(module, type) and issubclass(module, TransformerBlock)


class GPTModel(LanguageModule):
    """A decoder-only language model split over tensor- and pipeline-parallel ranks.

    Built either Megatron's way, ``GPTModel(config=..., transformer_layer_spec=...,
    vocab_size=..., max_sequence_length=...)``, or in the short form
    ``GPTModel(num_layers=..., hidden_size=..., num_attention_heads=...,
    tensor_model_parallel_size=..., ...)`` where any TransformerConfig field may be given.
    Without a spec the layers come from ``get_gpt_decoder_block_spec(config)`` (MoE layers
    where ``num_moe_experts`` and ``moe_layer_freq`` put them, dense otherwise; Transformer
    Engine's linears under ``transformer_impl="transformer_engine"`` where it imports).

    ``forward(input_ids [b, s], position_ids [b, s], attention_mask, labels=None)`` returns
    logits ``[b, s, vocab/tp]`` (``[b, s, vocab]`` with ``parallel_output=False``), or the
    per-token loss ``[b, s]`` when labels are given. On a non-last pipeline stage it returns
    the hidden states ``[s, b, h]``.

    Under context parallelism (a ``cp`` group of size > 1) every ``s`` above is this rank's
    ``s/cp`` tokens, chunks r and 2cp-1-r of the sequence (``get_batch_on_this_cp_rank``):
    rotary angles are computed for the whole sequence and sliced the same way, and without
    ``position_ids`` the learned position embedding uses those global positions.
    """

    def __init__(
        self,
        config: Optional[TransformerConfig] = None,
        transformer_layer_spec: Optional[Union[ModuleSpec, TransformerBlockSubmodules]] = None,
        vocab_size: Optional[int] = None,
        max_sequence_length: Optional[int] = None,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "learned_absolute",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: Optional[float] = None,
        mtp_block_spec: Optional[ModuleSpec] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        vp_stage: Optional[int] = None,
        **config_fields: Any,
    ) -> None:
        refuse_unimplemented(
            "GPTModel",
            scatter_embedding_sequence_parallel=(scatter_embedding_sequence_parallel, True),
            mtp_block_spec=(mtp_block_spec, None),
        )
        config = _config_from_keywords(config, config_fields)
        super().__init__(config)
        groups = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
        config.check_against(groups, adopt_unset=pg_collection is None)
        self.pg_collection = groups
        self.vocab_size = vocab_size if vocab_size is not None else SHORT_FORM_VOCAB_SIZE
        self.max_sequence_length = max_sequence_length or SHORT_FORM_MAX_SEQUENCE_LENGTH
        self.pre_process, self.post_process = pre_process, post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.vp_stage = vp_stage
        # Multi-token prediction runs on the last stage, which then embeds the shifted tokens with its
        # own copy of the embedding, kept equal to the first stage's (``cross_stage_embedding_weights``).
        self.mtp_process = bool(config.mtp_num_layers) and post_process

        if pre_process or self.mtp_process:
            with initialization_rng(config.initialization_seed, "embedding"):
                self.embedding = LanguageModelEmbedding(
                    config, self.vocab_size, self.max_sequence_length, position_embedding_type, pg_collection=groups
                )
        self.rotary_pos_emb = None
        if config.multi_latent_attention:
            if rope_scaling:
                raise ValueError("rope_scaling=True (Llama 3.1's): not supported with MLA")
            self.rotary_pos_emb = _latent_attention_rotary(
                config, rotary_percent, seq_len_interpolation_factor, rotary_base
            )
        elif position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels,
                rotary_percent,
                config.rotary_interleaved,
                seq_len_interpolation_factor,
                rotary_base,
                rope_scaling=rope_scaling,
                rope_scaling_factor=rope_scaling_factor,
            )
        block_spec = transformer_layer_spec or get_gpt_decoder_block_spec(
            config, use_transformer_engine=config.transformer_impl == "transformer_engine"
        )
        if _is_block_spec(block_spec):  # e.g. MambaModel's hybrid stack
            if config.mtp_num_layers:
                raise NotImplementedError(f"mtp_num_layers={config.mtp_num_layers} with a {block_spec.module.__name__}")
            self.decoder = build_module(
                block_spec, config, pre_process=pre_process, post_process=post_process, pg_collection=groups,
                vp_stage=vp_stage,
            )  # fmt: skip
        else:
            self.decoder = TransformerBlock(
                config, block_spec, pre_process=pre_process, post_process=post_process, pg_collection=groups,
                vp_stage=vp_stage,
            )  # fmt: skip
        if post_process:
            tied = share_embeddings_and_output_weights and (pre_process or self.mtp_process)
            with initialization_rng(config.initialization_seed, "output_layer"):
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size,
                    self.vocab_size,
                    config=config,
                    init_method=config.init_method,
                    bias=False,
                    gather_output=False,
                    skip_weight_param_allocation=tied,
                    tp_group=groups.tp,
                )
            self.mark_tied_output_weight(share_embeddings_and_output_weights)
        self.mtp = None
        if config.mtp_num_layers and post_process:
            last = block_spec.layer_specs[-1] if isinstance(block_spec, TransformerBlockSubmodules) else block_spec
            self.mtp = MultiTokenPredictionBlock(config, last, pg_collection=groups)

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Activation from the previous pipeline stage (a tensor or a one-element list)."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        decoder_input: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        inference_context: Optional[Any] = None,
        packed_seq_params: Optional[Any] = None,
        extra_block_kwargs: Optional[dict] = None,
        runtime_gather_output: Optional[bool] = None,
        *,
        inference_params: Optional[Any] = None,
        loss_mask: Optional[torch.Tensor] = None,
        padding_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Megatron-core's ``GPTModel.forward`` arguments; those not implemented must keep their defaults.

        ``runtime_gather_output`` overrides ``parallel_output`` for the returned logits (None: keep
        it). ``loss_mask`` ``[b, s]`` is used only by multi-token prediction (``mtp_num_layers``), as in Megatron:
        its losses count the shifted mask's tokens; the main loss is returned per token and the loss
        function applies the mask. ``inference_params`` (megatron-core's deprecated name of
        ``inference_context``), ``extra_block_kwargs`` and ``padding_mask`` raise
        ``NotImplementedError`` unless None.

        ``packed_seq_params`` (``megatron.core.packed_seq_params.PackedSeqParams``, THD): ``input_ids``
        ``[1, t(/cp)]`` are sequences packed end to end (under CP, this rank's ``packed_cp_indices``);
        each attends to itself only and, without ``position_ids``, positions restart at every sequence
        start (rotary angles and learned positions alike). No ``attention_mask``.

        ``inference_context`` (``megatron.core.inference.StaticInferenceContext``) makes this call the
        positions from the context's ``sequence_len_offset`` on: attention caches their keys and
        values and attends over the cached ones (the caller advances the offset). With
        ``materialize_only_last_token_logits`` only the last position's logits ``[b, 1, vocab(/tp)]``
        are computed. Not supported with context parallelism.
        """
        refuse_unimplemented(
            "GPTModel.forward",
            inference_params=(inference_params, None),
            extra_block_kwargs=(extra_block_kwargs or None, None),
            padding_mask=(None if padding_mask is None else "a tensor", None),  # Megatron: MoE routing only
        )
        if inference_context is not None and self.cp_size > 1:
            raise NotImplementedError(
                f"GPTModel.forward: inference_context with context parallelism (cp={self.cp_size})"
            )
        if inference_context is not None and position_ids is None and input_ids is not None:
            position_ids = inference_context.query_positions(input_ids.shape[1], input_ids.device).expand_as(input_ids)
        packed = {}
        if packed_seq_params is not None and inference_context is not None:
            raise NotImplementedError("GPTModel.forward: packed_seq_params with an inference_context")
        if packed_seq_params is not None:
            position_ids = self._check_packed(packed_seq_params, input_ids, attention_mask, position_ids, labels)
            packed = {"packed_seq_params": packed_seq_params}
        if decoder_input is None and self.pre_process:
            decoder_input = self._embed(input_ids, position_ids)  # [s/cp(/tp), b, h]
        local = input_ids.shape[1] if input_ids is not None else decoder_input.shape[0]
        rotary = self._rotary(local, inference_context, packed_seq_params, position_ids)
        by_id = {"token_ids": input_ids} if self.config.moe_num_hash_layers else {}  # hash-routed MoE layers
        hidden = self.decoder(
            decoder_input,
            attention_mask,
            rotary_pos_emb=rotary,
            inference_context=inference_context,
            **packed,
            **by_id,
        )  # [s(/tp), b, h]
        if not self.post_process:
            return hidden
        if self.mtp is not None and labels is not None:
            hidden = self._with_mtp_losses(hidden, input_ids, position_ids, attention_mask, rotary, labels, loss_mask)
        if inference_context is not None and inference_context.materialize_only_last_token_logits:
            static = inference_context.is_static_batching()
            hidden = hidden[-1:] if static else inference_context.select_logit_rows(hidden)  # [1, b, h] | [R, 1, h]
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden, weight=weight)  # [s, b, vocab/tp]
        if labels is None:
            if (not self.parallel_output) if runtime_gather_output is None else runtime_gather_output:
                logits = gather_from_tensor_model_parallel_region(logits, group=self.pg_collection.tp)
            return logits.transpose(0, 1).contiguous()  # [b, s, vocab(/tp)]
        return self.compute_language_model_loss(labels, logits)

    def _with_mtp_losses(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor],
        rotary: Optional[torch.Tensor],
        labels: torch.Tensor,
        loss_mask: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """``hidden`` ``[s(/tp), b, h]`` unchanged, carrying the multi-token prediction losses' gradient.

        Module k's loss is the mean (or, with ``calculate_per_token_loss``, the sum) over the loss
        mask shifted k times of the cross entropy against the labels shifted k times.
        """
        c, tracker, cp = self.config, self.mtp.aux_loss_tracker, self.mtp.cp_group
        outputs = self.mtp(input_ids, position_ids, hidden, self._embed, attention_mask, rotary)
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()  # [b, s]
        for depth, mtp_hidden in enumerate(outputs, 1):
            labels, mask = roll_left(labels, cp), roll_left(mask, cp)
            logits, _ = self.output_layer(mtp_hidden, weight=weight)  # [s, b, vocab/tp]
            token_loss = self.compute_language_model_loss(labels, logits)  # [b, s]
            loss, mean = mtp_loss_terms(token_loss, mask, c.calculate_per_token_loss, cp)
            if self.training:
                tracker.add(mtp_loss_name(depth), mean, 1, c.num_layers)
            scaled = c.mtp_loss_scaling_factor / c.mtp_num_layers * loss
            hidden = MoEAuxLossAutoScaler.apply(hidden, scaled, 1.0, tracker)
        return hidden

    def _embed(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """Embedding ``[s(/cp)(/tp), b, h]`` of ``input_ids`` ``[b, s(/cp)]``; without ``position_ids`` under CP,
        at this rank's global positions."""
        if position_ids is None and self.cp_size > 1:
            position_ids = self._cp_positions(input_ids.shape[1], input_ids.device).expand_as(input_ids)
        return self.embedding(input_ids, position_ids)

    def _check_packed(
        self,
        params: PackedSeqParams,
        input_ids: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        labels: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """Refuse what packed rows do not combine with; the position ids ``[1, t(/cp)]`` (given, or each
        token's position within its sequence)."""
        if attention_mask is not None or (self.mtp is not None and labels is not None):
            raise NotImplementedError("GPTModel.forward: packed_seq_params with an attention_mask or with MTP")
        if self.config.multi_latent_attention:
            raise NotImplementedError(
                "GPTModel.forward: packed_seq_params with multi-latent attention: not supported yet"
            )
        cu = params.layout_cu_seqlens()
        total = int(cu[-1])
        if input_ids is not None and tuple(input_ids.shape) != (1, total // self.cp_size):
            raise ValueError(
                f"GPTModel.forward: packed input_ids have shape {tuple(input_ids.shape)}, expected "
                f"(1, cu_seqlens[-1] / cp) = (1, {total // self.cp_size})"
            )
        if position_ids is not None:
            return position_ids
        device = input_ids.device if input_ids is not None else cu.device
        held = torch.arange(total, device=device)  # [t] packed-row indices
        if self.cp_size > 1:
            held = packed_cp_indices(cu, self.cp_size, self.pg_collection.rank_in("cp")).to(device)  # [t/cp]
        return packed_position_ids(cu, held)[None]  # [1, t(/cp)]

    def _rotary(
        self,
        local: int,
        inference_context: Optional[Any],
        packed_seq_params: Optional[PackedSeqParams] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        """RoPE angles ``[s(/cp), 1, 1, dim]`` of this call's ``local`` positions (None without RoPE).

        With a KV cache the positions start at the context's ``sequence_len_offset``; under context
        parallelism angles are computed for the whole sequence and sliced to this rank's chunks. A packed
        row takes the angles of its ``position_ids`` ``[1, t(/cp)]`` (positions within each sequence).
        """
        if self.rotary_pos_emb is None:
            return None
        dynamic = inference_context is not None and not inference_context.is_static_batching()
        if packed_seq_params is not None or dynamic:  # a flat row of sequences, each from its own positions
            angles = self.rotary_pos_emb(int(position_ids.max()) + 1)  # [longest, 1, 1, dim]
            return angles.index_select(0, position_ids[0].to(angles.device))  # [t(/cp), 1, 1, dim]
        if inference_context is not None:
            return self.rotary_pos_emb(local, offset=inference_context.sequence_len_offset)  # [s, 1, 1, dim]
        rotary = self.rotary_pos_emb(local * self.cp_size)  # [s, 1, 1, dim], the whole sequence
        if self.cp_size > 1:
            rotary = rotary.index_select(0, self._cp_positions(local, rotary.device))  # [s/cp, 1, 1, dim]
        return rotary

    @property
    def cp_size(self) -> int:
        return self.pg_collection.size_of("cp")

    def _cp_positions(self, local_length: int, device: torch.device) -> torch.Tensor:
        """Global positions ``[s/cp]`` of this CP rank's ``local_length`` tokens."""
        return cp_chunk_positions(local_length * self.cp_size, self.cp_size, self.pg_collection.rank_in("cp"), device)
