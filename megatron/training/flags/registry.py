"""All flag records in one index, and what is generated from them.

``RECORDS`` maps each destination to its :class:`~.record.Flag`. From the records
and Megatron's table this module derives the statuses the parser and the
refusal use, this project's own table rows, the user-facing flag names, and the
flag -> config mapping: ``config_kwargs(Config, args)`` fills each field from the
one record that names it, or from ``NOT_A_FLAG`` (fields no flag sets, each with a
reason). ``tests/unit_tests/training/test_flag_records.py`` checks that every
table flag has a record and every field of every ``CONFIG_TARGETS`` entry exactly
one source.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDatasetConfig
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.sft_dataset import SFTDatasetConfig
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDatasetConfig
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.checkpoint_config import CheckpointConfig
from megatron.training.flags import (
    checkpointing,
    data,
    deepseek_v4,
    heterogeneous,
    hybrid,
    logging,
    model,
    moe,
    training,
)
from megatron.training.flags.record import Bounds, Fill, Flag, NoOp, NotSupportedYet, SavedArgs
from megatron.training.flags_table import FlagSpec, megatron_flag_specs
from megatron.training.theoretical_memory_params import LanguageModelShape
from megatron.training.training_config import TrainingConfig
from megatron.training.training_log import FlopsConfig, LoggingConfig

_ALL: Tuple[Flag, ...] = (
    model.RECORDS
    + hybrid.RECORDS
    + deepseek_v4.RECORDS
    + heterogeneous.RECORDS
    + moe.RECORDS
    + training.RECORDS
    + checkpointing.RECORDS
    + data.RECORDS
    + logging.RECORDS
)


def _index(records: Tuple[Flag, ...]) -> Dict[str, Flag]:
    index: Dict[str, Flag] = {}
    for record in records:
        if record.dest in index:
            raise ValueError(f"two records for the flag destination {record.dest!r}")
        index[record.dest] = record
    return index


RECORDS: Dict[str, Flag] = _index(_ALL)

# The configs built from flags; OptimizerParamScheduler stands for its keyword arguments.
CONFIG_TARGETS: Tuple[type, ...] = (
    TransformerConfig,
    HeterogeneousTransformerConfig,
    DistributedDataParallelConfig,
    OptimizerConfig,
    OptimizerParamScheduler,
    CheckpointConfig,
    LoggingConfig,
    TrainingConfig,
    FlopsConfig,
    LanguageModelShape,
    GPTDatasetConfig,
    SFTDatasetConfig,
    BERTMaskedWordPieceDatasetConfig,
    T5MaskedWordPieceDatasetConfig,
)


_UNSET = object()


@dataclass(frozen=True)
class NotAFlag:
    """A config field no flag fills: ``reason`` says why; ``value`` (if given) is what training passes."""

    reason: str
    value: Any = _UNSET


def _fixed_masking(entry_point: str, **values: Any) -> Dict[str, NotAFlag]:
    """The masking options no flag sets, at the values Megatron's ``entry_point`` fixes."""
    fields = {"max_ngram": "masking_max_ngram", "full_word": "masking_do_full_word"}
    fields.update(permutation="masking_do_permutation", longer_ngrams="masking_use_longer_ngrams")
    fields.update(geometric="masking_use_geometric_distribution")
    reason = f"no flag: Megatron's {entry_point} fixes it to this value"
    return {fields[key]: NotAFlag(reason, value) for key, value in values.items()}


_CORE_API_ONLY = NotAFlag("megatron-core's field, for library callers; its flag, if any, is a no-op or refused here")
_HOOK = NotAFlag("a callback the training loop installs after building the model")
NOT_A_FLAG: Dict[type, Dict[str, NotAFlag]] = {
    TransformerConfig: {
        "timers": NotAFlag("the training loop's Timers object, not a setting"),
        "finalize_model_grads_func": _HOOK,
        "grad_scale_func": _HOOK,
        "no_sync_func": _HOOK,
        "grad_sync_func": _HOOK,
        "param_sync_func": _HOOK,
        "variable_seq_lengths": NotAFlag("fixed-length GPT samples; the config's default"),
        "embedding_init_method": NotAFlag("built by the config from embedding_init_method_std"),
        "softmax_scale": NotAFlag("Megatron has no flag for it; 1/sqrt(kv_channels)"),
        "memory_efficient_layer_norm": NotAFlag("a Transformer-Engine kernel switch with no flag"),
        "deallocate_pipeline_outputs": NotAFlag("always on in training, as in Megatron", True),
        "original_max_position_embeddings": NotAFlag(
            "YaRN: Megatron has no flag; MLATransformerConfig's default", 4096
        ),
        "beta_fast": NotAFlag("YaRN: Megatron has no flag; MLATransformerConfig's default", 32.0),
        "beta_slow": NotAFlag("YaRN: Megatron has no flag; MLATransformerConfig's default", 1.0),
        "heterogeneous_block_specs": NotAFlag(
            "set by HeterogeneousTransformerConfig (--heterogeneous-layers-config-path / -encoded-json)"
        ),
    },
    DistributedDataParallelConfig: {
        "use_custom_fsdp": NotAFlag("Megatron's older name of use_megatron_fsdp (--use-megatron-fsdp)"),
        **{
            name: _CORE_API_ONLY
            for name in (
                "reduce_scatter_with_fp32_accumulation",
                "reuse_grad_buf_for_mxfp8_param_ag",
                "gradient_reduce_div_fusion",
                "suggested_communication_unit_size",
                "preserve_fp32_weights",
                "keep_fp8_transpose_cache",
                "nccl_ub",
                "fsdp_double_buffer",
                "outer_dp_sharding_strategy",
                "disable_symmetric_registration",
                "fsdp_manual_registration",
                "delay_wgrad_compute",
            )
        },  # fmt: skip
    },
    OptimizerConfig: {
        "timers": NotAFlag("the training loop's Timers object, not a setting"),
        **{
            name: _CORE_API_ONLY
            for name in (
                "apply_wd_to_qk_layernorm",
                "fp8_recipe",
                "reuse_grad_buf_for_mxfp8_param_ag",
                "use_precision_aware_optimizer",
                "store_param_remainders",
                "main_grads_dtype",
                "main_params_dtype",
                "exp_avg_dtype",
                "exp_avg_sq_dtype",
                "decoupled_weight_decay",
                "overlap_param_gather_with_optimizer_step",
                "use_torch_optimizer_for_cpu_offload",
                "overlap_cpu_optimizer_d2h_h2d",
                "pin_cpu_grads",
                "pin_cpu_params",
                "barrier_with_L1_time",
                "config_logger_dir",
            )
        },  # fmt: skip
    },
    OptimizerParamScheduler: {"optimizer": NotAFlag("the optimizer object the schedule drives")},
    CheckpointConfig: {},
    LoggingConfig: {
        "wandb_mode": NotAFlag("from the WANDB_MODE environment variable (offline when unset)"),
        "timers_to_log": NotAFlag("the fixed list of Megatron's logged timers"),
    },
    TrainingConfig: {},
    FlopsConfig: {},
    LanguageModelShape: {},
    BlendedMegatronDatasetConfig: {
        "tokenizer": NotAFlag("the tokenizer object the entry point built (--tokenizer-type ...)"),
        **{
            name: _CORE_API_ONLY
            for name in (
                "multiple_validation_sets",
                "full_validation",
                "allow_ambiguous_pad_tokens",
                "fast_cache_load",
                "defer_npy_index_mmap",
            )
        },  # fmt: skip
    },
    BERTMaskedWordPieceDatasetConfig: _fixed_masking(
        "pretrain_bert.py", max_ngram=3, full_word=True, permutation=False, longer_ngrams=False, geometric=False
    ),
    T5MaskedWordPieceDatasetConfig: _fixed_masking(
        "pretrain_t5.py", max_ngram=10, full_word=True, permutation=False, longer_ngrams=False, geometric=True
    ),
    GPTDatasetConfig: {
        "drop_last_partial_validation_sequence": NotAFlag("not in Megatron's flag table; the config's default"),
        "add_extra_token_to_sequence": NotAFlag("not in Megatron's flag table; the config's default"),
        **{
            name: _CORE_API_ONLY
            for name in (
                "object_storage_cache_path",
                "data_parallel_size",
                "sequence_parallel_size",
                "hybrid_context_parallel",
                "sequences_per_dataset",
                "context_parallel_size",
            )
        },  # fmt: skip
    },
    SFTDatasetConfig: {
        "sft_pad_to_multiple_of": NotAFlag("pretrain_gpt.py --sft derives it: 2 x --context-parallel-size"),
    },
}


def not_a_flag(target: type) -> Dict[str, NotAFlag]:
    """``NOT_A_FLAG`` entries of ``target`` and of its base classes (a base's entries hold for every subclass)."""
    merged: Dict[str, NotAFlag] = {}
    for cls in reversed(target.__mro__):
        merged.update(NOT_A_FLAG.get(cls, {}))
    return merged


def target_fields(target: type) -> List[str]:
    """The settable fields of a config dataclass, or the keyword parameters of a class like the scheduler."""
    if dataclasses.is_dataclass(target):
        return [f.name for f in dataclasses.fields(target) if f.init]
    return [name for name in inspect.signature(target).parameters if name != "self"]


@functools.cache
def fills_of(target: type) -> Dict[str, Tuple[str, Fill]]:
    """``{field: (flag dest, fill)}`` for ``target``; raises if two records fill one field."""
    found: Dict[str, Tuple[str, Fill]] = {}
    for record in _ALL:
        for fill in record.fills:
            if not issubclass(target, fill.target):
                continue
            name = fill.field_for(record.dest)
            if name in found:
                raise ValueError(f"{target.__name__}.{name} is filled by both {found[name][0]} and {record.dest}")
            found[name] = (record.dest, fill)
    return found


def config_kwargs(target: type, args: argparse.Namespace) -> Dict[str, Any]:
    """The keyword arguments of ``target`` that validated ``args`` determine, generated from the records."""
    kwargs = {name: fill.value(dest, args) for name, (dest, fill) in fills_of(target).items()}
    for name, entry in not_a_flag(target).items():
        if entry.value is not _UNSET:
            kwargs[name] = entry.value
    return kwargs


def transformer_config_class(args: argparse.Namespace) -> type:
    """``HeterogeneousTransformerConfig`` when a heterogeneous-layers flag is given, else ``TransformerConfig``."""
    names = ("heterogeneous_layers_config_path", "heterogeneous_layers_config_encoded_json")
    return HeterogeneousTransformerConfig if any(getattr(args, n, None) for n in names) else TransformerConfig


def config_from_args(target: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """``target(**config_kwargs(target, args))``; ``overrides`` (field names of ``target``) win over the flags."""
    unknown = sorted(set(overrides) - set(target_fields(target)))
    if unknown:
        raise TypeError(f"{target.__name__} has no field(s) {', '.join(unknown)}")
    return target(**{**config_kwargs(target, args), **overrides})


# ------------------------------------------------------------------ statuses and names
def not_supported_yet() -> Dict[str, NotSupportedYet]:
    """``{dest: status}`` of the flags refused unless harmless."""
    return {d: r.status for d, r in RECORDS.items() if isinstance(r.status, NotSupportedYet)}


def flags_with(attribute: str) -> List[str]:
    """The destinations whose records set ``attribute`` (``required``, ``data_prefixes``, ``one_value`` ...)."""
    return [d for d, r in RECORDS.items() if getattr(r, attribute)]


def architecture_flags() -> Dict[str, Callable[[SavedArgs], bool]]:
    """``{dest: when}`` of the flags that change what the weights mean, with when they matter."""
    return {d: r.architecture for d, r in RECORDS.items() if r.architecture is not None}


def checkpoint_uses(use: str) -> List[str]:
    """The destinations ``--use-checkpoint-args`` treats as ``use`` (``record.TAKEN``, ``FILLED`` or ``CHECKED``)."""
    return [d for d, r in RECORDS.items() if r.checkpoint_use() == use]


def bounded_flags() -> Dict[str, Bounds]:
    """``{dest: bounds}`` of the numeric flags whose records limit their values."""
    return {d: r.bounds for d, r in RECORDS.items() if r.bounds is not None}


def no_op_flags() -> Dict[str, NoOp]:
    """``{dest: status}`` of the flags accepted without effect."""
    return {d: r.status for d, r in RECORDS.items() if isinstance(r.status, NoOp)}


def project_specs() -> List[FlagSpec]:
    """Table rows of this project's own flags, from their records."""
    return [
        FlagSpec(
            group=r.project.group,
            option_strings=r.project.option_strings,
            dest=r.dest,
            default=r.project.default,
            choices=None,
            nargs=r.project.nargs,
            action=r.project.action,
        )
        for r in _ALL
        if r.project is not None
    ]


@functools.lru_cache(maxsize=1)
def flag_specs() -> List[FlagSpec]:
    """Megatron's table, then this project's flags: every flag the parser has."""
    return megatron_flag_specs() + project_specs()


@functools.lru_cache(maxsize=1)
def flag_names() -> Dict[str, str]:
    """``{dest: '--flag'}``: how a user writes each flag (its first option string)."""
    return {spec.dest: spec.name for spec in flag_specs()}
