"""Megatron's command-line flags as data, and the argparse parser built from them.

``megatron_flags.tsv`` (beside this file) lists every flag of Megatron-LM's
GPT/BERT/T5 entry points: group, option strings, destination, default, choices,
nargs and action kind. The table says nothing about value types, so the types
are kept here (``INT_FLAGS``, ``FLOAT_FLAGS`` ...) for the flags whose default
does not tell. Help text lives in ``HELP`` for the flags people reach for; every
other flag shows its default. A flag is one row of the table plus, when
needed, one entry here. ``PROJECT_FLAGS`` are the few flags of this project that
Megatron-LM does not have, in the same form; ``--help`` marks them.
"""

from __future__ import annotations

import argparse
import ast
import os
import shlex
import signal
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron.core.transformer.enums import AttnBackend

FLAGS_TSV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_flags.tsv")


# Defaults the table writes as reprs that are not Python literals.
SPECIAL_DEFAULTS: Dict[str, Any] = {
    "<AttnBackend.auto: 5>": AttnBackend.auto,
    "<Signals.SIGTERM: 15>": signal.SIGTERM,
}

# Store flags whose default (None, or an int standing for a float) does not give the type.
INT_FLAGS = frozenset(
    """
hierarchical_context_parallel_sizes max_seqlen_per_dp_cp_rank expert_tensor_parallel_size
microbatch_group_size_per_vp_stage num_layers mtp_num_layers hidden_size num_attention_heads ffn_hidden_size
kv_channels dsa_indexer_n_heads dsa_indexer_head_dim dsa_indexer_topk recompute_num_layers
moe_shared_expert_intermediate_size moe_ffn_hidden_size moe_router_num_groups moe_router_group_topk
moe_latent_size mrope_section mamba_num_heads encoder_num_layers decoder_num_layers window_attn_skip_freq
max_position_embeddings micro_batch_size global_batch_size rampup_batch_size
check_weight_hash_across_dp_replicas_interval train_sync_interval train_iters train_samples exit_interval
batch_size lr_decay_iters lr_decay_samples lr_wsd_decay_iters lr_wsd_decay_samples warmup save_interval
save_wgrads_interval save_dgrads_interval save_retain_interval non_persistent_save_interval ckpt_step
replication_jump decoder_first_pipeline_num_layers decoder_last_pipeline_num_layers model_parallel_size
num_layers_per_virtual_pipeline_stage num_virtual_stages_per_pipeline_rank
distributed_timeout_seconds_after_init ddp_num_buckets ddp_bucket_size suggested_communication_unit_size
eval_interval seq_length encoder_seq_length decoder_seq_length fim_split_sample vocab_size padded_vocab_size
num_experts q_lora_rank log_memory_interval iterations_to_skip empty_unused_memory_level timing_log_level
""".split()
)

FLOAT_FLAGS = frozenset(
    """
activation_func_clamp_value dsa_indexer_loss_coeff embedding_init_method_std moe_router_topk_scaling_factor
moe_z_loss_coeff moe_input_jitter_eps moe_expert_capacity_factor rotary_seq_len_interpolation_factor
exit_duration_in_mins lr_warmup_fraction start_weight_decay end_weight_decay lr decoupled_lr decoupled_min_lr
loss_scale fim_fragment_rate qk_clip_threshold initial_loss_scale loss_scale_window
""".split()
)

# Megatron parses these with ``type=bool``; we accept the usual spellings instead.
BOOL_FLAGS = frozenset({"lazy_mpu_init", "onnx_safe"})


def str_to_bool(text: str) -> bool:
    """'true'/'1'/'yes' -> True, 'false'/'0'/'no' -> False."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "y"):
        return True
    if lowered in ("0", "false", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def attn_backend(text: str) -> AttnBackend:
    """Accept 'flash' as well as 'AttnBackend.flash'."""
    try:
        return AttnBackend[text.split(".")[-1]]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown attention backend {text!r}") from None


def exit_signal(text: str) -> signal.Signals:
    return signal.Signals(int(text))


def int_tuple(text: str) -> Tuple[int, ...]:
    """'4096,0' or '(4096, 0)' -> (4096, 0): Megatron's tuple flags (``--window-size``).

    The number of entries is checked where the value is used (``TransformerConfig``).
    """
    try:
        return tuple(int(p) for p in text.strip().strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 4096,0, got {text!r}") from None


def moe_layer_freq(text: str) -> Any:
    """'2' -> 2 (every 2nd layer is MoE); '[1,0,1]' or '([1]*3+[0])*2' -> a 0/1 list (Megatron's forms)."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        pattern = _list_expression(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as err:
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {text!r}: {err}") from None
    if not isinstance(pattern, list) or any(p not in (0, 1) for p in pattern):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {text!r}: expected an integer or a list of 0/1")
    return pattern


def _list_expression(node: ast.AST) -> Any:
    """Evaluate integer/list literals joined by + and * (nothing else)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_list_expression(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _list_expression(node.left), _list_expression(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("only integers, lists, + and * are allowed")


CUSTOM_TYPES: Dict[str, Callable[[str], Any]] = {
    "attention_backend": attn_backend,
    "exit_signal": exit_signal,
    "window_size": int_tuple,
    "moe_layer_freq": moe_layer_freq,
}


@dataclass(frozen=True)
class FlagSpec:
    """One row of the flag table."""

    group: str
    option_strings: Tuple[str, ...]
    dest: str
    default: Any
    choices: Optional[Tuple[str, ...]]  # as the table prints them: str() of each choice
    nargs: Optional[str]
    action: str  # store | storetrue | storefalse

    @property
    def name(self) -> str:
        """The flag as users write it (its first option string)."""
        return self.option_strings[0]


def parse_default(text: str) -> Any:
    """The table's default column (a repr) back to a value."""
    if text in SPECIAL_DEFAULTS:
        return SPECIAL_DEFAULTS[text]
    return ast.literal_eval(text)


def load_flag_specs(path: str = FLAGS_TSV) -> List[FlagSpec]:
    """Read the flag table: '#' lines are comments, the first other line is the header."""
    specs = []
    with open(path, encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip() and not line.startswith("#")]
    for group, flags, dest, default, choices, nargs, action in rows[1:]:
        specs.append(
            FlagSpec(
                group=group,
                option_strings=tuple(flags.split()),
                dest=dest,
                default=parse_default(default),
                choices=tuple(ast.literal_eval(choices)) if choices else None,
                nargs=nargs or None,
                action=action,
            )
        )
    return specs


def value_type(spec: FlagSpec) -> Callable[[str], Any]:
    """The type that converts one command-line word of a store flag."""
    if spec.dest in CUSTOM_TYPES:
        return CUSTOM_TYPES[spec.dest]
    if spec.dest in BOOL_FLAGS:
        return str_to_bool
    if spec.dest in INT_FLAGS:
        return int
    if spec.dest in FLOAT_FLAGS:
        return float
    sample = spec.default[0] if isinstance(spec.default, list) and spec.default else spec.default
    if isinstance(sample, bool) or sample is None:
        return str
    return type(sample) if isinstance(sample, (int, float)) else str


def typed_choices(spec: FlagSpec) -> Optional[List[Any]]:
    """Choices converted to the flag's type, so that argparse compares like with like."""
    if spec.choices is None:
        return None
    if spec.dest == "attention_backend":
        return list(AttnBackend)
    # Signals compare equal to their numbers, and the table prints the numbers.
    convert = int if spec.dest == "exit_signal" else value_type(spec)
    return [convert(c) if convert in (int, float) else c for c in spec.choices]


# Help for the flags people reach for; the others show their default and status.
HELP: Dict[str, str] = {
    "tensor_model_parallel_size": "Ranks that split each layer's matrices (TP).",
    "pipeline_model_parallel_size": "Ranks that split the layer stack into stages (PP).",
    "sequence_parallel": "Split LayerNorm/dropout activations along the sequence over TP ranks.",
    "context_parallel_size": "Ranks that split the sequence of every layer (CP).",
    "num_layers_per_virtual_pipeline_stage": "Layers per model chunk for the interleaved 1F1B schedule.",
    "num_virtual_stages_per_pipeline_rank": "Model chunks per pipeline rank (interleaved 1F1B).",
    "num_layers": "Number of transformer layers (required).",
    "hidden_size": "Transformer hidden size h (required).",
    "num_attention_heads": "Number of attention heads (required).",
    "ffn_hidden_size": "MLP hidden size; default 4h, or int(4h*2/3/64)*64 with --swiglu.",
    "kv_channels": "Per-head projection size; default hidden size / heads.",
    "group_query_attention": "Use grouped-query attention with --num-query-groups key/value heads.",
    "num_query_groups": "Key/value head groups with --group-query-attention.",
    "seq_length": "Tokens per training sample.",
    "max_position_embeddings": "Size of the learned position table; default --seq-length.",
    "position_embedding_type": "Position encoding.",
    "normalization": "Normalization layer type.",
    "norm_epsilon": "Epsilon of the normalization layers.",
    "swiglu": "SwiGLU MLP (gated, SiLU activation).",
    "add_bias_linear": "No biases in linear layers.",
    "add_qkv_bias": "Bias in the QKV projection even with --disable-bias-linear.",
    "untie_embeddings_and_output_weights": "Separate input embedding and output layer weights.",
    "hidden_dropout": "Dropout on the residual branches.",
    "attention_dropout": "Dropout on attention probabilities.",
    "init_method_std": "Standard deviation of the normal weight initialisation.",
    "micro_batch_size": "Samples per microbatch per data-parallel rank (required).",
    "global_batch_size": "Samples per optimizer step over all ranks; default micro batch x DP.",
    "rampup_batch_size": "Batch-size ramp-up: START INCREMENT SAMPLES.",
    "train_iters": "Training iterations (or give --train-samples).",
    "train_samples": "Training samples (or give --train-iters).",
    "lr": "Peak learning rate.",
    "min_lr": "Learning rate at the end of decay.",
    "lr_decay_style": "Learning-rate decay after warmup.",
    "lr_warmup_fraction": "Warmup as a fraction of the decay steps (excludes --lr-warmup-iters).",
    "lr_warmup_iters": "Warmup iterations.",
    "lr_decay_iters": "Iterations over which the lr decays; default --train-iters.",
    "weight_decay": "Weight-decay coefficient.",
    "clip_grad": "Gradient clipping by global norm.",
    "fp16": "Train in fp16 with dynamic loss scaling.",
    "bf16": "Train in bf16.",
    "seed": "Random seed; each pipeline stage adds 100 x its rank.",
    "data_path": "Dataset prefixes, optionally weighted: [W1] P1 [W2] P2 ...",
    "split": "Train/valid/test proportions; default '969, 30, 1' with --data-path.",
    "mock_data": "Synthetic data instead of --data-path.",
    "tokenizer_type": "Tokenizer; default GPT2BPETokenizer (GPT) or BertWordPieceLowerCase (BERT, T5).",
    "make_vocab_size_divisible_by": "Pad the vocabulary to a multiple of this x TP.",
    "save": "Directory to save checkpoints to.",
    "load": "Directory to load checkpoints from.",
    "use_checkpoint_args": "Take the model flags (architecture, tokenizer type, dropout) from the --load checkpoint.",
    "dist_ckpt_strictness": "Keys the model and a torch_dist checkpoint do not share: the default refuses both "
    "kinds (also checkpoint tensors the model does not use); see dist_checkpointing/"
    "validation.py.",
    "verify_checkpoint": "Do not check checkpoint files against the SHA-256 sums in metadata.json on load.",
    "distributed_backend": "torch.distributed backend; default nccl with GPUs, gloo without.",
    "distributed_timeout_minutes": "Timeout of collective operations.",
    "fake_process_group": "Planning run on one process: torch.distributed's 'fake' backend, rank and world size "
    "from RANK / WORLD_SIZE; collectives move no data (used by tools/gpu_dry_run.py).",
}

NO_OP_NOTE = "[accepted; no effect here: kernel, fusion, overlap or profiling choice]"
PROJECT_NOTE = "[this project's flag; not in Megatron-LM]"

PROJECT_FLAGS: Tuple[FlagSpec, ...] = (
    FlagSpec(
        group="checkpointing",
        option_strings=("--no-verify-checkpoint",),
        dest="verify_checkpoint",
        default=True,
        choices=None,
        nargs=None,
        action="storefalse",
    ),
)


def help_text(spec: FlagSpec, no_op: bool, harmless: Optional[Tuple[Any, ...]]) -> str:
    """Help line: our text (or the dest in words), then the status note; argparse adds the default."""
    text = HELP.get(spec.dest, spec.dest.replace("_", " ").capitalize() + ".")
    if no_op:
        text += " " + NO_OP_NOTE
    elif spec in PROJECT_FLAGS:
        text += " " + PROJECT_NOTE
    elif harmless is not None:
        text += f" [not supported yet; accepted only: {', '.join(map(repr, harmless))}]"
    return text.replace("%", "%%")


def metavar(spec: FlagSpec) -> str:
    """Short value placeholder for --help: the choices as typed, or the kind of value."""
    if spec.choices:
        return "{" + ",".join(c.split(".")[-1] for c in spec.choices) + "}"
    kind = value_type(spec)
    return {int: "N", float: "X", str_to_bool: "BOOL"}.get(kind, "STR")


def add_flag(group: argparse._ArgumentGroup, spec: FlagSpec, help_line: str) -> None:
    """Add one table row to an argparse group with Megatron's option strings, dest and default."""
    kwargs: Dict[str, Any] = {"dest": spec.dest, "default": spec.default, "help": help_line}
    if spec.action == "storetrue":
        kwargs["action"] = "store_true"
    elif spec.action == "storefalse":
        kwargs["action"] = "store_false"
    elif spec.action == "store":
        kwargs["type"] = value_type(spec)
        kwargs["choices"] = typed_choices(spec)
        if spec.nargs is not None:
            kwargs["nargs"] = int(spec.nargs) if spec.nargs.isdigit() else spec.nargs
        kwargs["metavar"] = metavar(spec)
    else:
        raise ValueError(f"{spec.name}: unknown action kind {spec.action!r} in the flag table")
    group.add_argument(*spec.option_strings, **kwargs)


class FlagFileParser(argparse.ArgumentParser):
    """Reads ``@path`` arguments as flag files written like a launch script.

    Each line holds any number of shell-quoted words; ``#`` starts a comment and a
    trailing backslash is ignored, so the flag block of an existing ``torchrun ...``
    script can be pasted as is. Flags after ``@path`` on the command line win.
    """

    def convert_arg_line_to_args(self, arg_line: str) -> List[str]:
        line = arg_line.rstrip()
        if line.endswith("\\"):
            line = line[:-1]
        try:
            return shlex.split(line, comments=True)
        except ValueError as err:
            self.error(f"flags file line {arg_line.strip()!r}: {err}")


def build_parser(
    specs: List[FlagSpec],
    no_op: frozenset,
    unsupported: Dict[str, Tuple[Any, ...]],
    prog: Optional[str] = None,
    description: Optional[str] = None,
) -> argparse.ArgumentParser:
    """An argparse parser with one argument group per Megatron group, in table order.

    ``unsupported`` maps a dest to the values still accepted, for the help text.
    """
    parser = FlagFileParser(
        prog=prog,
        description=description,
        allow_abbrev=False,
        usage="%(prog)s [options | @flags-file]  (see the groups below)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        fromfile_prefix_chars="@",
    )
    groups: Dict[str, argparse._ArgumentGroup] = {}
    for spec in specs:
        if spec.group not in groups:
            groups[spec.group] = parser.add_argument_group(spec.group)
        add_flag(groups[spec.group], spec, help_text(spec, spec.dest in no_op, unsupported.get(spec.dest)))
    return parser
