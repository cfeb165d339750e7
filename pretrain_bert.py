"""Pretrain a BERT model: ``torchrun --nproc-per-node N pretrain_bert.py <Megatron flags>``.

Like ``pretrain_gpt.py``, this file only wires a model provider, a dataset provider and a forward
step into the shared loop (``megatron.training.pretrain``). The model is Megatron's pre-LN BERT
(``bert_layer_local_spec``), or with ``--bert-post-layernorm`` the original post-LN BERT that
Hugging Face checkpoints hold (``bert_layer_post_ln_spec``). The data are masked-LM samples over a
sentence-split corpus (``tools/preprocess_data.py --split-sentences``), the same samples
megatron-core 0.16's ``BERTMaskedWordPieceDataset`` draws for the same files, config and seed.
The loss is Megatron's: the masked-LM loss averaged over the micro batch's masked tokens, plus the
sentence-order loss of the binary head (``--bert-no-binary-head`` drops the head and token types).
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Iterator, List, Optional, Sequence

import torch
import torch.nn.functional as F

from megatron.core.datasets.bert_dataset import (
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
    MockBERTMaskedWordPieceDataset,
)
from megatron.core.models.bert import BertModel
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec, bert_layer_post_ln_spec
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import unwrap_model
from megatron.training.flags.registry import config_from_args
from megatron.training.providers import build_datasets, language_model_kwargs, refuse_experts
from megatron.training.training import pretrain
from megatron.training.utils import next_batch_on_device

BATCH_KEYS = ("text", "types", "labels", "is_random", "loss_mask", "padding_mask")


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    *,
    config: TransformerConfig,
    args: argparse.Namespace,
    pg_collection=None,
) -> BertModel:
    """The BERT model (this rank's pipeline stage / virtual chunk) described by the flags."""
    if config.calculate_per_token_loss:
        raise ValueError("--calculate-per-token-loss: pretrain_bert.py averages the loss per micro batch, as Megatron")
    refuse_experts(config, "BERT")
    return BertModel(
        config=config,
        num_tokentypes=2 if args.bert_binary_head else 0,
        transformer_layer_spec=bert_layer_post_ln_spec if args.bert_post_layernorm else bert_layer_local_spec,
        add_binary_head=args.bert_binary_head,
        vp_stage=vp_stage,
        **language_model_kwargs(args, pre_process, post_process, pg_collection),
    )


def train_valid_test_datasets_provider(
    num_samples: Sequence[int], *, args: argparse.Namespace, tokenizer, pg_collection=None
) -> List:
    """[train, valid, test] masked-LM datasets (synthetic sentences with ``--mock-data``)."""
    # The masking options without a flag take the values Megatron's pretrain_bert.py fixes (registry.NOT_A_FLAG).
    config = config_from_args(BERTMaskedWordPieceDatasetConfig, args, tokenizer=tokenizer)
    return build_datasets(num_samples, args, config, BERTMaskedWordPieceDataset, MockBERTMaskedWordPieceDataset)


def loss_func(loss_mask: torch.Tensor, sentence_order: torch.Tensor, output_tensor):
    """Masked-LM loss averaged over the masked tokens, plus the binary head's cross entropy.

    Returns Megatron's pair (loss, report): ``lm loss`` and, with the binary head, ``sop loss``.
    """
    lm_losses, binary_logits = output_tensor  # [b, s], [b, 2] or None
    mask = loss_mask.float().view(-1)
    lm_loss = torch.sum(lm_losses.float().view(-1) * mask) / mask.sum().clamp(min=1)
    if binary_logits is None:
        return lm_loss, {"lm loss": lm_loss.detach()}
    sop_loss = F.cross_entropy(binary_logits.view(-1, 2).float(), sentence_order.view(-1), ignore_index=-1)
    return lm_loss + sop_loss, {"lm loss": lm_loss.detach(), "sop loss": sop_loss.detach()}


def forward_step(data_iterator: Iterator, model: BertModel):
    """Run one micro batch; returns the model output and the loss function to apply to it.

    Token types go in only with the binary head (the model then has token-type embeddings).
    """
    batch = next_batch_on_device(data_iterator, BATCH_KEYS)
    types = batch["types"] if unwrap_model(model).add_binary_head else None
    output = model(batch["text"], batch["padding_mask"], tokentype_ids=types, lm_labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"], batch["is_random"])


if __name__ == "__main__":
    pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        entry_point="bert",
    )
