"""The compatibility matrix (megatron/core/compatibility.py): its document, and its refusals on the command line.

Each refused row has one command line below that turns on exactly its two features; validation
(pretrain_gpt.py's parse + validate, in-process) must refuse it naming every flag of the row and the
reason. One real ``pretrain_gpt.py`` run shows the refusal ends the process before training.
"""

from __future__ import annotations

import os

import pytest

from megatron.core import compatibility
from megatron.core.compatibility import FEATURES, REFUSED
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import arguments as A
from megatron.training.flags import compatibility as cli
from megatron.training.validation import flag_message
from tests.functional_tests.gpt_runs import REPO, mock_flags, run_gpt, tiny_gpt_flags

MLA = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-head-dim", "8"]
MLA += ["--qk-pos-emb-head-dim", "8", "--v-head-dim", "6", "--position-embedding-type", "rope"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
DIST = ["--use-distributed-optimizer"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]
FSDP2 = ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion", "--untie-embeddings-and-output-weights"]
FP8_GATHER = ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather"]

# (first, second) -> (extra flags, world size): a command line that turns on exactly that refused pair.
EXAMPLES = {
    ("fp4", "fp8"): (["--bf16", "--fp4-format", "e2m1", "--fp8-format", "hybrid"], 1),
    ("fp8", "fp32"): (["--fp8-format", "hybrid"], 1),
    ("fp4", "fp32"): (["--fp4-format", "e2m1"], 1),
    ("first_last_bf16", "fp8_delayed"): (["--bf16", "--fp8-format", "hybrid", "--first-last-layers-bf16"], 1),
    ("fp8_param_gather", "fp4"): (["--bf16", "--fp4-format", "e2m1", "--fp8-param-gather"] + DIST, 2),
    ("fp8_param_gather", "no_fp8"): (["--bf16", "--fp8-param-gather"] + DIST, 2),
    ("fp8_param_gather", "fp8_not_per_tensor"): (
        ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--fp8-param-gather"] + DIST,
        2,
    ),
    ("fp8_param_gather", "no_dist_opt"): (
        ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"] + ["--fp8-param-gather"],
        2,
    ),  # fmt: skip
    ("overlap_param_gather", "no_dist_opt"): (["--overlap-param-gather"], 2),
    ("fsdp_sharded", "no_megatron_fsdp"): (["--data-parallel-sharding-strategy", "optim"] + DIST, 2),
    ("fsdp_sharded", "no_dist_opt"): (FSDP + ["optim_grads"], 2),
    ("fsdp_no_shard", "dist_opt"): (FSDP + ["no_shard"] + DIST, 2),
    ("fsdp_params", "overlap_param_gather"): (FSDP + ["optim_grads_params", "--overlap-param-gather"] + DIST, 2),
    ("fsdp_params", "fp8_param_gather"): (FSDP + ["optim_grads_params"] + FP8_GATHER + DIST, 2),
    ("dist_opt_instances", "no_dist_opt"): (["--num-distributed-optimizer-instances", "2"], 4),
    ("torch_fsdp2", "dist_opt"): (FSDP2 + DIST, 2),
    ("torch_fsdp2", "megatron_fsdp"): (FSDP2 + ["--use-megatron-fsdp"], 2),
    ("torch_fsdp2", "pp"): (FSDP2 + ["--pipeline-model-parallel-size", "2"], 2),
    ("torch_fsdp2", "grad_acc_fusion"): (["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"], 2),
    ("torch_fsdp2", "ckpt_not_torch_dist"): (FSDP2 + ["--ckpt-format", "torch"], 2),
    ("torch_fsdp2", "tied_embeddings"): (["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"], 2),
    ("torch_fsdp2", "fp16"): (FSDP2 + ["--fp16"], 2),
    ("torch_fsdp2", "muon"): (FSDP2 + ["--optimizer", "muon"], 2),
    ("full_recompute", "no_recompute_method"): (["--recompute-granularity", "full"], 1),
    ("recompute_method", "not_full_recompute"): (["--recompute-method", "block"], 1),
    ("distribute_saved", "not_full_recompute"): (
        ["--distribute-saved-activations", "--tensor-model-parallel-size", "2"],
        2,
    ),  # fmt: skip
    ("distribute_saved", "tp1"): (FULL + ["--distribute-saved-activations"], 1),
    ("distribute_saved", "sequence_parallel"): (
        FULL + ["--distribute-saved-activations", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
        2,
    ),
    ("mla", "gqa"): (MLA + ["--group-query-attention", "--num-query-groups", "2"], 1),
    ("mla", "rotary_interleaved"): (MLA + ["--rotary-interleaved"], 1),
    ("mla", "qkv_bias"): (MLA + ["--add-qkv-bias"], 1),
    ("yarn", "not_mla"): (["--rope-type", "yarn"], 1),
    ("rope_scaling", "mla"): (MLA + ["--use-rope-scaling"], 1),
    ("expert_bias", "softmax_router"): (MOE + ["--moe-router-enable-expert-bias"], 1),
    ("pad_to_capacity", "dropless"): (MOE + ["--moe-pad-expert-input-to-capacity"], 1),
    ("shared_expert_gate", "no_shared_experts"): (MOE + ["--moe-shared-expert-gate"], 1),
    ("shared_expert_overlap", "no_shared_experts"): (MOE + ["--moe-shared-expert-overlap"], 1),
    ("ckpt_torch", "ep"): (MOE + ["--expert-model-parallel-size", "2", "--ckpt-format", "torch"], 2),
    ("ckpt_torch", "etp_differs"): (MOE + ["--expert-tensor-parallel-size", "2", "--ckpt-format", "torch"], 2),
    ("vpp", "pp1"): (["--num-layers-per-virtual-pipeline-stage", "1"], 1),
    ("async_save", "np_local"): (
        ["--async-save", "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "/tmp/local"],
        1,
    ),
}


def test_every_refused_pair_has_an_example_and_every_setting_a_flag():
    assert sorted(EXAMPLES) == sorted((r.first, r.second) for r in REFUSED)
    for feature in FEATURES.values():
        for setting in feature.settings:
            assert cli.flag_for(setting).startswith("--"), setting


def test_the_document_is_generated_from_the_matrix():
    with open(os.path.join(REPO, cli.DOC_PATH), encoding="utf-8") as f:
        assert f.read() == cli.render(), (
            f"stale: run python -m megatron.training.flags.compatibility --write {cli.DOC_PATH}"
        )


@pytest.mark.parametrize("rule", REFUSED, ids=lambda r: f"{r.first}-{r.second}")
def test_pretrain_gpt_validation_refuses_each_pair_naming_both_flags(rule):
    extra, world = EXAMPLES[(rule.first, rule.second)]
    args = A.parse_args(tiny_gpt_flags(2) + mock_flags() + extra, entry_point="gpt")
    with pytest.raises(A.ArgumentsError) as caught:
        A.validate_args(args, world)
    message = str(caught.value)
    for setting in compatibility.settings_of(rule):
        assert cli.flag_for(setting) in message, (setting, message)
    assert (
        flag_message(None, rule.reason) in message
        and FEATURES[rule.first].text in message
        and FEATURES[rule.second].text in message
    )


def test_each_feature_alone_is_accepted():
    """The refusal is the pair's: FP8 with bf16, or fp32 without FP8, validates."""
    for extra in ([], ["--bf16", "--fp8-format", "hybrid"], ["--bf16", "--fp4-format", "e2m1"]):
        A.validate_args(A.parse_args(tiny_gpt_flags(2) + mock_flags() + extra, entry_point="gpt"), 1)


def test_the_configs_read_the_same_rows():
    """A library caller building TransformerConfig directly is refused by the same row and reason."""
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
    with pytest.raises(ValueError, match="one low-precision GEMM format at a time"):
        TransformerConfig(**base, bf16=True, fp8="hybrid", fp4="e2m1")
    with pytest.raises(ValueError, match="saved activations split over TP with tensor-parallel size 1"):
        TransformerConfig(**base, recompute_granularity="full", recompute_method="uniform",
                          distribute_saved_activations=True)  # fmt: skip
    TransformerConfig(**base, bf16=True, fp8="hybrid")  # each alone: fine


def test_pretrain_gpt_exits_before_training_naming_both_flags(tmp_path):
    flags = tiny_gpt_flags(2) + mock_flags() + ["--fp4-format", "e2m1", "--fp8-format", "hybrid", "--bf16"]
    flags += ["--distributed-backend", "gloo"]
    result = run_gpt(1, flags, cwd=str(tmp_path), timeout=120)
    assert result.returncode != 0
    assert "--fp4-format='e2m1'" in result.output and "--fp8-format='hybrid'" in result.output
    assert "choose FP8 or FP4" in result.output
    assert not result.lines, "no iteration may run"
    assert "building GPT model" not in result.output


def test_the_write_and_check_commands(tmp_path):
    path = str(tmp_path / "COMPATIBILITY.md")
    assert cli.main(["--write", path]) == 0
    assert cli.main(["--check", path]) == 0
    with open(path, "a", encoding="utf-8") as f:
        f.write("edited by hand\n")
    assert cli.main(["--check", path]) == 1
