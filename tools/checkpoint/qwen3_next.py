"""Qwen3-Next (``Qwen3NextForCausalLM``, ``--model-type qwen3_next``) in the converter: what it adds to Qwen3-MoE.

Its layers are Gated DeltaNet (``layer_types`` ``linear_attention``; ``--experimental-attention-variant
gated_delta_net`` with ``--linear-attention-freq`` one 0/1 per layer and the ``--linear-*`` sizes) or full
attention with a sigmoid output gate (``--attention-output-gate``) rotating ``partial_rotary_factor`` of each
head (``--rotary-percent``); every norm computes ``1 + weight`` (``--apply-layernorm-1p``); the MoE MLPs have
one shared expert scaled by a sigmoid gate (``--moe-shared-expert-intermediate-size``,
``--moe-shared-expert-gate``). The weights map by ``megatron.core.models.gpt.hf_qwen3_next``; the model is
``pretrain_gpt.py``'s.
"""

from __future__ import annotations

from typing import Any, Dict, List

from tools.checkpoint.errors import Args, ConversionError

LINEAR_SIZES = (  # (flag destination, Qwen3NextConfig field): the same names
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)
LAYER_TYPES = {"linear_attention": 1, "full_attention": 0}  # -> linear_attention_freq entries


def args_from_hf(hf: Dict[str, Any], where: str) -> Args:
    """The flags (by destination) beyond Qwen3-MoE's of a ``Qwen3NextConfig``."""
    types = hf.get("layer_types") or []
    if len(types) != hf["num_hidden_layers"] or any(t not in LAYER_TYPES for t in types):
        raise ConversionError(f"{where}: field 'layer_types' is {types!r}; expected {sorted(LAYER_TYPES)} per layer")
    shared = hf.get("shared_expert_intermediate_size") or None
    rope = hf.get("rope_parameters") or {}  # transformers v5 keeps partial_rotary_factor there
    return dict(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[LAYER_TYPES[t] for t in types],
        **{name: hf[name] for name in LINEAR_SIZES},
        attention_output_gate=True,
        rotary_percent=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
        layernorm_zero_centered_gamma=True,
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=shared is not None,
    )


def flags(args: Args) -> List[Any]:
    """``pretrain_gpt.py`` flags of the Qwen3-Next features ``args`` describe (none for other models)."""
    if args.get("experimental_attention_variant") != "gated_delta_net":
        return []
    out: List[Any] = ["--experimental-attention-variant", "gated_delta_net"]
    out += ["--linear-attention-freq", "[" + ",".join(map(str, args["linear_attention_freq"])) + "]"]
    for name in LINEAR_SIZES:
        out += ["--" + name.replace("_", "-"), args[name]]
    out += ["--attention-output-gate"] if args.get("attention_output_gate") else []
    out += ["--rotary-percent", args["rotary_percent"]] if args.get("rotary_percent", 1.0) != 1.0 else []
    out += ["--apply-layernorm-1p"] if args.get("layernorm_zero_centered_gamma") else []
    return out + (["--moe-shared-expert-gate"] if args.get("moe_shared_expert_gate") else [])  # its size: router_flags


def model_kwargs(args: Args) -> Dict[str, Any]:
    """``GPTModel`` keyword arguments of the Qwen3-Next features (GDN layers, gate, partial RoPE, 1+w norms)."""
    kwargs: Dict[str, Any] = dict(
        attention_output_gate=bool(args.get("attention_output_gate")),
        rotary_percent=float(args.get("rotary_percent") or 1.0),
        layernorm_zero_centered_gamma=bool(args.get("layernorm_zero_centered_gamma")),
    )
    if args.get("experimental_attention_variant") == "gated_delta_net":
        kwargs.update(experimental_attention_variant="gated_delta_net", linear_attention_freq=_pattern(args))
        kwargs.update({name: args[name] for name in LINEAR_SIZES})
    return kwargs


def _pattern(args: Args) -> List[int]:
    """One 0/1 per layer (1 = GDN) of ``--linear-attention-freq`` (an int N: every N-th layer attention)."""
    freq = args["linear_attention_freq"]
    if isinstance(freq, int):
        return [int((i + 1) % freq != 0) for i in range(args["num_layers"])]
    return [int(p) for p in freq]


def hf_config_fields(args: Args, where: str) -> Dict[str, Any]:
    """The ``Qwen3NextConfig`` fields beyond Qwen3-MoE's for ``args``."""
    if not args.get("moe_shared_expert_intermediate_size") or not args.get("moe_shared_expert_gate"):
        raise ConversionError(
            f"{where}: flags moe_shared_expert_intermediate_size={args.get('moe_shared_expert_intermediate_size')}, "
            f"moe_shared_expert_gate={args.get('moe_shared_expert_gate')}; Qwen3-Next needs a gated shared expert"
        )
    if not args.get("attention_output_gate"):
        raise ConversionError(f"{where}: flag attention_output_gate is not set; Qwen3-Next gates attention")
    names = {1: "linear_attention", 0: "full_attention"}
    return dict(
        layer_types=[names[p] for p in _pattern(args)],
        partial_rotary_factor=float(args.get("rotary_percent") or 1.0),
        shared_expert_intermediate_size=args["moe_shared_expert_intermediate_size"],
        **{name: args[name] for name in LINEAR_SIZES},
    )
