"""The compatibility matrix: which features combine, as data, in one place.

A :class:`Feature` is a named state of one or more settings (``fp8`` set, full recomputation, the
distributed optimizer off, ...). A setting's name is the config field that holds it, which is also the
destination of the flag that fills it (``--fp8-format`` -> ``fp8``). :data:`REFUSED` lists the pairs of
features that do not combine, each with its reason; every pair not listed is supported.

The rules are read, never restated: a config's ``__post_init__`` calls :func:`check` (the rows whose
settings are all its fields), the command-line validation calls :func:`refusals` on the parsed flags
before the model is built (``megatron/training/flags/compatibility.py``, which also writes
``docs/COMPATIBILITY.md`` from this table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron.core.quantization.fp8_params import PARAM_GATHER_RECIPES

Lookup = Callable[[str], Any]  # a setting's value; raises KeyError for a setting it does not hold


@dataclass(frozen=True)
class Feature:
    """A feature in use when ``when(*values of settings)`` holds; ``text`` says it in words."""

    name: str
    settings: Tuple[str, ...]
    when: Callable[..., bool]
    text: str


@dataclass(frozen=True)
class Refused:
    """Features ``first`` and ``second`` do not combine, for ``reason``."""

    first: str
    second: str
    reason: str


def _f(name: str, settings: str, when: Callable[..., bool], text: str) -> Feature:
    return Feature(name, tuple(settings.split()), when, text)


_FEATURE_LIST = (
    _f("fp8", "fp8", lambda v: v is not None, "FP8 GEMMs"),
    _f("fp4", "fp4", lambda v: v is not None, "FP4 GEMMs"),
    _f("fp32", "bf16 fp16", lambda b, f: not (b or f), "fp32 parameters (neither bf16 nor fp16)"),
    _f("fp8_delayed", "fp8 fp8_recipe", lambda f, r: f is not None and r == "delayed", "FP8 delayed scaling"),
    _f(
        "fp8_not_per_tensor",
        "fp8 fp8_recipe",
        lambda f, r: f is not None and r not in PARAM_GATHER_RECIPES,
        "an FP8 recipe without per-tensor scales (blockwise, mxfp8)",
    ),
    _f("no_fp8", "fp8", lambda v: v is None, "no FP8 training"),
    _f("first_last_bf16", "first_last_layers_bf16", bool, "first/last layers kept in bf16"),
    _f("full_recompute", "recompute_granularity", lambda v: v == "full", "full recomputation"),
    _f("not_full_recompute", "recompute_granularity", lambda v: v != "full", "no full recomputation"),
    _f("recompute_method", "recompute_method", lambda v: v is not None, "a recomputation method"),
    _f("no_recompute_method", "recompute_method", lambda v: v is None, "no recomputation method"),
    _f("distribute_saved", "distribute_saved_activations", bool, "saved activations split over TP"),
    _f("tp1", "tensor_model_parallel_size", lambda v: v == 1, "tensor-parallel size 1"),
    _f("sequence_parallel", "sequence_parallel", bool, "sequence parallelism"),
    _f("mla", "multi_latent_attention", bool, "multi-latent attention"),
    _f("not_mla", "multi_latent_attention", lambda v: not v, "standard attention (no MLA)"),
    _f(
        "gqa",
        "num_query_groups num_attention_heads",
        lambda q, h: q is not None and q != h,
        "grouped-query attention (fewer key/value groups than heads)",
    ),
    _f("rotary_interleaved", "rotary_interleaved", bool, "interleaved rotary channels"),
    _f("qkv_bias", "add_qkv_bias", bool, "a QKV bias"),
    _f("yarn", "rope_type", lambda v: v == "yarn", "YaRN RoPE"),
    _f("rope_scaling", "use_rope_scaling", bool, "Llama 3.1 RoPE scaling"),
    _f("expert_bias", "moe_router_enable_expert_bias", bool, "the router's expert bias"),
    _f("softmax_router", "moe_router_score_function", lambda v: v == "softmax", "softmax router scores"),
    _f("pad_to_capacity", "moe_pad_expert_input_to_capacity", bool, "expert inputs padded to capacity"),
    _f(
        "dropless",
        "moe_expert_capacity_factor",
        lambda v: v is None or v < 0,
        "dropless MoE (no capacity factor)",
    ),
    _f("shared_expert_gate", "moe_shared_expert_gate", bool, "a shared-expert gate"),
    _f("shared_expert_overlap", "moe_shared_expert_overlap", bool, "shared-expert overlap"),
    _f("no_shared_experts", "moe_shared_expert_intermediate_size", lambda v: v is None, "no shared experts"),
    _f("overlap_param_gather", "overlap_param_gather", bool, "overlapped parameter all-gather"),
    _f("fp8_param_gather", "fp8_param_gather", bool, "FP8 parameter all-gather"),
    _f("no_dist_opt", "use_distributed_optimizer", lambda v: not v, "no distributed optimizer"),
    _f("dist_opt", "use_distributed_optimizer", bool, "the distributed optimizer"),
    _f(
        "fsdp_sharded",
        "data_parallel_sharding_strategy",
        lambda v: v != "no_shard",
        "a Megatron-FSDP sharding strategy (optim, optim_grads, optim_grads_params)",
    ),
    _f(
        "fsdp_no_shard",
        "use_megatron_fsdp data_parallel_sharding_strategy",
        lambda f, v: f and v == "no_shard",
        "Megatron-FSDP without sharding (no_shard)",
    ),
    _f("fsdp_params", "data_parallel_sharding_strategy", lambda v: v == "optim_grads_params", "sharded parameters"),
    _f("no_megatron_fsdp", "use_megatron_fsdp", lambda v: not v, "no Megatron-FSDP"),
    _f(
        "dist_opt_instances",
        "num_distributed_optimizer_instances",
        lambda v: v > 1,
        "several distributed-optimizer instances (hybrid sharding)",
    ),
    _f("megatron_fsdp", "use_megatron_fsdp", bool, "Megatron-FSDP"),
    _f("torch_fsdp2", "use_torch_fsdp2", bool, "PyTorch FSDP2 (fully_shard)"),
    _f("fp16", "fp16", bool, "fp16 parameters"),
    _f("grad_acc_fusion", "gradient_accumulation_fusion", bool, "gradient accumulation fusion"),
    _f(
        "tied_embeddings",
        "untie_embeddings_and_output_weights",
        lambda v: not v,
        "an output layer tied to the embedding",
    ),
    _f("ckpt_not_torch_dist", "ckpt_format", lambda v: v != "torch_dist", "a checkpoint format other than torch_dist"),
    _f("muon", "optimizer", lambda v: v == "muon", "the Muon optimizer"),
    _f("async_save", "async_save", bool, "asynchronous checkpoint saves"),
    _f("np_local", "non_persistent_ckpt_type", lambda v: v == "local", "local non-persistent checkpoints"),
    _f("ckpt_torch", "ckpt_format", lambda v: v == "torch", "the legacy torch checkpoint format"),
    _f("ep", "expert_model_parallel_size", lambda v: v > 1, "expert parallelism (EP > 1)"),
    _f(
        "etp_differs",
        "expert_tensor_parallel_size tensor_model_parallel_size",
        lambda e, t: e is not None and e != t,
        "an expert-TP size other than TP",
    ),
    _f("vpp", "virtual_pipeline_model_parallel_size", lambda v: v is not None and v > 1, "virtual pipeline stages"),
    _f("pp1", "pipeline_model_parallel_size", lambda v: v == 1, "no pipeline parallelism (PP = 1)"),
    _f("pp", "pipeline_model_parallel_size", lambda v: v > 1, "pipeline parallelism (PP > 1)"),
)
FEATURES: Dict[str, Feature] = {f.name: f for f in _FEATURE_LIST}

_HALF_OUTPUTS = "the low-precision GEMMs write bf16/fp16 outputs: give bf16=True or fp16=True"
REFUSED: Tuple[Refused, ...] = (
    # precision
    Refused("fp4", "fp8", "one low-precision GEMM format at a time: choose FP8 or FP4"),
    Refused("fp8", "fp32", _HALF_OUTPUTS),
    Refused("fp4", "fp32", _HALF_OUTPUTS),
    Refused(
        "first_last_bf16",
        "fp8_delayed",
        "Megatron refuses it too: use fp8_recipe='tensorwise', 'blockwise' or 'mxfp8'",
    ),
    # FP8 parameter all-gather
    Refused("fp8_param_gather", "fp4", "not supported yet (FP4 weights)"),
    Refused(
        "fp8_param_gather",
        "no_fp8",
        "FP8 weights need FP8 training (Megatron refuses it without TransformerConfig.fp8)",
    ),
    Refused(
        "fp8_param_gather",
        "fp8_not_per_tensor",
        f"not supported yet: FP8 weights take per-tensor scales only ({', '.join(PARAM_GATHER_RECIPES)})",
    ),
    Refused(
        "fp8_param_gather",
        "no_dist_opt",
        "the distributed optimizer keeps the fp32 main weights the FP8 weights are cast from",
    ),
    Refused("overlap_param_gather", "no_dist_opt", "only the distributed optimizer all-gathers parameters"),
    # Megatron-FSDP
    Refused(
        "fsdp_sharded", "no_megatron_fsdp", "sharding strategies are Megatron-FSDP's: needs use_megatron_fsdp=True"
    ),
    Refused("fsdp_sharded", "no_dist_opt", "the strategies shard the distributed optimizer's buffers"),
    Refused("fsdp_no_shard", "dist_opt", "no_shard shards nothing: the distributed optimizer is strategy 'optim'"),
    Refused(
        "fsdp_params",
        "overlap_param_gather",
        "sharded parameters are gathered layer by layer in forward and backward, not after the optimizer step",
    ),
    Refused("fsdp_params", "fp8_param_gather", "not supported yet: FP8 weights stored sharded"),
    Refused(
        "dist_opt_instances",
        "no_dist_opt",
        "the instances are the distributed optimizer's (or a Megatron-FSDP sharding strategy's): "
        "gradients are reduce-scattered within one and all-reduced across them",
    ),
    # PyTorch FSDP2 (Megatron's rules, but for expert parallelism, which shards experts over expert-DP here)
    Refused("torch_fsdp2", "dist_opt", "FSDP2 shards the optimizer state itself (Megatron refuses it too)"),
    Refused("torch_fsdp2", "megatron_fsdp", "one fully sharded data parallelism at a time"),
    Refused("torch_fsdp2", "pp", "Megatron refuses FSDP2 with pipeline parallelism"),
    Refused(
        "torch_fsdp2",
        "grad_acc_fusion",
        "FSDP2 owns the gradients: no fused accumulation into main_grad (set it False)",
    ),
    Refused("torch_fsdp2", "ckpt_not_torch_dist", "FSDP2 checkpoints are sharded: use ckpt_format='torch_dist'"),
    Refused("torch_fsdp2", "tied_embeddings", "Megatron needs untie_embeddings_and_output_weights=True with FSDP2"),
    Refused("torch_fsdp2", "fp16", "Megatron runs FSDP2 in fp32 or bf16 only"),
    Refused("torch_fsdp2", "muon", "not supported yet: Muon orthogonalises whole matrices, FSDP2 holds rows"),
    # recomputation
    Refused("full_recompute", "no_recompute_method", "full recomputation needs recompute_method='uniform' or 'block'"),
    Refused("recompute_method", "not_full_recompute", "a recomputation method applies to full recomputation only"),
    Refused("distribute_saved", "not_full_recompute", "only full recomputation saves layer inputs to split"),
    Refused("distribute_saved", "tp1", "the saved inputs are split over tensor-parallel ranks: needs TP > 1"),
    Refused(
        "distribute_saved",
        "sequence_parallel",
        "each TP rank's layer input is already its own sequence slice, not a copy to split (Megatron refuses it too)",
    ),
    # checkpoints
    Refused(
        "async_save",
        "np_local",
        "local non-persistent checkpoints are written synchronously (each rank's own state to node-local storage): "
        "use non_persistent_ckpt_type='global' for background writes",
    ),
    # attention and position embeddings
    Refused("mla", "gqa", "MLA builds every head's keys from one latent: num-query-groups must equal the heads"),
    Refused("mla", "rotary_interleaved", "MLA de-interleaves its rotary channels itself"),
    Refused("mla", "qkv_bias", "MLA's projections have no QKV bias"),
    Refused("yarn", "not_mla", "YaRN is built for multi-latent attention only"),
    Refused("rope_scaling", "mla", "MLA scales its RoPE with rope_type='yarn'"),
    # MoE
    Refused("expert_bias", "softmax_router", "the expert bias is defined for sigmoid router scores"),
    Refused("pad_to_capacity", "dropless", "padding to the capacity needs a capacity factor"),
    Refused("shared_expert_gate", "no_shared_experts", "the gate scales the shared experts' output"),
    Refused("shared_expert_overlap", "no_shared_experts", "overlaps the shared experts' computation"),
    # checkpoints and layouts
    Refused("ckpt_torch", "ep", "not supported yet: per-rank files cannot hold EP shards (use torch_dist)"),
    Refused("ckpt_torch", "etp_differs", "not supported yet: per-rank files assume expert-TP = TP (use torch_dist)"),
    Refused(
        "vpp",
        "pp1",
        "virtual stages interleave pipeline stages: needs TransformerConfig.pipeline_model_parallel_size > 1",
    ),
)


def settings_of(rule: Refused) -> Tuple[str, ...]:
    """Every setting the two features of ``rule`` read, in order, each once."""
    names = FEATURES[rule.first].settings + FEATURES[rule.second].settings
    return tuple(dict.fromkeys(names))


def _active(feature: Feature, lookup: Lookup) -> Optional[bool]:
    """Whether ``feature`` is in use; None when ``lookup`` lacks one of its settings."""
    try:
        values = [lookup(name) for name in feature.settings]
    except KeyError:
        return None
    return bool(feature.when(*values))


def refusals(lookup: Lookup) -> List[Refused]:
    """The rows of :data:`REFUSED` whose two features are both in use (rows with an unknown setting: skipped)."""
    return [r for r in REFUSED if _active(FEATURES[r.first], lookup) and _active(FEATURES[r.second], lookup)]


def describe(rule: Refused, lookup: Lookup) -> str:
    """``rule`` as an error: each setting as ``name=value``, the features in words, the reason."""
    values = ", ".join(f"{name}={lookup(name)!r}" for name in settings_of(rule))
    first, second = FEATURES[rule.first].text, FEATURES[rule.second].text
    return f"{values}: {first} with {second} is not supported: {rule.reason}"


def attribute_lookup(obj: Any, **extra: Any) -> Lookup:
    """A lookup reading ``obj``'s attributes (``extra`` first); a missing one raises KeyError."""

    def lookup(name: str) -> Any:
        if name in extra:
            return extra[name]
        if not hasattr(obj, name):
            raise KeyError(name)
        return getattr(obj, name)

    return lookup


def check(config: Any, **extra: Any) -> None:
    """Raise ``ValueError`` for the first refused pair among ``config``'s fields (and ``extra`` settings)."""
    lookup = attribute_lookup(config, **extra)
    found = refusals(lookup)
    if found:
        raise ValueError(describe(found[0], lookup))
