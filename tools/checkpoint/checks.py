"""What the converter checks before it trusts a Hugging Face directory or a checkpoint's flags, for every
family at once (GPT-2, the Llama family, BERT, T5): one checker, each refusal a ``ConversionError`` naming
the file and the field, flag or tensor.

- ``check_hf_config``: the size fields of ``config.json`` are integers >= 1 (not strings, not booleans) and
  its epsilons / RoPE bases finite positive numbers, before any family reads them.
- ``head_size``: the hidden size is a multiple of the head count where the head size is derived from them.
- ``check_model_args``: the model flags (from a HF config, or from a checkpoint's ``common.json`` on export)
  within their flag records' bounds (``megatron/training/flags``), heads a multiple of the query groups,
  and a model whose fp32 weights fit in this machine's available memory (refused before allocating).
- ``shard_paths``: shard files named by ``model.safetensors.index.json`` stay inside the model directory.
- ``check_hf_tensors``: dtypes and values. Cast rule: float32, float16, bfloat16 and float64 tensors are
  cast to our float32 parameters (exact for the 16-bit types, float64 rounded to nearest); integer, bool,
  complex and 8-bit float tensors (quantized weights need their scales) are refused, except the integer
  index tables ``INDEX_TABLES``. NaN or infinite
  values are refused unless ``--allow-nonfinite``.
- ``ReadTracker`` + ``check_all_read``: a tensor the family's mapping never reads (a layer beyond the
  config's count, a stray name) is refused by name; a tensor the mapping needs and the file lacks is named
  by the mapping's ``KeyError``.
- ``check_shapes``: every tensor has the shape the config implies, named with both shapes.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

import torch

from megatron.training.flags.registry import bounded_flags
from tools.checkpoint.errors import ConversionError

# Size fields of the supported config classes (GPT2Config, LlamaConfig and its relatives, DeepseekV3Config/V32/V4,
# BertConfig, T5Config): integers >= 1 where present; None only for the optional ones.
HF_SIZE_FIELDS = (
    "vocab_size",
    "n_layer",
    "n_embd",
    "n_head",
    "n_positions",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
    "num_experts_per_tok",
    "d_model",
    "d_ff",
    "d_kv",
    "num_heads",
    "num_layers",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
)
HF_OPTIONAL_SIZE_FIELDS = (
    "n_inner",
    "head_dim",
    "num_key_value_heads",
    "num_decoder_layers",
    "num_experts",
    "num_local_experts",
    "moe_intermediate_size",
    "q_lora_rank",
    "sliding_window",
    "decoder_sparse_step",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "o_groups",  # DeepSeek-V4
    "o_lora_rank",
    "hc_mult",
    "hc_sinkhorn_iters",
)
HF_POSITIVE_FLOATS = ("layer_norm_epsilon", "layer_norm_eps", "rms_norm_eps", "rope_theta")
HF_POSITIVE_FLOATS += ("compress_rope_theta", "hc_eps")  # DeepSeek-V4
# Model flags every family needs as integers >= 1 (the rest are checked by their records' bounds if present).
REQUIRED_SIZES = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "padded_vocab_size")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_TABLES = (".tid2eid",)  # DeepSeek-V4's hash routing: token id -> experts (range checked by deepseek_v4.py)
INDEX_DTYPES = (torch.int64, torch.int32)
BYTES_PER_PARAMETER = 4  # the converter builds the model in float32


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_hf_config(hf: Mapping[str, Any], where: str) -> None:
    """Refuse a ``config.json`` whose size fields are not integers >= 1, or whose epsilons are not positive."""
    for field in HF_SIZE_FIELDS + HF_OPTIONAL_SIZE_FIELDS:
        if field not in hf or (hf[field] is None and field in HF_OPTIONAL_SIZE_FIELDS):
            continue
        value = hf[field]
        if not _is_int(value) or value < 1:
            raise ConversionError(f"{where}: field {field!r} is {value!r}; it must be an integer >= 1")
    for field in HF_POSITIVE_FLOATS:
        value = hf.get(field)
        if value is not None and not (_is_number(value) and math.isfinite(value) and value > 0):
            raise ConversionError(f"{where}: field {field!r} is {value!r}; it must be a finite number > 0")


def head_size(hidden: int, heads: int, where: str) -> int:
    """``hidden // heads``, refusing a head count that does not divide the hidden size."""
    if hidden % heads:
        raise ConversionError(f"{where}: hidden size {hidden} is not a multiple of the {heads} attention heads")
    return hidden // heads


def check_model_args(args: Mapping[str, Any], where: str) -> None:
    """Model flags (by destination): sizes, the flag records' bounds, head groups, and memory."""
    for dest in REQUIRED_SIZES:
        value = args.get(dest)
        if not _is_int(value) or value < 1:
            raise ConversionError(f"{where}: flag {dest} is {value!r}; it must be an integer >= 1")
    for dest, bounds in bounded_flags().items():
        value = args.get(dest)
        if value is not None and not (_is_number(value) and bounds.accepts(value)):
            raise ConversionError(f"{where}: flag {dest} is {value!r}; it {bounds.rule(value)}")
    heads, groups = args["num_attention_heads"], args.get("num_query_groups") or args["num_attention_heads"]
    if heads % groups:
        raise ConversionError(f"{where}: {heads} attention heads are not a multiple of {groups} query groups")
    check_memory(args, where)


def parameter_estimate(args: Mapping[str, Any]) -> int:
    """About how many parameters the model ``args`` describes has (embeddings, attention, MLPs, experts)."""
    hidden, heads = args["hidden_size"], args["num_attention_heads"]
    kv, groups = args.get("kv_channels") or hidden // heads, args.get("num_query_groups") or heads
    layers = (args.get("encoder_num_layers") or 0) + (args.get("decoder_num_layers") or 0) or args["num_layers"]
    gated = args.get("swiglu") or args.get("t5_v11")
    mlp = hidden * (args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"]) * (3 if gated else 2)
    attention = hidden * kv * (2 * heads + 2 * groups)
    embeddings = args["padded_vocab_size"] * hidden * (2 if args.get("untie_embeddings_and_output_weights") else 1)
    if args.get("position_embedding_type") == "learned_absolute":
        embeddings += (args.get("max_position_embeddings") or 0) * hidden
    return embeddings + layers * (attention + mlp * (args.get("num_experts") or 1))


def available_memory_bytes() -> int:
    """Memory available to this process now (``MemAvailable``; else the physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(args: Mapping[str, Any], where: str, available: Optional[int] = None) -> None:
    """Refuse a model whose fp32 weights alone need more memory than is available, before allocating it."""
    needed = parameter_estimate(args) * BYTES_PER_PARAMETER
    available = available_memory_bytes() if available is None else available
    if needed > available:
        raise ConversionError(
            f"{where}: the model ({args['num_layers']} layers, hidden {args['hidden_size']}, vocabulary "
            f"{args['padded_vocab_size']} padded) needs about {needed / 2**30:.1f} GiB for its float32 weights; "
            f"this machine has {available / 2**30:.1f} GiB available"
        )


def shard_paths(hf_dir: str, weight_map: Any, index: str) -> List[str]:
    """The shard files ``weight_map`` names, each a relative path that stays inside ``hf_dir``."""
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConversionError(f"{index}: 'weight_map' must map tensor names to shard file names")
    root = os.path.realpath(hf_dir)
    paths = []
    for name in sorted(set(weight_map.values())):
        path = os.path.realpath(os.path.join(root, name))
        if os.path.isabs(name) or os.path.commonpath([root, path]) != root:
            raise ConversionError(f"{index}: shard file {name!r} is outside the model directory {hf_dir}")
        paths.append(path)
    return paths


def check_hf_tensors(sd: Mapping[str, Any], where: str, allow_nonfinite: bool = False) -> None:
    """Refuse non-tensors, dtypes other than ``FLOAT_DTYPES`` and (unless allowed) NaN or infinite values."""
    for name, tensor in sd.items():
        if not isinstance(tensor, torch.Tensor):
            raise ConversionError(f"{where}: entry {name!r} is a {type(tensor).__name__}, not a tensor")
        if name.endswith(INDEX_TABLES) and tensor.dtype in INDEX_DTYPES:
            continue  # integer tables, copied as they are
        if tensor.dtype not in FLOAT_DTYPES:
            allowed = ", ".join(str(d).replace("torch.", "") for d in FLOAT_DTYPES)
            raise ConversionError(
                f"{where}: tensor {name!r} is {str(tensor.dtype).replace('torch.', '')}; weights must be one "
                f"of {allowed} (cast to float32)"
            )
        if not allow_nonfinite:
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise ConversionError(
                    f"{where}: tensor {name!r} has {bad} NaN or infinite values; refused (--allow-nonfinite "
                    "converts them as they are)"
                )


class ReadTracker(dict):
    """The HF state dict, recording which names the family's mapping reads (``[]`` and ``get``)."""

    def __init__(self, sd: Mapping[str, Any]) -> None:
        super().__init__(sd)
        self.read: set = set()

    def __getitem__(self, name: str) -> Any:
        self.read.add(name)
        return super().__getitem__(name)

    def get(self, name: str, default: Any = None) -> Any:
        if name in self:
            self.read.add(name)
        return super().get(name, default)


def check_all_read(tracker: ReadTracker, where: str, ignored_suffixes: Sequence[str] = ()) -> None:
    """Refuse tensors the mapping did not read (buffers with ``ignored_suffixes`` aside), naming them."""
    unread = sorted(n for n in tracker if n not in tracker.read and not n.endswith(tuple(ignored_suffixes)))
    if unread:
        shown = ", ".join(unread[:8]) + (f" and {len(unread) - 8} more" if len(unread) > 8 else "")
        raise ConversionError(f"{where}: {len(unread)} tensors the config has no place for: {shown}")


def check_shapes(found: Mapping[str, Any], expected: Mapping[str, Any], where: str, names: Iterable[str]) -> None:
    """Each of ``names`` present in both has the expected shape; the message names the tensor and both shapes."""
    for name in names:
        if name in found and name in expected and tuple(found[name].shape) != tuple(expected[name].shape):
            raise ConversionError(
                f"{where}: tensor {name!r} has shape {tuple(found[name].shape)}; the config needs "
                f"{tuple(expected[name].shape)}"
            )


def meta_copy(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Shape-only (meta) copies of a state dict's tensors: name mappings run on them without copying data."""
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in sd.items()}
