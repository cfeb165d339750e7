"""Model families built from the transformer blocks (models import ``megatron.core.transformer``, never the reverse)."""

from megatron.core.models.bert import BertModel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.T5 import T5Model

__all__ = ["BertModel", "GPTModel", "T5Model"]
