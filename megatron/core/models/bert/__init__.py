"""BERT: ``BertModel``, its layer specs and the Hugging Face state-dict mapping."""

from megatron.core.models.bert.bert_layer_specs import (
    bert_layer_local_spec,
    bert_layer_post_ln_spec,
    get_bert_layer_with_transformer_engine_spec,
)
from megatron.core.models.bert.bert_model import BertModel

__all__ = [
    "BertModel",
    "bert_layer_local_spec",
    "bert_layer_post_ln_spec",
    "get_bert_layer_with_transformer_engine_spec",
]
