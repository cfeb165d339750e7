"""Pretrain a hybrid Mamba model: ``torchrun --nproc-per-node N pretrain_mamba.py <Megatron flags>``.

The layers follow ``--hybrid-override-pattern`` (``M`` Mamba, ``*`` attention, ``-`` MLP, ``E`` MoE) or
``--hybrid-attention-ratio`` / ``--hybrid-mlp-ratio``; the Mamba mixers' sizes come from ``--mamba-*``.
Data, batches, forward step and loss are ``pretrain_gpt.py``'s (mock or real GPT datasets).
"""

from __future__ import annotations

import argparse
from typing import Optional

import torch

from megatron.core.models.mamba import MambaModel
from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.spec_utils import import_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.providers import language_model_kwargs
from megatron.training.theoretical_memory import report_theoretical_memory
from megatron.training.training import pretrain
from pretrain_gpt import forward_step, train_valid_test_datasets_provider


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    *,
    config: TransformerConfig,
    args: argparse.Namespace,
    pg_collection=None,
    report_memory: bool = True,
) -> MambaModel:
    """The hybrid model (this rank's pipeline stage) described by the flags; global rank 0 first prints the
    theoretical memory per rank unless ``report_memory`` is False."""
    if vp_stage is not None:
        raise ValueError(
            "--num-layers-per-virtual-pipeline-stage: not supported for hybrid Mamba models (nor in Megatron)"
        )
    if config.context_parallel_size > 1:
        raise ValueError(
            f"--context-parallel-size {config.context_parallel_size}: not supported yet for hybrid Mamba "
            "models (the Mamba mixers' scan is not split over the sequence here)"
        )
    stack_spec = mamba_stack_spec
    if args.spec:
        if len(args.spec) != 2:
            raise ValueError(f"--spec {' '.join(args.spec)}: give a module path and a name")
        stack_spec = import_module(tuple(args.spec))
    if report_memory and pre_process and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        report_theoretical_memory(args, device_type="cuda" if torch.cuda.is_available() else "cpu")
    return MambaModel(
        config=config,
        mamba_stack_spec=stack_spec,
        hybrid_attention_ratio=args.hybrid_attention_ratio,
        hybrid_mlp_ratio=args.hybrid_mlp_ratio,
        hybrid_override_pattern=args.hybrid_override_pattern,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        **language_model_kwargs(args, pre_process, post_process, pg_collection),
    )


if __name__ == "__main__":
    pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        entry_point="mamba",
    )
