"""Records of the hybrid Mamba model flags (``pretrain_mamba.py``; ``megatron/core/ssm``)."""

from __future__ import annotations

from megatron.core.transformer.transformer_config import TransformerConfig as TC
from megatron.training.flags.derive import hybrid_layer_pattern
from megatron.training.flags.record import IMPLEMENTED, Flag, ProjectFlag, always, between, positive, same, to
from megatron.training.theoretical_memory_params import LanguageModelShape as LMS
from megatron.training.training_log import FlopsConfig as FL

RECORDS = (
    Flag(
        "is_hybrid_model",
        IMPLEMENTED,
        help="A hybrid Mamba model (pretrain_mamba.py sets it; pretrain_gpt.py refuses it).",
        fills=(
            to(FL, "hybrid_layer_pattern", hybrid_layer_pattern),
            to(LMS, "hybrid_layer_pattern", hybrid_layer_pattern),
        ),
        architecture=always,
    ),
    Flag(
        "hybrid_attention_ratio",
        IMPLEMENTED,
        help="Share of attention layers, spread evenly between Mamba layers (without a pattern).",
        bounds=between(0.0, 1.0),
        architecture=always,
        project=ProjectFlag(
            group="network size", option_strings=("--hybrid-attention-ratio",), default=0.0, action="store"
        ),
    ),
    Flag(
        "hybrid_mlp_ratio",
        IMPLEMENTED,
        help="Share of MLP layers, spread over the remaining Mamba slots (without a pattern).",
        bounds=between(0.0, 1.0),
        architecture=always,
        project=ProjectFlag(group="network size", option_strings=("--hybrid-mlp-ratio",), default=0.0, action="store"),
    ),
    Flag(
        "hybrid_override_pattern",
        IMPLEMENTED,
        type=str,
        help="One symbol per layer: M Mamba, * attention, - MLP, E MoE (e.g. M-M*-M-).",
        architecture=always,
        project=ProjectFlag(
            group="network size", option_strings=("--hybrid-override-pattern",), default=None, action="store"
        ),
    ),
    Flag(
        "spec",
        IMPLEMENTED,
        type=str,
        help="MODULE NAME of the layer spec to build (pretrain_mamba.py: a stack spec such as "
        "megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec); pretrain_gpt.py refuses it.",
        project=ProjectFlag(group="network size", option_strings=("--spec",), default=None, action="store", nargs="*"),
    ),
    Flag(
        "mamba_state_dim",
        IMPLEMENTED,
        help="State size per Mamba head.",
        fills=same(TC, FL),
        bounds=positive(),
        architecture=always,
    ),
    Flag(
        "mamba_head_dim",
        IMPLEMENTED,
        help="Channels per Mamba head.",
        fills=same(TC, FL),
        bounds=positive(),
        architecture=always,
    ),
    Flag(
        "mamba_num_groups",
        IMPLEMENTED,
        help="Groups of Mamba heads sharing B and C.",
        fills=same(TC, FL),
        bounds=positive(),
        architecture=always,
    ),
    Flag(
        "mamba_num_heads",
        IMPLEMENTED,
        type=int,
        help="Mamba heads (default: 2 * hidden size / head dim).",
        fills=same(TC, FL),
        architecture=always,
    ),
    Flag(
        "use_mamba_mem_eff_path",
        IMPLEMENTED,
        help="Off: Megatron's unfused CUDA scan; here the PyTorch scan computes the same values either way.",
        fills=same(TC),
    ),
)
