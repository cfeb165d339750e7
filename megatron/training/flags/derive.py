"""Named derive functions: config field values computed from validated flags.

Each is referenced by the record of the flag it belongs to (``Fill.derive``); one
that reads several flags says which in its docstring.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Callable, List, Optional

import torch

from megatron.core.activations import activation, activation_name
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.num_microbatches_calculator import build_num_microbatches_calculator
from megatron.core.ssm.mamba_hybrid_layer_allocation import allocate_layers

Args = argparse.Namespace


def _reader(dest: str, convert: Callable[[Any], Any], kind: str) -> Callable[[Args], Any]:
    def read(args: Args) -> Any:
        return convert(getattr(args, dest))

    read.__name__ = f"{kind}_{dest}"
    return read


def as_bool(dest: str) -> Callable[[Args], bool]:
    """``bool(args.<dest>)`` (Megatron's store_true flags may hold None)."""
    return _reader(dest, bool, "bool")


def as_int(dest: str) -> Callable[[Args], int]:
    """``int(args.<dest>)``."""
    return _reader(dest, int, "int")


def zero_if_none(dest: str) -> Callable[[Args], Any]:
    """``args.<dest>``, or 0 when unset."""
    return _reader(dest, lambda v: v or 0, "zero_if_none")


def none_if_empty(dest: str) -> Callable[[Args], Any]:
    """``args.<dest>``, or None for an empty string."""
    return _reader(dest, lambda v: v or None, "none_if_empty")


# ------------------------------------------------------------------ model
def hybrid_layer_pattern(args: Args) -> Optional[str]:
    """Reads --is-hybrid-model, --num-layers, --hybrid-attention-ratio, --hybrid-mlp-ratio and
    --hybrid-override-pattern: a hybrid model's symbol per layer (the allocation ``MambaModel`` makes), else None."""
    if not args.is_hybrid_model:
        return None
    types = allocate_layers(
        args.num_layers, args.hybrid_attention_ratio, args.hybrid_mlp_ratio, args.hybrid_override_pattern
    )
    return "".join(types)


def activation_from_args(args: Args) -> Callable[[torch.Tensor], torch.Tensor]:
    """--swiglu (SiLU, gated), --squared-relu, --openai-gelu, else exact GeLU (the core's registry); one at most."""
    return activation(activation_name(args.swiglu, args.squared_relu, args.openai_gelu))


def bias_activation_fusion(args: Args) -> bool:
    """--bias-swiglu-fusion under --swiglu, else --bias-gelu-fusion."""
    return args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion


def persist_layer_norm(args: Args) -> bool:
    """Not --no-persist-layer-norm."""
    return not args.no_persist_layer_norm


def batch_p2p_comm(args: Args) -> bool:
    """Not --overlap-p2p-comm (Megatron's rule; nothing here reads the field)."""
    return not args.overlap_p2p_comm


def attention_backend_name(args: Args) -> str:
    """The ``AttnBackend`` member's name (``flash``, ``auto`` ...)."""
    return getattr(args.attention_backend, "name", args.attention_backend)


def xavier_or_default(args: Args) -> Optional[Callable[[torch.Tensor], Any]]:
    """Xavier uniform for every linear layer under --init-method-xavier-uniform, else None (the config's normal)."""
    return torch.nn.init.xavier_uniform_ if args.init_method_xavier_uniform else None


def initialization_seed(args: Args) -> Optional[int]:
    """--seed under --use-cpu-initialization (each layer seeded from (seed, name): every layout starts equal)."""
    return args.seed if args.use_cpu_initialization else None


def tied_embeddings(args: Args) -> bool:
    """Not --untie-embeddings-and-output-weights: the output layer reuses the word embedding."""
    return not args.untie_embeddings_and_output_weights


def hash_router_vocab_size(args: Args) -> Optional[int]:
    """With --moe-num-hash-layers: the hash routers' table covers the padded vocabulary (known once the
    tokenizer is built); None otherwise."""
    return getattr(args, "padded_vocab_size", None) if args.moe_num_hash_layers else None


def num_moe_layers(args: Args) -> int:
    """MoE layers among --num-layers: none without --num-experts, else as --moe-layer-freq picks them."""
    if not args.num_experts:
        return 0
    freq = args.moe_layer_freq
    return sum(freq) if isinstance(freq, list) else len(range(0, args.num_layers, freq))


# ------------------------------------------------------------------ LR schedule (counted in samples)
def global_batch_size(args: Args) -> int:
    """--global-batch-size, or --micro-batch-size x the data-parallel size when left out (Megatron's default)."""
    return args.micro_batch_size * args.data_parallel_size if args.global_batch_size is None else args.global_batch_size


def _samples(args: Args, iters: Optional[int]) -> Optional[int]:
    return None if iters is None else iters * global_batch_size(args)


def decay_steps(args: Args) -> Optional[int]:
    """--lr-decay-iters x global batch, or --lr-decay-samples; left out: the training length (iterations or samples)."""
    if args.train_iters is not None:
        return _samples(args, args.train_iters if args.lr_decay_iters is None else args.lr_decay_iters)
    return args.train_samples if args.lr_decay_samples is None else args.lr_decay_samples


def warmup_steps(args: Args) -> Any:
    """--lr-warmup-fraction of the decay steps, else --lr-warmup-iters x global batch or --lr-warmup-samples."""
    if args.lr_warmup_fraction is not None:
        return args.lr_warmup_fraction * decay_steps(args)
    if args.train_iters is not None:
        return _samples(args, args.lr_warmup_iters)
    return args.lr_warmup_samples


def start_wd(args: Args) -> float:
    """--start-weight-decay, or --weight-decay under --weight-decay-incr-style constant."""
    return args.weight_decay if args.weight_decay_incr_style == "constant" else args.start_weight_decay


def end_wd(args: Args) -> float:
    """--end-weight-decay, or --weight-decay under --weight-decay-incr-style constant."""
    return args.weight_decay if args.weight_decay_incr_style == "constant" else args.end_weight_decay


def wd_incr_steps(args: Args) -> Optional[int]:
    """The training length in samples: --train-iters x global batch, or --train-samples."""
    if args.train_iters is not None:
        return _samples(args, args.train_iters)
    return args.train_samples


def wsd_decay_steps(args: Args) -> Optional[int]:
    """--lr-wsd-decay-iters x global batch, or --lr-wsd-decay-samples."""
    if args.train_iters is not None:
        return _samples(args, args.lr_wsd_decay_iters)
    return args.lr_wsd_decay_samples


# ------------------------------------------------------------------ training length and evaluation
def total_train_iters(args: Args) -> int:
    """--train-iters, or the iterations --train-samples takes (--rampup-batch-size included); 0 with neither.

    Reads --global-batch-size, --micro-batch-size, --decrease-batch-size-if-needed and the data-parallel size.
    """
    if args.train_iters is not None:
        return args.train_iters
    if args.train_samples is None:
        return 0  # --skip-train without a length: nothing to train
    if args.rampup_batch_size is None:
        return math.ceil(args.train_samples / global_batch_size(args))
    calculator = build_num_microbatches_calculator(
        0,
        args.rampup_batch_size,
        global_batch_size(args),
        args.micro_batch_size,
        args.data_parallel_size,
        args.decrease_batch_size_if_needed,
    )
    consumed = iterations = 0
    while consumed < args.train_samples:
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    return iterations


MEGATRON_EVAL_INTERVAL = 1000  # Megatron's argparse default; the flag table's column says None


def eval_interval(args: Args) -> int:
    """--eval-interval, or Megatron's 1000 when left out (a given one is positive: its record's bounds).

    The interval sizes the validation split (``train_iters // eval_interval + 1`` evaluations).
    """
    return MEGATRON_EVAL_INTERVAL if args.eval_interval is None else args.eval_interval


# ------------------------------------------------------------------ data
def _per_split(args: Args) -> List[Any]:
    return [args.train_data_path, args.valid_data_path, args.test_data_path]


def _uses_per_split(args: Args) -> bool:
    return any(p is not None for p in _per_split(args))


def blend(args: Args) -> Any:
    """--data-path as (prefixes, weights), unless --train/valid/test-data-path name the splits."""
    return None if _uses_per_split(args) else get_blend_from_list(args.data_path)


def blend_per_split(args: Args) -> Any:
    """One blend per split from --train-data-path, --valid-data-path, --test-data-path (or None)."""
    return [get_blend_from_list(p) for p in _per_split(args)] if _uses_per_split(args) else None


DEFAULT_SPLIT = "969, 30, 1"  # Megatron's --split for a single --data-path


def split(args: Args) -> Optional[str]:
    """--split for a single --data-path (Megatron's ``969, 30, 1`` when left out); None with per-split paths."""
    if _uses_per_split(args):
        return None
    return DEFAULT_SPLIT if args.split is None and args.data_path else args.split


def create_attention_mask(args: Args) -> bool:
    """A per-sample mask only with --reset-attention-mask; else the model builds the plain causal mask."""
    return bool(args.reset_attention_mask)


# ------------------------------------------------------------------ logging
def wandb_save_dir(args: Args) -> str:
    """--wandb-save-dir, else ``<--save>/wandb`` as in Megatron, else ``./wandb``."""
    return args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else "wandb")
