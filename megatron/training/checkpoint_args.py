"""Which saved flags describe the model, how a run must agree with them, and taking them over.

A checkpoint's ``common.json`` (or legacy ``.pt``) holds the run's flags as plain data
(``args_to_plain_data``). ``check_checkpoint_args`` compares every architecture flag the
checkpoint holds with this run's: a checkpoint of another architecture whose tensors
happen to have the same shapes (other head count, RMSNorm for LayerNorm, post-LN
residuals, RoPE over a learned-position model) would otherwise load and train silently.
``apply_checkpoint_args`` is ``--use-checkpoint-args``: the checkpoint's model flags replace
the command line's before validation, as Megatron's ``load_args_from_checkpoint`` does.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from megatron.core.dist_checkpointing import CheckpointingError
from megatron.training.flags_table import megatron_flag_specs as flag_specs

logger = logging.getLogger(__name__)

PlainArgs = Mapping[str, Any]


def _rope(saved: PlainArgs) -> bool:
    return saved.get("position_embedding_type") == "rope"


def _learned_positions(saved: PlainArgs) -> bool:
    return saved.get("position_embedding_type") == "learned_absolute"


def _moe(saved: PlainArgs) -> bool:
    return saved.get("num_experts") is not None


def _always(saved: PlainArgs) -> bool:
    return True


# Flag destination -> when it matters, judged from the checkpoint's own flags. These are all
# the flags pretrain_gpt.py's model is built from (TransformerConfig fields and GPTModel
# arguments) that change what the weights mean; dropout, precision, fusion, recomputation
# and parallel layout do not and may change on resume.
ARCHITECTURE_ARGS: Dict[str, Callable[[PlainArgs], bool]] = {
    **{
        dest: _always
        for dest in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "position_embedding_type",
            "normalization",
            "layernorm_epsilon",
            "layernorm_zero_centered_gamma",
            "apply_residual_connection_post_layernorm",
            "qk_layernorm",
            "swiglu",
            "squared_relu",
            "openai_gelu",
            "add_bias_linear",
            "add_qkv_bias",
            "untie_embeddings_and_output_weights",
            "window_size",
            "padded_vocab_size",
            "tokenizer_type",
            "num_experts",
        )
    },
    "max_position_embeddings": _learned_positions,  # the size of the learned table; RoPE has no table
    **{
        dest: _rope
        for dest in (
            "rotary_percent",
            "rotary_base",
            "rotary_interleaved",
            "rotary_seq_len_interpolation_factor",
            "use_rope_scaling",
            "rope_scaling_factor",
        )
    },
    **{
        dest: _moe
        for dest in (
            "moe_router_topk",
            "moe_ffn_hidden_size",
            "moe_layer_freq",
            "moe_router_pre_softmax",
            "moe_router_topk_scaling_factor",
            "moe_router_score_function",
            "moe_router_num_groups",
            "moe_router_group_topk",
            "moe_router_enable_expert_bias",
        )
    },
}

# Derived, not a flag of its own: name what sets it.
_LABELS = {
    "padded_vocab_size": "padded vocabulary size (tokenizer vocabulary, --make-vocab-size-divisible-by, "
    "--tensor-model-parallel-size)"
}

# --use-checkpoint-args also takes these (Megatron takes them too): the flags validation folds into
# the architecture ones, the padding rule, and dropout. ``padded_vocab_size`` is recomputed
# from the tokenizer, so it is only checked.
_ALSO_TAKEN = (
    "group_query_attention",
    "use_rotary_position_embeddings",
    "add_position_embedding",
    "make_vocab_size_divisible_by",
    "hidden_dropout",
    "attention_dropout",
    "tiktoken_pattern",
)
TAKEN_FROM_CHECKPOINT = tuple(d for d in ARCHITECTURE_ARGS if d != "padded_vocab_size") + _ALSO_TAKEN
# Taken only when the command line leaves them unset (Megatron's rule for these).
FILLED_FROM_CHECKPOINT = ("seq_length",)
# Plain data (JSON) back to the parsed type.
_FROM_PLAIN: Dict[str, Callable[[Any], Any]] = {"window_size": lambda v: None if v is None else tuple(v)}


def flag_label(dest: str) -> str:
    """How a user writes the flag of ``dest`` (``--disable-bias-linear (add_bias_linear)`` for negated ones)."""
    if dest in _LABELS:
        return _LABELS[dest]
    for spec in flag_specs():
        if spec.dest == dest:
            return spec.name if spec.name[2:].replace("-", "_") == dest else f"{spec.name} ({dest})"
    return dest


def _table_default(dest: str) -> Any:
    return next((spec.default for spec in flag_specs() if spec.dest == dest), None)


def architecture_mismatches(saved: PlainArgs, run: PlainArgs) -> List[Tuple[str, Any, Any]]:
    """(dest, checkpoint value, run value) for every architecture flag both hold and disagree on."""
    out = []
    for dest, matters in ARCHITECTURE_ARGS.items():
        if dest in saved and dest in run and matters(saved) and saved[dest] != run[dest]:
            out.append((dest, saved[dest], run[dest]))
    return out


def check_checkpoint_args(saved: Optional[PlainArgs], run: PlainArgs, where: str) -> None:
    """Raise CheckpointingError naming every architecture flag on which ``run`` and ``saved`` differ.

    ``saved`` is the checkpoint's ``args`` (None or missing flags: nothing to compare, as for
    converted checkpoints that store the model flags only); both are plain data.
    """
    if saved is None:
        logger.warning("checkpoint %s holds no arguments: its architecture cannot be checked", where)
        return
    if not isinstance(saved, Mapping):
        raise CheckpointingError(f"checkpoint {where}: 'args' is a {type(saved).__name__}, expected a JSON object")
    found = architecture_mismatches(saved, run)
    if not found:
        return
    lines = [f"  {flag_label(d)}: checkpoint {s!r}, this run {r!r}" for d, s, r in found]
    hint = (
        "--use-checkpoint-args is set: the rest comes from the tokenizer or the parallel layout"
        if run.get("use_checkpoint_args")
        else "give the checkpoint's values, or --use-checkpoint-args to take the model flags from the checkpoint"
    )
    raise CheckpointingError(
        f"checkpoint {where} was saved with another model architecture than this run:\n"
        + "\n".join(lines)
        + f"\n{hint}"
    )


def apply_checkpoint_args(args: argparse.Namespace, saved: PlainArgs, where: str) -> List[str]:
    """Set the model flags of ``args`` from the checkpoint's ``saved`` flags; returns the dests changed.

    ``TAKEN_FROM_CHECKPOINT`` flags replace the command line's (a different command-line
    value is logged as overridden); ``FILLED_FROM_CHECKPOINT`` ones only fill unset flags.
    """
    changed = []
    for dest in TAKEN_FROM_CHECKPOINT + FILLED_FROM_CHECKPOINT:
        if dest not in saved or (dest in FILLED_FROM_CHECKPOINT and getattr(args, dest, None) is not None):
            continue
        value = _FROM_PLAIN.get(dest, lambda v: v)(saved[dest])
        current = getattr(args, dest, None)
        if current == value:
            continue
        if args.rank == 0:
            given = current != _table_default(dest)
            logger.log(
                logging.WARNING if given else logging.INFO,
                "--use-checkpoint-args: %s=%r from %s replaces %s %r",
                flag_label(dest),
                value,
                where,
                "the command line's" if given else "the default",
                current,
            )
        setattr(args, dest, value)
        changed.append(dest)
    return changed
