"""Pretrain a GPT model: ``torchrun --nproc-per-node N pretrain_gpt.py <Megatron flags>``.

This file only wires three things into the shared loop (``megatron.training.pretrain``):
a model provider, a dataset provider and a forward step.
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.sft_dataset import SFTDataset, SFTDatasetConfig, packed_batch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import unwrap_model
from megatron.training.flags.registry import config_from_args
from megatron.training.providers import build_datasets, language_model_kwargs
from megatron.training.theoretical_memory import report_theoretical_memory
from megatron.training.training import pretrain
from megatron.training.utils import masked_token_loss, next_batch_on_device


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    *,
    config: TransformerConfig,
    args: argparse.Namespace,
    pg_collection=None,
    report_memory: bool = True,
) -> GPTModel:
    """The GPT model (this rank's pipeline stage / virtual chunk) described by the flags.

    With --num-experts the layers are MoE where --moe-layer-freq says (one spec per layer); with
    --multi-latent-attention their attention is MLA; with --heterogeneous-layers-config-path each layer
    follows its block config (get_gpt_heterogeneous_layer_spec); with --transformer-impl transformer_engine and TE
    importable, self-attention and dense MLPs use TE's linears. Global rank 0 prints the theoretical memory per
    rank first (Megatron's report, before building)
    unless ``report_memory`` is False (the server).
    """
    if args.is_hybrid_model:
        raise ValueError("--is-hybrid-model: hybrid Mamba models are trained with pretrain_mamba.py")
    if args.spec:
        raise ValueError(
            f"--spec {' '.join(args.spec)}: not supported yet by pretrain_gpt.py (the layers follow the flags)"
        )
    if (
        report_memory
        and pre_process
        and not vp_stage
        and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0)
    ):
        report_theoretical_memory(args, device_type="cuda" if torch.cuda.is_available() else "cpu")
    # One spec per layer (MoE where --moe-layer-freq says); TE's linears where --transformer-impl
    # transformer_engine (the default) asks for them and TE imports (else the local layers, and
    # model_setup.report_transformer_impl says so once).
    use_te = config.transformer_impl == "transformer_engine"
    if config.heterogeneous_block_specs:  # --heterogeneous-layers-config-path: each layer's own block config
        spec = get_gpt_heterogeneous_layer_spec(config, use_te=use_te)
    else:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        vp_stage=vp_stage,
        **language_model_kwargs(args, pre_process, post_process, pg_collection),
    )


def dataset_config(args: argparse.Namespace, tokenizer) -> GPTDatasetConfig:
    """GPT dataset settings from the data flags (their records say which field each fills); with
    ``--sft`` the SFT dataset's, every packed sequence a multiple of 2 x CP long."""
    if getattr(args, "sft", False):
        cp = args.context_parallel_size
        if args.pipeline_model_parallel_size > 1 and args.micro_batch_size > 1:
            # A micro batch becomes one packed row [1, b*s]: stages exchange activations shaped [s, b, h].
            raise ValueError(
                f"--sft with --pipeline-model-parallel-size {args.pipeline_model_parallel_size} needs "
                f"--micro-batch-size 1 (got {args.micro_batch_size}): each micro batch is one packed row"
            )
        return config_from_args(
            SFTDatasetConfig, args, tokenizer=tokenizer, sft_pad_to_multiple_of=2 * cp if cp > 1 else 1
        )
    return config_from_args(GPTDatasetConfig, args, tokenizer=tokenizer)


def train_valid_test_datasets_provider(
    num_samples: Sequence[int], *, args: argparse.Namespace, tokenizer, pg_collection=None
) -> List:
    """[train, valid, test] GPT datasets (mock data with ``--mock-data``; conversations with ``--sft``)."""
    dataset_class = SFTDataset if args.sft else GPTDataset
    return build_datasets(num_samples, args, dataset_config(args, tokenizer), dataset_class, MockGPTDataset)


loss_func = masked_token_loss  # (loss_mask, output_tensor) -> (loss sum, token count, {"lm loss": [sum, count]})


def get_batch(data_iterator: Iterator, model: torch.nn.Module) -> Tuple[dict, Optional[PackedSeqParams]]:
    """The next micro batch, on the GPU if there is one, cut to this context-parallel rank's chunks.

    An SFT batch (rows with ``cu_seqlens``) becomes one packed row ``[1, b*s]`` and its ``PackedSeqParams``.
    """
    batch = next_batch_on_device(data_iterator)
    params = None
    if "cu_seqlens" in batch:
        batch, params = packed_batch(batch)
    groups = unwrap_model(model).pg_collection
    cp = groups.cp if groups.size_of("cp") > 1 else None
    return get_batch_on_this_cp_rank(batch, cp, params.cu_seqlens_q if params is not None else None), params


def forward_step(data_iterator: Iterator, model: GPTModel):
    """Run one micro batch; returns the model output and the loss function to apply to it."""
    batch, packed_seq_params = get_batch(data_iterator, model)
    attention_mask = batch.get("attention_mask")
    output = model(
        batch["tokens"],
        batch["position_ids"],
        attention_mask,
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],  # for multi-token prediction's losses
        packed_seq_params=packed_seq_params,
    )
    return output, partial(loss_func, batch["loss_mask"])


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step)
