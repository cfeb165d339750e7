"""Megatron-compatible command line: parse, validate, and turn flags into core configs.

This is the only module that reads argparse results on behalf of the library:
``parse_args`` builds the parser from the flag table (``megatron_flags.tsv``),
``validate_args`` refuses unsupported flags and fills derived defaults, and the
``*_from_args`` functions below are the one place where flags map to config
fields.
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import validation
from megatron.training.flag_status import NO_OP_FLAGS, NOT_SUPPORTED_YET, AnyOf
from megatron.training.flags_table import PROJECT_FLAGS, FlagSpec, build_parser, load_flag_specs
from megatron.training.validation import (  # noqa: F401 - re-exported for callers
    ArgumentsError,
    UnsupportedFlagError,
    vocab_size_with_padding,
)

ENTRY_POINT_TOKENIZERS = {
    "gpt": "GPT2BPETokenizer",
    "bert": "BertWordPieceLowerCase",
    "t5": "BertWordPieceLowerCase",
}


@functools.lru_cache(maxsize=1)
def flag_specs() -> List[FlagSpec]:
    """The flag table shipped with this package (read once), then this project's own flags."""
    return load_flag_specs() + list(PROJECT_FLAGS)


def build_megatron_parser(entry_point: str = "gpt") -> argparse.ArgumentParser:
    """The full parser, grouped like Megatron's, for ``pretrain_<entry_point>.py``."""
    accepted = {dest: v.values if isinstance(v, AnyOf) else (v,) for dest, v in NOT_SUPPORTED_YET.items()}
    return build_parser(
        flag_specs(),
        NO_OP_FLAGS,
        accepted,
        prog=f"pretrain_{entry_point}.py",
        description="Megatron-LM compatible arguments",
    )


def parse_args(
    argv: Optional[Sequence[str]] = None,
    extra_args_provider: Optional[Callable[[argparse.ArgumentParser], argparse.ArgumentParser]] = None,
    ignore_unknown_args: bool = False,
    defaults: Optional[Mapping[str, Any]] = None,
    entry_point: str = "gpt",
) -> argparse.Namespace:
    """Parse Megatron flags (``argv`` defaults to ``sys.argv[1:]``); no validation yet.

    ``defaults`` fill flags the user left unset (value None), as Megatron's
    ``args_defaults`` do; the entry point picks the default tokenizer.
    """
    if entry_point not in ENTRY_POINT_TOKENIZERS:
        raise ValueError(f"entry_point={entry_point!r}: must be one of {sorted(ENTRY_POINT_TOKENIZERS)}")
    parser = build_megatron_parser(entry_point)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    for dest, value in (defaults or {}).items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, value)
    if args.tokenizer_type is None:
        args.tokenizer_type = ENTRY_POINT_TOKENIZERS[entry_point]
    # Megatron keeps the launcher's view of the job on args as well.
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    return args


def validate_args(args: argparse.Namespace, world_size: Optional[int] = None) -> argparse.Namespace:
    """Check the flags once, before heavy work, and fill derived defaults (in place).

    Raises:
        UnsupportedFlagError: a flag of a feature we do not implement yet has a non-default value.
        ArgumentsError: a rule between flags is broken; the message names the flags and values.
    """
    return validation.validate_args(args, args.world_size if world_size is None else world_size, flag_specs())


# ----------------------------------------------------------------------------------
# Flags -> TransformerConfig. Every TransformerConfig field is in exactly one of the
# three tables below (a test checks it), so a new field cannot be silently skipped.
# ----------------------------------------------------------------------------------
def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (Primer's activation)."""
    return torch.pow(F.relu(x), 2)


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU with the tanh approximation used by the original GPT."""
    return F.gelu(x, approximate="tanh")


def activation_from_args(args: argparse.Namespace) -> Callable[[torch.Tensor], torch.Tensor]:
    """--swiglu (SiLU, gated), --squared-relu, --openai-gelu, else exact GeLU."""
    chosen = [name for name in ("swiglu", "squared_relu", "openai_gelu") if getattr(args, name)]
    if len(chosen) > 1:
        raise ArgumentsError(f"choose one activation, got {', '.join('--' + c.replace('_', '-') for c in chosen)}")
    if args.swiglu:
        return F.silu
    if args.squared_relu:
        return squared_relu
    if args.openai_gelu:
        return openai_gelu
    return F.gelu


# Fields whose flag destination has the same name.
TRANSFORMER_SAME_NAME = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "sequence_parallel",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "perform_initialization",
    "fp16",
    "bf16",
    "params_dtype",
    "gradient_accumulation_fusion",
    "async_tensor_model_parallel_allreduce",
    "tp_comm_overlap",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "kv_channels",
    "hidden_dropout",
    "attention_dropout",
    "fp32_residual_connection",
    "apply_residual_connection_post_layernorm",
    "layernorm_epsilon",
    "layernorm_zero_centered_gamma",
    "normalization",
    "qk_layernorm",
    "add_bias_linear",
    "add_qkv_bias",
    "rotary_interleaved",
    "init_method_std",
    "embedding_init_method_std",
    "apply_query_key_layer_scaling",
    "attention_softmax_in_fp32",
    "calculate_per_token_loss",
    "masked_softmax_fusion",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "cross_entropy_loss_fusion",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "distribute_saved_activations",
    "window_size",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor",
    "moe_token_dispatcher_type",
    "moe_layer_freq",
)

# Fields computed from one or more flags.
TRANSFORMER_DERIVED: Dict[str, Callable[[argparse.Namespace], Any]] = {
    "use_cpu_initialization": lambda a: bool(a.use_cpu_initialization),
    "gated_linear_unit": lambda a: bool(a.swiglu),
    "activation_func": activation_from_args,
    "bias_activation_fusion": lambda a: a.bias_swiglu_fusion if a.swiglu else a.bias_gelu_fusion,
    "persist_layer_norm": lambda a: not a.no_persist_layer_norm,
    "pipeline_dtype": lambda a: a.params_dtype,
    "batch_p2p_comm": lambda a: not a.overlap_p2p_comm,
    "deallocate_pipeline_outputs": lambda a: True,
    "attention_backend": lambda a: getattr(a.attention_backend, "name", a.attention_backend),
    # --init-method-xavier-uniform replaces the normal initialisers of every linear layer.
    "init_method": lambda a: torch.nn.init.xavier_uniform_ if a.init_method_xavier_uniform else None,
    "output_layer_init_method": lambda a: torch.nn.init.xavier_uniform_ if a.init_method_xavier_uniform else None,
    "num_layers_in_first_pipeline_stage": lambda a: a.decoder_first_pipeline_num_layers,
    # CPU initialization seeds each layer from (--seed, layer name): every layout starts equal.
    "initialization_seed": lambda a: a.seed if a.use_cpu_initialization else None,
    "num_layers_in_last_pipeline_stage": lambda a: a.decoder_last_pipeline_num_layers,
    "num_moe_experts": lambda a: a.num_experts,
}

# Fields no flag sets: callbacks wired by the training loop, or built by the config itself.
TRANSFORMER_NOT_FROM_FLAGS = frozenset(
    {
        "timers",
        "finalize_model_grads_func",
        "grad_scale_func",
        "no_sync_func",
        "grad_sync_func",
        "param_sync_func",
        "variable_seq_lengths",
        "embedding_init_method",
        "softmax_scale",
        "memory_efficient_layer_norm",
    }
)


def core_transformer_config_from_args(
    args: argparse.Namespace, config_class: type = TransformerConfig, **overrides: Any
) -> TransformerConfig:
    """A ``TransformerConfig`` from validated args; ``overrides`` win over the flags."""
    kwargs: Dict[str, Any] = {name: getattr(args, name) for name in TRANSFORMER_SAME_NAME}
    kwargs.update({name: derive(args) for name, derive in TRANSFORMER_DERIVED.items()})
    kwargs.update(overrides)
    return config_class(**kwargs)


# ----------------------------------------------------------------------------------
# Flags -> OptimizerParamScheduler arguments (Megatron counts schedule steps in samples).
# ----------------------------------------------------------------------------------
def optimizer_param_scheduler_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """Keyword arguments of ``OptimizerParamScheduler`` (without the optimizer).

    Iteration-based runs convert iterations to samples with the global batch
    size; the loop then calls ``step(increment=global_batch_size)``.
    """
    if args.train_iters is not None:
        gbs = args.global_batch_size
        decay = args.lr_decay_iters * gbs
        wd_steps = args.train_iters * gbs
        wsd = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
        warmup = args.lr_warmup_iters * gbs
    else:
        decay, wd_steps = args.lr_decay_samples, args.train_samples
        wsd, warmup = args.lr_wsd_decay_samples, args.lr_warmup_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return dict(
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=wd_steps,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=wsd,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )
