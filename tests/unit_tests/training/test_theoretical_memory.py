"""The theoretical memory accounting against measurement, and against Korthikanti et al. (2022).

One spawned pair of gloo ranks runs a training step of each small config of the grid (TP 1/2,
SP on/off, recompute none/selective/full, PP 2 with 1F1B and interleaved, MoE, distributed
optimizer, Megatron-FSDP's optim_grads and optim_grads_params, optim_grads with two distributed-optimizer
instances (hybrid sharding: shards over the instance of one rank), PyTorch FSDP2, bf16, multi-latent attention
with shared experts and multi-token prediction, DeepSeek-V4) and
measures (``tests/memory_probe.py``): the parameter, gradient-buffer and optimizer bytes as
distinct storages, and the peak of the bytes autograd keeps for backward over
the whole schedule. State must match exactly, activations within 10%, and the parameter list
derived from the config must name the built model's parameters one by one. Hybrid Mamba models (a ``MambaModel``
with Mamba, attention, MLP and MoE layers, fp32 ``A_log``/``D`` in their own buffer under bf16): state exact and
the parameter list; their activations are not estimated yet, nor those of Gated DeltaNet layers.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import arguments as A
from megatron.training.theoretical_activations import _Tokens, layer_activations
from megatron.training.theoretical_memory import LanguageModelShape, RankPosition, report_theoretical_memory
from megatron.training.theoretical_memory_params import chunk_parameters
from tests.dist_harness import run_distributed
from tests.memory_probe import MemCase, measure_cases
from tests.unit_tests.models.test_deepseek_v4_parity import V4_MODEL

ACTIVATION_TOLERANCE = 0.10
STATE = ("params", "grads", "main_params", "optimizer_states", "num_parameters")

# DeepSeek-V3's pieces: multi-latent attention, shared experts with a gate, one multi-token prediction module
# (under PP on the last stage, with its embedding copy alone in a bucket under the distributed optimizer); V3.2's
# sparse attention indexer (replicated over TP).
DEEPSEEK = dict(
    multi_latent_attention=True,
    num_query_groups=None,
    q_lora_rank=16,
    kv_lora_rank=12,
    qk_head_dim=8,
    qk_pos_emb_head_dim=8,
    v_head_dim=6,
    qk_layernorm=True,
    moe_shared_expert_intermediate_size=32,
    moe_shared_expert_gate=True,
    mtp_num_layers=1,
)
# DeepSeek-V4 (the parity test's model on 24 tokens: CSA, HCA and sliding layers, three hyper-connection streams
# whose fp32 parameters get their own buffer under bf16, hash-routed and learned MoE, one MTP module); its attention is
# replicated over TP and sees the gathered sequence under SP, the hyper-connections this rank's tokens.
DEEPSEEK_V4 = {k: v for k, v in V4_MODEL.items() if k not in ("max_sequence_length", "init_method_std")}
DEEPSEEK_V4.update(mtp_num_layers=1)
# Qwen3-Next's Gated DeltaNet layers (every 2nd layer full attention).
GATED_DELTA_NET = dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=2)
GATED_DELTA_NET.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
GRID = [
    MemCase("tp1 dp2"),
    MemCase("tp1 dp2 llama rope gqa swiglu", llama=True),
    MemCase("tp1 dp2 selective", recompute="selective"),
    MemCase("tp1 dp2 full block", recompute="full", recompute_method="block", recompute_num_layers=1),
    MemCase("tp1 dp2 dist-opt bf16", llama=True, bf16=True, dist_opt=True),
    MemCase("tp1 dp2 dropout", hidden_dropout=0.1),
    MemCase("tp2 gated attention", tp=2, extra=dict(attention_output_gate=True)),
    MemCase(
        "tp1 dp2 fsdp optim_grads_params bf16", bf16=True, dist_opt=True, sharding="optim_grads_params", num_layers=3
    ),
    MemCase("tp1 dp2 moe fsdp optim_grads", moe=True, dist_opt=True, sharding="optim_grads"),
    MemCase("tp1 dp2 fsdp optim_grads 2 instances", dist_opt=True, sharding="optim_grads", instances=2),
    MemCase("tp1 dp2 torch fsdp2 bf16", bf16=True, fsdp2=True, extra=dict(share_embeddings_and_output_weights=False)),
    MemCase("tp2 sp", tp=2, sp=True),
    MemCase("tp2 sp selective", tp=2, sp=True, recompute="selective"),
    MemCase("tp2 sp full uniform", tp=2, sp=True, recompute="full"),
    MemCase("tp1 dp2 moe", moe=True),
    MemCase("tp2 sp moe bf16", tp=2, sp=True, moe=True, bf16=True),
    MemCase(
        "tp1 dp2 moe capacity pad",
        moe=True,
        extra=dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True),
    ),
    MemCase("pp2 1f1b", pp=2, num_microbatches=4),
    MemCase("pp2 interleaved vp2", pp=2, vp=2, num_layers=4, num_microbatches=4),
    MemCase("tp1 dp2 mla shared mtp", llama=True, moe=True, extra=DEEPSEEK),
    MemCase(
        "tp2 sp mla dsa",
        llama=True,
        tp=2,
        sp=True,
        extra=dict(DEEPSEEK, mtp_num_layers=None, experimental_attention_variant="dsa", dsa_indexer_n_heads=4)
        | dict(dsa_indexer_head_dim=8, dsa_indexer_topk=4),
    ),
    MemCase("tp2 sp hybrid moe dist-opt bf16", tp=2, sp=True, moe=True, bf16=True, dist_opt=True, hybrid="M*-E"),
    MemCase("pp2 hybrid", pp=2, hybrid="M*M-"),
    MemCase("tp2 sp gated delta net", llama=True, tp=2, sp=True, num_layers=4, extra=GATED_DELTA_NET),
    MemCase(
        "pp2 mla shared mtp dist-opt", llama=True, moe=True, pp=2, dist_opt=True, num_microbatches=2, extra=DEEPSEEK
    ),
    MemCase(
        "tp2 sp v4 bf16 dist-opt", tp=2, sp=True, bf16=True, dist_opt=True, num_layers=3, seq=24, extra=DEEPSEEK_V4
    ),
]


@pytest.fixture(scope="module")
def grid_results():
    return run_distributed(measure_cases, 2, GRID, timeout=600)


def _config(case: MemCase, pos: RankPosition) -> TransformerConfig:
    kw = {k: v for k, v in case.model_kwargs().items() if k in TransformerConfig.__dataclass_fields__}
    extra = {"virtual_pipeline_model_parallel_size": case.vp} if case.vp else {}
    return TransformerConfig(tensor_model_parallel_size=pos.tp, pipeline_model_parallel_size=pos.pp, **kw, **extra)


@pytest.mark.parametrize("index", range(len(GRID)), ids=[c.name for c in GRID])
def test_state_exact_and_activations_within_tolerance(grid_results, index):
    case = GRID[index]
    for rank, per_rank in enumerate(grid_results):
        measured, accounted = per_rank[index]["measured"], per_rank[index]["accounted"]
        for key in STATE:
            assert accounted[key] == measured[key], f"{case.name} rank {rank}: {key}"
        if accounted["activations"] is None:  # not estimated for Mamba / Gated DeltaNet layers (state only)
            assert case.hybrid or case.extra is GATED_DELTA_NET, case.name
            continue
        error = abs(accounted["activations"] - measured["activations"]) / measured["activations"]
        assert error <= ACTIVATION_TOLERANCE, f"{case.name} rank {rank}: {accounted} vs {measured}"


@pytest.mark.parametrize("index", range(len(GRID)), ids=[c.name for c in GRID])
def test_parameter_list_from_config_names_the_built_model(grid_results, index):
    case = GRID[index]
    pp_ranks = [0, 1] if case.pp == 2 else [0, 0]
    for rank, per_rank in enumerate(grid_results):
        pos = RankPosition(tp=case.tp, pp=case.pp, dp=2 // (case.tp * case.pp), vp=case.vp, pp_rank=pp_ranks[rank])
        config = _config(case, pos)
        kw = case.model_kwargs()
        lm = LanguageModelShape(
            kw["vocab_size"],
            case.seq,
            kw["position_embedding_type"],
            kw["share_embeddings_and_output_weights"],
            hybrid_layer_pattern=case.hybrid,
        )
        for vp_stage, built in enumerate(per_rank[index]["chunks"]):
            derived = [(e.name, e.numel) for e in chunk_parameters(config, lm, pos, vp_stage)]
            assert derived == built, f"{case.name} rank {rank} chunk {vp_stage}"


# ----------------------------------------------------------------- Korthikanti et al. 2022, Table 2
S, B, H, HEADS = 2048, 1, 4096, 32


def _gpt_layer(tp: int, sp: bool, recompute=None) -> int:
    """Our GPT-3-style layer (LayerNorm, GeLU, 4h, bf16, hidden dropout, no attention dropout) on CUDA."""
    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=HEADS,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        params_dtype=torch.bfloat16,
        bf16=True,
        hidden_dropout=0.1,
        attention_dropout=0.0,
        recompute_granularity=recompute,
    )
    lm = LanguageModelShape(vocab_size=51200, max_sequence_length=S)
    tokens = _Tokens(b=B, s=S, sp=tp if sp else 1, e=2, mask=1)
    return layer_activations(config, lm, tokens, RankPosition(tp=tp), 1).total


def _ours_beyond_paper(tp: int, sp: bool) -> float:
    """What our layer keeps that Table 2 does not count: fp32 LayerNorm mean and rstd (2 norms),
    and SDPA's fp32 log-sum-exp. Table 2's 5as^2b (scores, softmax, its dropout mask) is absent:
    flash/SDPA attention keeps no s x s matrix, and the attention dropout is 0."""
    norm_stats = 2 * 2 * 4 * S * B / (tp if sp else 1)
    return norm_stats + 4 * (HEADS // tp) * S * B


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_gpt_layer_matches_table2_without_the_score_matrix(tp):
    sbh = S * B * H
    if tp == 1:
        paper = sbh * 34  # sbh(34 + 5as/h), without the 5as/h attention-matrix term
        assert _gpt_layer(1, False) == paper + _ours_beyond_paper(1, False)
        return
    tp_only = sbh * (10 + 24 / tp)  # sbh(10 + 24/t + 5as/(ht))
    assert _gpt_layer(tp, False) == tp_only + _ours_beyond_paper(tp, False)
    tp_sp = sbh * 34 / tp  # sbh/t (34 + 5as/h)
    assert _gpt_layer(tp, True) == tp_sp + _ours_beyond_paper(tp, True)
    selective = sbh * 34 / tp  # 34 sbh/t: recompute drops the attention core (our log-sum-exp)
    assert _gpt_layer(tp, True, "selective") == selective + _ours_beyond_paper(tp, True) - 4 * (HEADS // tp) * S * B


# ----------------------------------------------------------------- start-up report
def test_report_prints_megatron_line_for_the_most_loaded_stage():
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "2"]
    argv += ["--seq-length", "32", "--max-position-embeddings", "32", "--train-iters", "10", "--lr", "1e-4"]
    argv += ["--global-batch-size", "8"]
    argv += ["--pipeline-model-parallel-size", "2", "--bf16", "--use-distributed-optimizer"]
    args = A.validate_args(A.parse_args(argv, entry_point="gpt"), 4)
    args.padded_vocab_size = 256
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        estimate = report_theoretical_memory(args)
    line = out.getvalue().strip().splitlines()[-1]
    mb = 1024 * 1024
    assert line == (
        f"Theoretical memory footprints: weight and optimizer={estimate.state.total / mb:.2f} MB, "
        f"activation={estimate.activation_peak / mb:.2f} MB, total={estimate.total / mb:.2f} MB"
    )
    # Stage 0 keeps 2 microbatches in flight (1F1B, p - i), stage 1 one: stage 0 is reported.
    assert estimate.activation_peak == 2 * estimate.chunks[0].total
