"""Records of the heterogeneous-layer flags (Llama-Nemotron block configs), which Megatron's flag table lacks."""

from __future__ import annotations

from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig as HTC
from megatron.training.flags.record import IMPLEMENTED, Flag, ProjectFlag, always, same

RECORDS = (
    Flag(
        "heterogeneous_layers_config_path",
        IMPLEMENTED,
        type=str,
        help="JSON file with one block config per layer (Llama-Nemotron's 'block_configs': attention and ffn "
        "each built with their own sizes, replaced by a linear or left out); read as JSON only, into "
        "--heterogeneous-layers-config-encoded-json.",
        fills=same(HTC),
        project=ProjectFlag(
            group="network size", option_strings=("--heterogeneous-layers-config-path",), default=None, action="store"
        ),
    ),
    Flag(
        "heterogeneous_layers_config_encoded_json",
        IMPLEMENTED,
        type=str,
        help="The block configs' JSON text itself (wins over --heterogeneous-layers-config-path; checkpoints "
        "keep it, and a resumed run must have the same).",
        fills=same(HTC),
        architecture=always,
        project=ProjectFlag(
            group="network size",
            option_strings=("--heterogeneous-layers-config-encoded-json",),
            default=None,
            action="store",
        ),
    ),
)
