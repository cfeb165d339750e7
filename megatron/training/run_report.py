"""What a run says about itself at start and at each checkpoint, in Megatron's words (global rank 0 prints).

- ``print_arguments``: the ``arguments`` block (every flag's destination, dots to column 48, sorted
  case-insensitively, framed by Megatron's dashed title and end lines), so logs compare line by line.
- ``enabled_summary``: one line of what the flags switch on (precision and recipe, parallel layout,
  transformer implementation, checkpoint format).
- ``loading_line`` / ``loaded_line`` / ``saving_line`` / ``saved_line``: Megatron's checkpoint lines
  with the iteration, directory, format, layout ``[ t x/TP, p y/PP ]`` (rank 0's position) and the time taken.
"""

from __future__ import annotations

import argparse
from typing import Any, Iterable, List, Optional

import torch.distributed as dist

ARGS_TITLE = "arguments"
# Flags whose values are secrets: the dump says whether one is set, never the value.
SECRET_ARGS = frozenset({"api_key"})


def is_reporting_rank() -> bool:
    """Global rank 0 (or a process without torch.distributed)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def arguments_block(args: argparse.Namespace, title: str = ARGS_TITLE) -> List[str]:
    """Megatron's argument dump as lines: ``  name ..... value`` between the title and end lines."""
    shown = {
        name: ("<hidden>" if name in SECRET_ARGS and value is not None else value) for name, value in vars(args).items()
    }
    entries = ["  {} {} {}".format(name, "." * (48 - len(name)), value) for name, value in shown.items()]
    head = f"{'-' * 24} {title} {'-' * 24}"
    tail = f"{'-' * 20} end of {title} {'-' * 21}"
    return [head, *sorted(entries, key=str.lower), tail]


def print_arguments(args: argparse.Namespace) -> None:
    """The argument dump on rank 0."""
    if is_reporting_rank():
        print("\n".join(arguments_block(args)), flush=True)


def _precision(args: argparse.Namespace) -> str:
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    parts = [dtype + (" params, fp32 main weights" if dtype != "fp32" else "")]
    if getattr(args, "fp8", None):
        parts.append(f"FP8 {args.fp8} recipe {args.fp8_recipe}" + (" (FP8 weights)" if args.fp8_param_gather else ""))
    if getattr(args, "fp4", None):
        parts.append(f"FP4 {args.fp4} recipe {args.fp4_recipe}")
    return ", ".join(parts)


def _layout(args: argparse.Namespace) -> str:
    sizes = [
        ("TP", args.tensor_model_parallel_size),
        ("PP", args.pipeline_model_parallel_size),
        ("VP", getattr(args, "virtual_pipeline_model_parallel_size", None) or 1),
        ("CP", args.context_parallel_size),
        ("EP", args.expert_model_parallel_size),
        ("DP", args.data_parallel_size),
    ]
    extras = [
        name
        for name, on in (
            ("sequence parallel", args.sequence_parallel),
            ("distributed optimizer", args.use_distributed_optimizer),
        )
        if on
    ]
    return " ".join(f"{k}={v}" for k, v in sizes) + f" (world {args.world_size})" + "".join(f", {e}" for e in extras)


def _implementation(args: argparse.Namespace) -> str:
    from megatron.core.extensions.transformer_engine import is_te_available

    impl = getattr(args, "transformer_impl", "local")
    if impl == "transformer_engine" and not is_te_available():
        return "transformer-impl transformer_engine -> local layers (Transformer Engine does not import)"
    return f"transformer-impl {impl}"


def enabled_summary(args: argparse.Namespace) -> str:
    """One line: precision and low-precision recipe, parallel layout, layer implementation, checkpoint format."""
    parts = [_precision(args), _layout(args), _implementation(args), f"checkpoint format {args.ckpt_format}"]
    return " > enabled: " + " | ".join(parts)


def print_enabled_summary(args: argparse.Namespace) -> None:
    if is_reporting_rank():
        print(enabled_summary(args), flush=True)


# ---------------------------------------------------------------- checkpoints
def _position(layout: Optional[Iterable[Any]]) -> str:
    tp_rank, tp, pp_rank, pp = layout if layout is not None else (0, 1, 0, 1)
    return f"[ t {tp_rank + 1}/{tp}, p {pp_rank + 1}/{pp} ]"


def saving_line(iteration: int, save: str, ckpt_format: str) -> str:
    return f"saving checkpoint at iteration {iteration:7d} to {save} in {ckpt_format} format"


def saved_line(iteration: int, save: str, layout: Any, seconds: float) -> str:
    return (
        f"  successfully saved checkpoint from iteration {iteration:7d} to {save} {_position(layout)} ({seconds:.2f} s)"
    )


def save_scheduled_line(iteration: int, seconds: float) -> str:
    return f"  checkpoint of iteration {iteration:7d} handed to the background writer ({seconds:.2f} s blocked)"


def loading_line(load: str, iteration: int, ckpt_format: str) -> str:
    return f" loading checkpoint from {load} at iteration {iteration} ({ckpt_format} format)"


def loaded_line(load: str, iteration: int, layout: Any, seconds: float, what: str) -> str:
    return (
        f"  successfully loaded checkpoint from {load} {_position(layout)} at iteration {iteration}"
        f" ({what}; {seconds:.2f} s)"
    )


def report(line: str) -> None:
    """Print ``line`` on rank 0."""
    if is_reporting_rank():
        print(line, flush=True)
