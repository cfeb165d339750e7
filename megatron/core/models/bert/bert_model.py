"""BertModel: embeddings (word, position, token type), a bidirectional encoder, the masked-LM and NSP heads.

Masks: ``forward`` takes the dataset's padding mask ``[b, s]`` (1 = real token, 0 = padding) and
turns it into our attention's boolean form, True where attention is NOT allowed, of shape
``[b, 1, 1, s]``: padded keys are hidden from every query. Padded queries still see the real keys
(as in Hugging Face), so no softmax row is empty; their outputs are not used by the loss. The
layers' attention is ``AttnMaskType.padding``: no causal mask.

Pre-LN or post-LN comes from the layer spec (``bert_layer_specs.is_post_ln_spec``): Megatron's
pre-LN layers get a final LayerNorm after the encoder; the post-LN layers of the original BERT get
a LayerNorm on the embedding sum instead (``embedding.embedding_layernorm``) and no final norm.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from megatron.core.models.bert.bert_heads import BertLMHead, Pooler, replicated_linear
from megatron.core.models.bert.bert_layer_specs import is_post_ln_spec
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module import LanguageModule
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    initialization_rng,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import refuse_unimplemented


def bert_extended_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Padding mask ``[b, s]`` (1 = token, 0 = padding) -> boolean ``[b, 1, 1, s]``, True = blocked."""
    return attention_mask.unsqueeze(1).unsqueeze(1) < 0.5  # [b, 1, 1, s]


class BertModel(LanguageModule):
    """BERT split over tensor- and pipeline-parallel ranks, with Megatron-core's constructor.

    ``forward(input_ids [b, s], attention_mask [b, s], tokentype_ids=None, lm_labels=None)`` returns
    on the last stage ``(lm_loss [b, s], binary_logits [b, 2])`` with labels, else
    ``(logits [b, s, vocab/tp], binary_logits)`` (``[b, s, vocab]`` with ``parallel_output=False``);
    ``binary_logits`` is None without ``add_binary_head``. With ``return_embeddings`` it returns
    instead the fp32 mean ``[b, h]`` of each sequence's hidden states between its first and last
    real token (both excluded). Other stages return the hidden states ``[s(/tp with SP), b, h]``.
    The loss is always computed from the vocab-parallel logits (``parallel_output`` only decides
    whether returned logits are gathered), in fp32 whatever ``fp16_lm_cross_entropy`` says, as in
    ``GPTModel``. Context parallelism is refused.
    """

    def __init__(
        self,
        config: TransformerConfig,
        num_tokentypes: int,
        transformer_layer_spec: Union[ModuleSpec, TransformerBlockSubmodules],
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
        add_binary_head: bool = True,
        return_embeddings: bool = False,
        vp_stage: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config)
        groups = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
        config.check_against(groups, adopt_unset=pg_collection is None)
        refuse_unimplemented("BertModel", context_parallel_size=(groups.size_of("cp"), 1))
        if return_embeddings and not (post_process and add_binary_head):
            raise ValueError("BertModel: return_embeddings needs post_process=True and add_binary_head=True")
        self.pg_collection = groups
        self.transformer_layer_spec = transformer_layer_spec
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy  # the loss is computed in fp32 either way
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.add_binary_head, self.return_embeddings = add_binary_head, return_embeddings
        self.vp_stage = vp_stage
        self.post_ln = is_post_ln_spec(transformer_layer_spec)

        if pre_process:
            with initialization_rng(config.initialization_seed, "embedding"):
                self.embedding = LanguageModelEmbedding(
                    config,
                    vocab_size,
                    max_sequence_length,
                    position_embedding_type,
                    num_tokentypes,
                    pg_collection=groups,
                    embedding_layernorm=self.post_ln,
                )
        self.rotary_pos_emb = None
        if position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels, rotary_percent, config.rotary_interleaved, seq_len_interpolation_factor
            )
        self.encoder = TransformerBlock(
            config,
            transformer_layer_spec,
            post_layer_norm=not self.post_ln,
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=groups,
            vp_stage=vp_stage,
        )
        if post_process:
            self._build_heads()

    def _build_heads(self) -> None:
        """``lm_head``, ``output_layer`` and, with ``add_binary_head``, ``pooler`` and ``binary_head``."""
        config, h = self.config, self.config.hidden_size
        with initialization_rng(config.initialization_seed, "lm_head"):
            self.lm_head = BertLMHead(h, config)
        with initialization_rng(config.initialization_seed, "output_layer"):
            self.output_layer = ColumnParallelLinear(
                h,
                self.vocab_size,
                config=config,
                init_method=config.init_method,
                bias=True,
                gather_output=False,
                skip_weight_param_allocation=self.pre_process and self.share_embeddings_and_output_weights,
                tp_group=self.pg_collection.tp,
            )
        self.mark_tied_output_weight(self.share_embeddings_and_output_weights)
        self.binary_head = None
        if self.add_binary_head:
            with initialization_rng(config.initialization_seed, "binary_head"):
                self.binary_head = replicated_linear(h, 2, config)
            with initialization_rng(config.initialization_seed, "pooler"):
                self.pooler = Pooler(h, config, config.sequence_parallel, tp_group=self.pg_collection.tp)

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Activation from the previous pipeline stage (a tensor or a one-element list)."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.encoder.set_input_tensor(input_tensor)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        tokentype_ids: Optional[torch.Tensor] = None,
        lm_labels: Optional[torch.Tensor] = None,
        inference_context: Optional[Any] = None,
        *,
        inference_params: Optional[Any] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """Megatron-core's arguments; ``inference_context`` / ``inference_params`` must be None.

        ``attention_mask`` None means no padding. ``tokentype_ids [b, s]`` is required exactly when
        the model was built with ``num_tokentypes > 0``.
        """
        refuse_unimplemented(
            "BertModel.forward",
            inference_context=(inference_context, None),
            inference_params=(inference_params, None),
        )
        mask = None if attention_mask is None else bert_extended_attention_mask(attention_mask)  # [b, 1, 1, s]
        encoder_input = None
        if self.pre_process:
            encoder_input = self.embedding(input_ids, None, tokentype_ids)  # [s(/tp), b, h]
        rotary = None
        if self.rotary_pos_emb is not None:
            length = input_ids.shape[1] if input_ids is not None else attention_mask.shape[1]
            rotary = self.rotary_pos_emb(length)  # [s, 1, 1, dim]
        hidden = self.encoder(encoder_input, mask, rotary_pos_emb=rotary)  # [s(/tp), b, h]
        if not self.post_process:
            return hidden
        if self.return_embeddings:
            return self._mean_embeddings(hidden, attention_mask)
        return self._heads(hidden, lm_labels)

    def _heads(
        self, hidden: torch.Tensor, lm_labels: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(loss ``[b, s]`` or logits ``[b, s, vocab(/tp)]``, binary logits ``[b, 2]`` or None)."""
        binary_logits = None
        if self.binary_head is not None:
            binary_logits = self.binary_head(self.pooler(hidden, 0))  # [b, 2]
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(self.lm_head(hidden), weight=weight)  # [s, b, vocab/tp]
        if lm_labels is not None:
            return self.compute_language_model_loss(lm_labels, logits), binary_logits
        if not self.parallel_output:
            logits = gather_from_tensor_model_parallel_region(logits, group=self.pg_collection.tp)  # [s, b, vocab]
        return logits.transpose(0, 1).contiguous(), binary_logits

    def _mean_embeddings(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """fp32 ``[b, h]``: mean over positions ``1 .. length-2`` (between [CLS] and the last token)."""
        if self.config.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=self.pg_collection.tp
            )  # [s, b, h]
        lengths = attention_mask.sum(dim=1)  # [b]
        positions = torch.arange(hidden.shape[0], device=hidden.device)  # [s]
        keep = (positions[None, :] >= 1) & (positions[None, :] < lengths[:, None] - 1)  # [b, s]
        summed = (hidden.transpose(0, 1).float() * keep[..., None]).sum(dim=1)  # [b, h]
        return summed / keep.sum(dim=1, keepdim=True)  # [b, h]
