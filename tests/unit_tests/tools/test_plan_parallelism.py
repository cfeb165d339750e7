"""tools/plan_parallelism.py: flags that parse to the layout, validity, the bubble, HF configs."""

from __future__ import annotations

import json

import pytest

from megatron.training import arguments as A
from megatron.training.theoretical_memory import estimate_from_args
from tools.plan_parallelism import (
    Cluster,
    Layout,
    base_args,
    candidate_layouts,
    hf_config_flags,
    main,
    plan,
    validated_args,
)

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64"]
MODEL += ["--max-position-embeddings", "64", "--global-batch-size", "16", "--vocab-size", "256", "--bf16"]
CLUSTER = Cluster(gpus_per_node=4, num_nodes=2, gpu_memory_gb=1.0)


@pytest.mark.parametrize(
    "layout",
    [Layout(), Layout(tp=2, pp=2, vp=2, micro_batch_size=2, recompute="full"), Layout(cp=2, recompute="selective")],
)
def test_printed_flags_parse_to_the_validated_layout(layout):
    base = base_args(MODEL)
    planned = validated_args(base, layout, 8)
    parsed = A.validate_args(A.parse_args(MODEL + layout.flags() + ["--lr", "1e-4", "--train-iters", "1"]), 8)
    for dest in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "virtual_pipeline_model_parallel_size", "micro_batch_size", "sequence_parallel",
                 "recompute_granularity", "recompute_method", "recompute_num_layers",
                 "use_distributed_optimizer", "data_parallel_size"):  # fmt: skip
        assert getattr(planned, dest) == getattr(parsed, dest), dest


def test_plans_are_valid_fit_and_are_ranked():
    base = base_args(MODEL)
    plans = plan(base, CLUSTER)
    assert plans and [p.step_s for p in plans] == sorted(p.step_s for p in plans)
    candidates = list(candidate_layouts(base, CLUSTER.world_size, CLUSTER.gpus_per_node))
    refused = [c for c in candidates if validated_args(base, c, CLUSTER.world_size) is None]
    assert refused, "our validation refuses some candidates (e.g. 4 heads over TP 8 is never proposed)"
    assert not {p.layout for p in plans} & set(refused)
    for p in plans[:5]:
        args = validated_args(base, p.layout, CLUSTER.world_size)
        worst = max(e.total for e in estimate_from_args(args, device_type="cuda").values())
        assert worst / 1e9 == pytest.approx(p.memory_gb) and p.memory_gb <= 0.9 * CLUSTER.gpu_memory_gb
        # Pipeline bubble: (p-1)/(v*m) of the microbatch work.
        pp, vp = p.layout.pp, p.layout.vp or 1
        m = 16 // (p.layout.micro_batch_size * CLUSTER.world_size // (p.layout.tp * pp * p.layout.cp))
        work = sum(v for k, v in p.parts.items() if k not in ("bubble", "dp", "optimizer", "total"))
        assert p.parts["bubble"] == pytest.approx(work * (pp - 1) / (vp * m))
    assert plan(base, Cluster(4, 2, gpu_memory_gb=1e-4)) == []


def test_fsdp2_layouts_are_planned_for_an_untied_model():
    """FSDP2 layouts (no pipeline stages) validate for an untied model; their flags parse to the same run."""
    untied = MODEL + ["--untie-embeddings-and-output-weights"]
    plans = [p for p in plan(base_args(untied), CLUSTER) if p.layout.fsdp2]
    assert plans and all(p.layout.pp == 1 and not p.layout.dist_opt for p in plans)
    parsed = A.validate_args(A.parse_args(untied + plans[0].flags + ["--lr", "1e-4", "--train-iters", "1"]), 8)
    assert parsed.use_torch_fsdp2 and not parsed.use_distributed_optimizer
    assert not [p for p in plan(base_args(MODEL), CLUSTER) if p.layout.fsdp2]  # tied: Megatron's refusal


def test_hf_llama_config_gives_the_transformers_parameter_count(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = dict(
        model_type="llama", hidden_size=64, intermediate_size=160, num_attention_heads=8, num_hidden_layers=2,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf))
    count = sum(p.numel() for p in reference.parameters())
    flags = hf_config_flags(str(path)) + ["--seq-length", "64", "--global-batch-size", "2"]
    args = validated_args(base_args(flags), Layout(dist_opt=False), 1)
    args.padded_vocab_size = 256
    assert estimate_from_args(args)[0].num_parameters == count


def test_command_line_prints_a_table(capsys):
    plans = main(["--gpus-per-node", "4", "--num-nodes", "2", "--gpu-memory-gb", "1", "--top", "3", "--"] + MODEL)
    out = capsys.readouterr().out
    assert plans and " ".join(plans[0].flags) in out and "layouts fit" in out


def test_calibration_measures_positive_rates_on_every_rank():
    from tools.plan_parallelism import calibrate

    rates = calibrate(2, bf16=False, shape=(64, 32, 128))
    assert set(rates) == {"gemm_tflops", "memory_gbps", "allreduce_gbps", "collective_latency_us"}
    assert all(0 < v < float("inf") for v in rates.values())
