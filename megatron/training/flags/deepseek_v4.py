"""Records of DeepSeek-V4's flags that Megatron-LM's table lacks (this project's own).

DeepSeek-V4's compressed attention (``experimental_attention_variant/compressed_attention.py``),
manifold-constrained hyper-connections (``transformer/hyper_connection.py``) and hash-routed MoE
layers (``moe/hash_router.py``). The sizes Megatron has flags for keep them: the indexer's
``--dsa-indexer-*``, the sliding window ``--window-size``, the clamped SwiGLU
``--activation-func-clamp-value``, partial rotary ``--rotary-percent``.
"""

from __future__ import annotations

from megatron.core.transformer.transformer_config import TransformerConfig as TC
from megatron.training.flags.derive import hash_router_vocab_size
from megatron.training.flags.record import IMPLEMENTED, Flag, ProjectFlag, always, positive, same, to
from megatron.training.training_log import FlopsConfig as FL

GROUP = "transformer configuration"


def _project(option: str, default: object, nargs: str = None) -> ProjectFlag:
    return ProjectFlag(group=GROUP, option_strings=(option,), default=default, action="store", nargs=nargs)


RECORDS = (
    Flag(
        "compressed_attention_layer_types",
        IMPLEMENTED,
        type=str,
        help="DeepSeek-V4's attention, one type per layer: sliding_attention, compressed_sparse_attention "
        "(CSA) or heavily_compressed_attention (HCA).",
        fills=same(TC, FL),
        architecture=always,
        project=_project("--compressed-attention-layer-types", None, nargs="+"),
    ),
    Flag(
        "csa_compress_rate",
        IMPLEMENTED,
        type=int,
        help="DeepSeek-V4 CSA: tokens pooled into one compressed entry.",
        fills=same(TC, FL),
        bounds=positive(),
        architecture=always,
        project=_project("--csa-compress-rate", 4),
    ),
    Flag(
        "hca_compress_rate",
        IMPLEMENTED,
        type=int,
        help="DeepSeek-V4 HCA: tokens pooled into one compressed entry.",
        fills=same(TC, FL),
        bounds=positive(),
        architecture=always,
        project=_project("--hca-compress-rate", 128),
    ),
    Flag(
        "compressed_attention_rotary_base",
        IMPLEMENTED,
        type=float,
        help="DeepSeek-V4: RoPE base of the CSA/HCA layers (sliding layers use --rotary-base).",
        fills=same(TC),
        bounds=positive(),
        architecture=always,
        project=_project("--compressed-attention-rotary-base", 160000.0),
    ),
    Flag(
        "attention_output_groups",
        IMPLEMENTED,
        type=int,
        help="DeepSeek-V4: head groups of the grouped low-rank attention output projection.",
        fills=same(TC, FL),
        architecture=always,
        project=_project("--attention-output-groups", None),
    ),
    Flag(
        "attention_output_lora_rank",
        IMPLEMENTED,
        type=int,
        help="DeepSeek-V4: each head group's rank in the grouped attention output projection.",
        fills=same(TC, FL),
        architecture=always,
        project=_project("--attention-output-lora-rank", None),
    ),
    Flag(
        "hyper_connection_streams",
        IMPLEMENTED,
        type=int,
        help="Manifold-constrained hyper-connections: residual streams (DeepSeek-V4's hc_mult); 1: a plain residual.",
        fills=same(TC, FL),
        bounds=positive(),
        architecture=always,
        project=_project("--hyper-connection-streams", 1),
    ),
    Flag(
        "hyper_connection_sinkhorn_iterations",
        IMPLEMENTED,
        type=int,
        help="Hyper-connections: Sinkhorn iterations of the stream-mixing matrix.",
        fills=same(TC),
        bounds=positive(),
        architecture=always,
        project=_project("--hyper-connection-sinkhorn-iterations", 20),
    ),
    Flag(
        "hyper_connection_eps",
        IMPLEMENTED,
        type=float,
        help="Hyper-connections: the floor added to the mixing weights and Sinkhorn sums.",
        fills=same(TC),
        bounds=positive(),
        architecture=always,
        project=_project("--hyper-connection-eps", 1e-6),
    ),
    Flag(
        "moe_num_hash_layers",
        IMPLEMENTED,
        type=int,
        help="DeepSeek-V4 hash_moe: the first this many layers' MoE routers pick experts by a frozen table of "
        "the token id (its table covers the padded vocabulary).",
        fills=(*same(TC), to(TC, "moe_hash_router_vocab_size", hash_router_vocab_size)),
        architecture=always,
        project=ProjectFlag(group="moe", option_strings=("--moe-num-hash-layers",), default=0, action="store"),
    ),
)
