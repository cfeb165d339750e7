"""Pretrain a T5 model: ``torchrun --nproc-per-node N pretrain_t5.py <Megatron flags>``.

Like ``pretrain_gpt.py``, this file only wires a model provider, a dataset provider and a forward
step into the shared loop (``megatron.training.pretrain``). The model is Megatron's T5 (encoder of
``--encoder-num-layers``, decoder of ``--decoder-num-layers`` layers with cross-attention, one shared
vocab-parallel embedding), or with ``--t5-v11`` the layers of Hugging Face's T5 v1.1 that converted
checkpoints hold. The data are span-corruption samples over a sentence-split corpus preprocessed
with a WordPiece vocabulary and ``--vocab-extra-ids`` sentinels, the same samples megatron-core
0.16's ``T5MaskedWordPieceDataset`` draws. The loss is Megatron's: summed over the decoder's
target tokens and divided by their count over the global batch (``lm loss``).
"""

from __future__ import annotations

import argparse
import dataclasses
from functools import partial
from typing import Iterator, List, Optional, Sequence

from megatron.core.activations import gelu_tanh
from megatron.core.datasets.t5_dataset import (
    MockT5MaskedWordPieceDataset,
    T5MaskedWordPieceDataset,
    T5MaskedWordPieceDatasetConfig,
)
from megatron.core.models.T5 import (
    T5Model,
    get_t5_decoder_with_local_block_spec,
    get_t5_encoder_with_local_block_spec,
    get_t5_v11_decoder_block_spec,
    get_t5_v11_encoder_block_spec,
    t5_padding_attention_masks,
)
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.flags.registry import config_from_args
from megatron.training.providers import build_datasets, language_model_kwargs, refuse_experts
from megatron.training.training import pretrain
from megatron.training.utils import masked_token_loss, next_batch_on_device

BATCH_KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask")


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    *,
    config: TransformerConfig,
    args: argparse.Namespace,
    pg_collection=None,
) -> T5Model:
    """The T5 model described by the flags (pipeline parallelism is refused by ``T5Model``)."""
    refuse_experts(config, "T5")
    if args.pipeline_model_parallel_size > 1:
        raise ValueError(
            f"not supported yet: --pipeline-model-parallel-size={args.pipeline_model_parallel_size} "
            "(T5 trains with tensor, sequence and data parallelism; Megatron-core deprecated T5 pipelining)"
        )
    v11 = args.t5_v11
    if v11:
        config = t5_v11_numerics(config)
    encoder_config = dataclasses.replace(config, num_layers=args.encoder_num_layers)
    decoder_config = dataclasses.replace(config, num_layers=args.decoder_num_layers)
    encoder_spec = get_t5_v11_encoder_block_spec if v11 else get_t5_encoder_with_local_block_spec
    decoder_spec = get_t5_v11_decoder_block_spec if v11 else get_t5_decoder_with_local_block_spec
    return T5Model(
        config=decoder_config,
        encoder_config=encoder_config,
        transformer_encoder_layer_spec=encoder_spec(args.encoder_num_layers),
        transformer_decoder_layer_spec=decoder_spec(args.decoder_num_layers),
        rotary_percent=args.rotary_percent,
        relative_attention_num_buckets=args.relative_attention_num_buckets,
        relative_attention_max_distance=args.relative_attention_max_distance,
        **language_model_kwargs(args, pre_process, post_process, pg_collection),
    )


def t5_v11_numerics(config: TransformerConfig) -> TransformerConfig:
    """``config`` with what ``--t5-v11`` means beyond Megatron's flags: gated tanh-GeLU MLPs and unscaled
    attention scores (T5 folds the 1/sqrt(d) into its initialisation). The rest of v1.1 has Megatron flags, which
    must be given: RMSNorm, no biases, untied embeddings, relative positions."""
    wrong = []
    if config.normalization != "RMSNorm":
        wrong.append(f"--normalization {config.normalization} (needs RMSNorm)")
    if config.add_bias_linear:
        wrong.append("biases on (needs --disable-bias-linear)")
    if wrong:
        raise ValueError(f"--t5-v11 with {', '.join(wrong)}")
    return dataclasses.replace(config, gated_linear_unit=True, activation_func=gelu_tanh, softmax_scale=1.0)


def train_valid_test_datasets_provider(
    num_samples: Sequence[int], *, args: argparse.Namespace, tokenizer, pg_collection=None
) -> List:
    """[train, valid, test] span-corruption datasets (synthetic sentences with ``--mock-data``)."""
    config = config_from_args(T5MaskedWordPieceDatasetConfig, args, tokenizer=tokenizer)
    return build_datasets(num_samples, args, config, T5MaskedWordPieceDataset, MockT5MaskedWordPieceDataset)


def forward_step(data_iterator: Iterator, model: T5Model):
    """Run one micro batch; returns the per-token loss and the loss function to apply to it."""
    batch = next_batch_on_device(data_iterator, BATCH_KEYS)
    enc_mask, dec_mask, enc_dec_mask = t5_padding_attention_masks(batch["enc_mask"], batch["dec_mask"])
    output = model(
        batch["text_enc"], batch["text_dec"], enc_mask, dec_mask, enc_dec_mask, lm_labels=batch["labels"]
    )  # [b, s_dec]
    return output, partial(masked_token_loss, batch["loss_mask"])


if __name__ == "__main__":
    pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_and_decoder,
        forward_step,
        entry_point="t5",
    )
