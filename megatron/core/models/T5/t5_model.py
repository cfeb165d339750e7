"""T5Model: an encoder and a decoder with cross-attention over one shared vocab-parallel embedding.

Masks (Megatron-core's convention): ``forward`` takes boolean masks, True where a query may NOT
see a key, each ``[b, 1, sq, sk]`` (as Megatron's T5 dataset builds them for the local layers) or
``[b, 1, 1, sk]`` (keys only), or None (nothing blocked):

* ``encoder_attn_mask``: encoder self-attention, ``[b, 1, s_enc, s_enc]`` / ``[b, 1, 1, s_enc]``;
* ``decoder_attn_mask``: decoder self-attention; the decoder is causal whatever is given: the
  causal mask is folded into this one (None: causal only);
* ``encoder_decoder_attn_mask``: the decoder's cross-attention over the encoder output,
  ``[b, 1, s_dec, s_enc]`` / ``[b, 1, 1, s_enc]``.

``t5_padding_attention_masks`` builds the three from the dataset's padding masks ``[b, s]``
(1 = token), hiding padded keys only (Hugging Face's convention: padded queries still see the real
keys, so no softmax row is empty); ``t5_extended_attention_mask`` is Megatron-core's helper for
``[b, sq, sk]`` masks.

``position_embedding_type="relative"`` builds one ``RelativePositionEmbedding`` per stack
(bidirectional for the encoder, unidirectional for the decoder); its bias ``[1, heads, sq, sk]`` is
computed once per forward, split over TP by heads, and added to every layer's self-attention
scores (not to the cross-attention), as Megatron-core and Hugging Face T5 do.
"""

from __future__ import annotations

from typing import Any, List, Optional, Union

import torch

from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.relative_pos_embedding import RelativePositionEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module import LanguageModule
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    gather_from_tensor_model_parallel_region,
    initialization_rng,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.transformer.masks import build_attention_mask
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import refuse_unimplemented

Spec = Union[ModuleSpec, TransformerBlockSubmodules]
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "relative")


def t5_extended_attention_mask(attention_mask_list: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
    """Megatron-core's helper: each ``[b, sq, sk]`` mask -> ``[b, 1, sq, sk]`` (None stays None)."""
    return [None if mask is None else mask.unsqueeze(1) for mask in attention_mask_list]


def t5_position_ids(token_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` token ids -> ``[b, s]`` positions ``0 .. s-1``."""
    positions = torch.arange(token_ids.shape[1], dtype=torch.long, device=token_ids.device)  # [s]
    return positions.unsqueeze(0).expand_as(token_ids)


def t5_padding_attention_masks(encoder_padding: torch.Tensor, decoder_padding: torch.Tensor) -> List[torch.Tensor]:
    """Padding masks ``[b, s_enc]``, ``[b, s_dec]`` (1 = token) -> boolean masks (True = blocked):
    encoder ``[b, 1, 1, s_enc]``, decoder ``[b, 1, s_dec, s_dec]`` (padded keys and future keys),
    encoder-decoder ``[b, 1, 1, s_enc]``."""
    enc_keys = (encoder_padding < 0.5)[:, None, None, :]  # [b, 1, 1, s_enc]
    s_dec = decoder_padding.shape[1]
    causal = build_attention_mask(s_dec, s_dec, device=decoder_padding.device)  # [s_dec, s_dec]
    dec = (decoder_padding < 0.5)[:, None, None, :] | causal  # [b, 1, s_dec, s_dec]
    return [enc_keys, dec, enc_keys]


def _check_mask(name: str, mask: Optional[torch.Tensor]) -> None:
    if mask is None:
        return
    if not torch.is_tensor(mask) or mask.dtype != torch.bool or mask.dim() != 4:
        got = f"{mask.dtype} {tuple(mask.shape)}" if torch.is_tensor(mask) else type(mask).__name__
        raise ValueError(
            f"T5Model.forward: {name} must be a boolean [b, 1, sq, sk] or [b, 1, 1, sk] tensor, True = blocked "
            f"(got {got}); see t5_padding_attention_masks"
        )


class T5LMHead(MegatronModule):
    """Megatron-core's T5 LM head: a column-parallel ``output_layer``, with a bias exactly when the
    weight is tied to the word embedding (then the weight is passed to ``forward``)."""

    def __init__(
        self,
        config: TransformerConfig,
        parallel_output: bool,
        vocab_size: int,
        pre_process: bool = True,
        share_embeddings_and_output_weights: bool = False,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
    ) -> None:
        super().__init__(config)
        self.parallel_output = parallel_output
        self.output_layer = ColumnParallelLinear(
            config.hidden_size,
            vocab_size,
            config=config,
            init_method=config.init_method,
            bias=share_embeddings_and_output_weights,
            gather_output=False,  # T5Model gathers (a gathered output cannot also be sequence parallel)
            skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights,
            tp_group=tp_group,
        )

    def forward(self, hidden_states: torch.Tensor, word_embeddings_weight: Optional[torch.Tensor]) -> torch.Tensor:
        """``[s(/tp with SP), b, h]`` -> vocab-parallel logits ``[s, b, vocab/tp]``."""
        logits, _ = self.output_layer(hidden_states, weight=word_embeddings_weight)
        return logits


class T5Model(LanguageModule):
    """T5 with Megatron-core's constructor, split over tensor-parallel ranks (with or without SP).

    ``forward`` returns the per-token loss ``[b, s_dec]`` with ``lm_labels``, else the logits
    ``[b, s_dec, vocab/tp]`` (``[b, s_dec, vocab]`` with ``parallel_output=False``); with
    ``output_encoder_hidden_only`` (or ``add_decoder=False``) the encoder output
    ``[s_enc(/tp with SP), b, h]``. The loss comes from the vocab-parallel logits in fp32 whatever
    ``fp16_lm_cross_entropy`` says (as ``GPTModel``). The encoder runs on ``encoder_config``, the
    decoder on ``config``; both share ``embedding`` (word embeddings, and learned positions with
    ``learned_absolute``). ``add_encoder=False`` needs ``encoder_hidden_states`` in ``forward``.
    Pipeline parallelism (``pre_process``/``post_process`` False, or a pipeline group of size > 1:
    Megatron-core deprecated it for T5) and context parallelism are refused.
    """

    def __init__(
        self,
        config: TransformerConfig,
        encoder_config: TransformerConfig,
        transformer_encoder_layer_spec: Spec,
        transformer_decoder_layer_spec: Spec,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "learned_absolute",
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: Optional[float] = None,
        relative_attention_num_buckets: int = 32,
        relative_attention_max_distance: int = 128,
        add_encoder: bool = True,
        add_decoder: bool = True,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config)
        groups = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
        for cfg in (config, encoder_config):
            cfg.check_against(groups, adopt_unset=pg_collection is None)
        refuse_unimplemented(
            "T5Model (pipeline parallelism, which Megatron-core deprecated for T5)",
            pipeline_model_parallel_size=(groups.size_of("pp"), 1),
            pre_process=(pre_process, True),
            post_process=(post_process, True),
        )
        refuse_unimplemented("T5Model", context_parallel_size=(groups.size_of("cp"), 1))
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"position_embedding_type={position_embedding_type!r}: one of {POSITION_EMBEDDING_TYPES}")
        # add_encoder / add_decoder are read as truth values (upstream passes None for "not on this stage");
        # with neither, forward needs encoder_hidden_states and returns them (upstream's behaviour).
        self.pg_collection, self.tp_group = groups, groups.tp
        self.encoder_config = encoder_config
        self.transformer_encoder_layer_spec = transformer_encoder_layer_spec
        self.transformer_decoder_layer_spec = transformer_decoder_layer_spec
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        self.add_encoder, self.add_decoder = add_encoder, add_decoder
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy  # the loss is computed in fp32 either way
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.encoder_hidden_state: Optional[torch.Tensor] = None
        self._build_embeddings(rotary_percent, seq_len_interpolation_factor)
        if position_embedding_type == "relative":
            self._build_relative_bias(relative_attention_num_buckets, relative_attention_max_distance)
        self.encoder = self._block(encoder_config, transformer_encoder_layer_spec, "encoder") if add_encoder else None
        self.decoder = self._block(config, transformer_decoder_layer_spec, "decoder") if add_decoder else None
        with initialization_rng(config.initialization_seed, "output_layer"):
            self.lm_head = T5LMHead(
                config, parallel_output, vocab_size, pre_process, share_embeddings_and_output_weights, groups.tp
            )
        self.mark_tied_output_weight(share_embeddings_and_output_weights)

    @property
    def output_layer(self) -> ColumnParallelLinear:
        """``lm_head.output_layer``: Megatron-core's alias, a property here so that the state dict
        holds the tensors once (Megatron-core registers the module twice)."""
        return self.lm_head.output_layer

    @property
    def position_embeddings(self) -> Optional[torch.nn.Embedding]:
        """``embedding.position_embeddings`` (learned positions, else None): an alias, as ``output_layer``."""
        return self.embedding.position_embeddings

    def _build_embeddings(self, rotary_percent: float, seq_len_interpolation_factor: Optional[float]) -> None:
        config, kind = self.config, self.position_embedding_type
        with initialization_rng(config.initialization_seed, "embedding"):
            self.embedding = LanguageModelEmbedding(
                config,
                self.vocab_size,
                self.max_sequence_length,
                kind if kind != "relative" else "none",
                pg_collection=self.pg_collection,
            )
        self.rotary_pos_emb = None
        if kind == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels, rotary_percent, config.rotary_interleaved, seq_len_interpolation_factor
            )

    def _build_relative_bias(self, num_buckets: int, max_distance: int) -> None:
        """``encoder_relative_pos_emb`` (bidirectional) and ``decoder_relative_pos_emb`` (unidirectional)."""
        for name, bidirectional, cfg in (
            ("encoder_relative_pos_emb", True, self.encoder_config),
            ("decoder_relative_pos_emb", False, self.config),
        ):
            with initialization_rng(cfg.initialization_seed, name):
                table = RelativePositionEmbedding(
                    bidirectional, cfg.init_method, cfg.num_attention_heads, num_buckets, max_distance
                )
            setattr(self, name, table)

    def _block(self, config: TransformerConfig, spec: Spec, name: str) -> TransformerBlock:
        return TransformerBlock(config, spec, pg_collection=self.pg_collection, name=name)

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Pipeline input: without pipeline parallelism only None (or ``[None]``) comes here."""
        tensors = input_tensor if isinstance(input_tensor, (list, tuple)) else [input_tensor]
        if any(t is not None for t in tensors):
            raise NotImplementedError("T5Model.set_input_tensor: pipeline parallelism is not supported")

    def _relative_bias(self, table: Optional[RelativePositionEmbedding], length: int) -> Optional[torch.Tensor]:
        """This rank's heads of the self-attention bias, ``[1, heads/tp, s, s]`` (None without relative bias)."""
        if table is None:
            return None
        bias = table(length, length).permute(0, 2, 3, 1)  # [1, s, s, heads]
        # The split's backward all-gathers: every rank gets the whole table's gradient.
        bias = scatter_to_tensor_model_parallel_region(bias, group=self.tp_group)  # [1, s, s, heads/tp]
        return bias.permute(0, 3, 1, 2)  # [1, heads/tp, s, s]

    def _rotary(self, length: int) -> Optional[torch.Tensor]:
        return None if self.rotary_pos_emb is None else self.rotary_pos_emb(length)  # [s, 1, 1, dim]

    def forward(
        self,
        encoder_input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        encoder_attn_mask: Optional[torch.Tensor],
        decoder_attn_mask: Optional[torch.Tensor],
        encoder_decoder_attn_mask: Optional[torch.Tensor],
        lm_labels: Optional[torch.Tensor] = None,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        output_encoder_hidden_only: bool = False,
        inference_context: Optional[Any] = None,
        packed_seq_params: Optional[Any] = None,
        *,
        inference_params: Optional[Any] = None,
    ) -> torch.Tensor:
        """Megatron-core's arguments: token ids ``[b, s_enc]`` / ``[b, s_dec]``, the three boolean masks
        (see the module docstring), labels ``[b, s_dec]``; ``encoder_hidden_states``
        ``[s_enc(/tp), b, h]`` skips the encoder. ``inference_context`` (a ``StaticInferenceContext``, for
        generation): the decoder tokens are the positions from its ``sequence_len_offset`` on, their
        self-attention keys and values are cached, and each cross-attention layer keeps the encoder's keys and
        values from its first call (pass the same ``encoder_hidden_states`` every step); ``decoder_attn_mask``
        must then be None (causal over the cache). ``packed_seq_params`` and ``inference_params`` must be None."""
        refuse_unimplemented(
            "T5Model.forward",
            packed_seq_params=(packed_seq_params, None),
            inference_params=(inference_params, None),
        )
        if inference_context is not None and (decoder_attn_mask is not None or self.rotary_pos_emb is not None):
            raise NotImplementedError(
                "T5Model.forward: inference_context with a decoder_attn_mask or rotary positions is not supported"
            )
        for name, mask in (
            ("encoder_attn_mask", encoder_attn_mask),
            ("decoder_attn_mask", decoder_attn_mask),
            ("encoder_decoder_attn_mask", encoder_decoder_attn_mask),
        ):
            _check_mask(name, mask)
        if encoder_hidden_states is None:
            encoder_hidden_states = self._encode(encoder_input_ids, encoder_attn_mask)  # [s_enc(/tp), b, h]
        if not self.add_decoder or output_encoder_hidden_only:
            return encoder_hidden_states
        hidden = self._decode(
            decoder_input_ids, decoder_attn_mask, encoder_hidden_states, encoder_decoder_attn_mask, inference_context
        )
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits = self.lm_head(hidden, word_embeddings_weight=weight)  # [s_dec, b, vocab/tp]
        if lm_labels is not None:
            return self.compute_language_model_loss(lm_labels, logits)  # [b, s_dec]
        if not self.parallel_output:
            logits = gather_from_tensor_model_parallel_region(logits, group=self.tp_group)  # [s_dec, b, vocab]
        return logits.transpose(0, 1).contiguous()  # [b, s_dec, vocab(/tp)]

    def _encode(self, input_ids: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Token ids ``[b, s_enc]`` -> encoder output ``[s_enc(/tp with SP), b, h]``."""
        if self.encoder is None:
            if self.encoder_hidden_state is None:
                raise ValueError("T5Model built with add_encoder=False: pass encoder_hidden_states to forward")
            return self.encoder_hidden_state
        length = input_ids.shape[1]
        hidden = self.embedding(input_ids, t5_position_ids(input_ids))  # [s_enc(/tp), b, h]
        bias = self._relative_bias(getattr(self, "encoder_relative_pos_emb", None), length)
        return self.encoder(hidden, mask, rotary_pos_emb=self._rotary(length), attention_bias=bias)

    def _decode(
        self,
        input_ids: torch.Tensor,
        mask: Optional[torch.Tensor],
        context: torch.Tensor,
        context_mask: Optional[torch.Tensor],
        inference_context: Optional[Any] = None,
    ) -> torch.Tensor:
        """Decoder token ids ``[b, s_dec]`` over the encoder output -> ``[s_dec(/tp with SP), b, h]``; with an
        ``inference_context`` the tokens are the positions ``offset .. offset + s_dec - 1``."""
        length = input_ids.shape[1]
        offset = 0 if inference_context is None else inference_context.sequence_len_offset
        if mask is not None:  # the decoder is causal whatever mask comes in
            mask = mask | build_attention_mask(length, length, device=mask.device)  # [b, 1, s_dec, s_dec]
        positions = t5_position_ids(input_ids) + offset  # [b, s_dec]
        hidden = self.embedding(input_ids, positions)  # [s_dec(/tp), b, h]
        bias = self._relative_bias(getattr(self, "decoder_relative_pos_emb", None), offset + length)
        if bias is not None:
            bias = bias[:, :, offset:]  # [1, heads/tp, s_dec, offset + s_dec]: this call's queries, every key
        extra = {} if inference_context is None else {"inference_context": inference_context}
        return self.decoder(
            hidden,
            mask,
            rotary_pos_emb=self._rotary(length),
            context=context,
            context_mask=context_mask,
            attention_bias=bias,
            **extra,
        )
