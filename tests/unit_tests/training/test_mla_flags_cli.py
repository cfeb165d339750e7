"""Multi-latent attention and shared-expert flags: they fill the config, bad combinations are refused
naming the flags, and a scaled-down DeepSeek-V3 flag set (with multi-token prediction) trains through
pretrain_gpt.py with the same losses on one rank, on TP=2 with sequence parallelism (full tier), PP=2 and CP=2."""

import pytest

from megatron.training import arguments as A
from tests.functional_tests.gpt_runs import assert_ok, mock_flags, run_gpt, tiny_gpt_flags
from tests.unit_tests.training.test_arguments import BASE

MLA_FLAGS = [
    "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-head-dim", "8",
    "--qk-pos-emb-head-dim", "8", "--v-head-dim", "6", "--qk-layernorm", "--rotary-scaling-factor", "4",
    "--mscale", "0.9", "--mscale-all-dim", "0.7", "--normalization", "RMSNorm", "--swiglu",
    "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
]  # fmt: skip
MOE_FLAGS = [
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--moe-layer-freq", "[0]*1+[1]*1",
    "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
    "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor", "2.5",
    "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-overlap", "--moe-router-dtype", "fp32",
]  # fmt: skip


def _config_of(extra, world_size=1):
    args = A.parse_args(BASE + list(extra), entry_point="gpt")
    return A.core_transformer_config_from_args(A.validate_args(args, world_size))


def test_mla_and_shared_expert_flags_fill_the_config():
    cfg = _config_of(MLA_FLAGS + ["--num-experts", "4", "--moe-shared-expert-intermediate-size", "32"])
    assert cfg.multi_latent_attention and cfg.rope_type == "yarn"  # MLA's default RoPE, as in Megatron
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (
        16,
        12,
        8,
        8,
        6,
    )
    assert (cfg.rotary_scaling_factor, cfg.mscale, cfg.mscale_all_dim) == (4.0, 0.9, 0.7)
    assert cfg.moe_shared_expert_intermediate_size == 32 and not cfg.moe_shared_expert_gate
    assert _config_of(MLA_FLAGS + ["--rope-type", "rope"]).rope_type == "rope"


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--rope-type", "yarn"], "--rope-type='yarn', --multi-latent-attention=False: YaRN"),
        (["--num-experts", "4", "--moe-shared-expert-gate"], "--moe-shared-expert-intermediate-size"),
        (MLA_FLAGS + ["--rotary-scaling-factor", "0.5"], "--rotary-scaling-factor 0.5: must be >= 1"),
        (
            MLA_FLAGS + ["--group-query-attention", "--num-query-groups", "2"],
            "--multi-latent-attention=True, --num-query-groups=2",
        ),
        (MLA_FLAGS + ["--cache-mla-latents"], "not supported yet.*--cache-mla-latents"),
        (MLA_FLAGS + ["--use-rope-scaling"], "--use-rope-scaling=True, --multi-latent-attention=True: "),
    ],
)
def test_bad_combinations_are_refused_naming_the_flags(extra, named):
    with pytest.raises(A.ArgumentsError, match=named):
        _config_of(extra, world_size=2)


FLAGS = tiny_gpt_flags(3) + mock_flags() + MLA_FLAGS + MOE_FLAGS + ["--lr-warmup-iters", "1"]
FLAGS += ["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3", "--save-interval", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    """The one-rank reference and the PP=2 run, each saving iterations 2 and 3: (runs, checkpoint dirs, cwd)."""
    cwd = tmp_path_factory.mktemp("deepseek_v3_flags")
    saves = {name: str(cwd / f"ckpt_{name}") for name in ("one", "pp2")}
    runs = {
        "one rank": run_gpt(1, FLAGS + ["--save", saves["one"]], cwd=str(cwd)),
        "pp2": run_gpt(2, FLAGS + PP2 + ["--save", saves["pp2"]], cwd=str(cwd)),
    }
    return runs, saves, str(cwd)


def _check_against_one_rank(saved, runs, resumed):
    """Every run prints the one-rank ``lm loss`` and ``mtp_1 loss`` (resumed runs: its third iteration)."""
    for name, result in {"one rank": saved["one rank"], **runs, **resumed}.items():
        assert_ok(result, f"pretrain_gpt.py with DeepSeek-V3's flags ({name})")
        assert len(result.losses()) == (1 if name in resumed else 3), result.output[-3000:]
    reference = saved["one rank"]
    mtp_losses = [line["mtp_1 loss"] for line in reference.lines]
    assert all(loss > 1.0 for loss in mtp_losses), reference.output[-3000:]
    for name, result in {**runs, **resumed}.items():
        first = 0 if name in runs else 2
        assert result.losses() == pytest.approx(reference.losses()[first:], rel=2e-6), name
        assert [line["mtp_1 loss"] for line in result.lines] == pytest.approx(mtp_losses[first:], rel=2e-6), name


def test_deepseek_v3_flags_print_the_one_rank_losses_under_pp_and_cp(saved_runs):
    """CPU initialization, dropout 0, no balance loss: PP=2 (multi-token prediction and its embedding
    copy on the last stage) and CP=2 (the MTP shift across the CP chunks) print the one-rank ``lm loss``
    and ``mtp_1 loss`` (relative 2e-6: the printed digits but for float noise), expert bias updates and
    the MTP gradient included. The one-rank checkpoint of iteration 2 resumes under PP=2 with the
    one-rank third iteration (the last stage's embedding copy is read from the first stage's key).
    TP=2 with SP, and the PP=2 checkpoint resumed on one rank: the full-tier test below."""
    saved, saves, cwd = saved_runs
    runs = {"pp2": saved["pp2"], "cp2": run_gpt(2, FLAGS + ["--context-parallel-size", "2"], cwd=cwd)}
    resumed = {"pp2 from one rank": run_gpt(2, FLAGS + PP2 + ["--load", saves["one"], "--ckpt-step", "2"], cwd=cwd)}
    _check_against_one_rank(saved, runs, resumed)


@pytest.mark.full  # default sibling: the test above (the same flags and checks; MLA+MTP under TP+SP in
# tests/unit_tests/models/test_mla_parallel_parity.py)
def test_deepseek_v3_flags_print_the_one_rank_losses_under_tp_sp_and_resume_pp2_on_one_rank(saved_runs):
    """As above under TP=2 with SP; the PP=2 checkpoint of iteration 2 resumes on one rank."""
    saved, saves, cwd = saved_runs
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    runs = {"tp2 sp": run_gpt(2, FLAGS + tp2, cwd=cwd)}
    resumed = {"one rank from pp2": run_gpt(1, FLAGS + ["--load", saves["pp2"], "--ckpt-step", "2"], cwd=cwd)}
    _check_against_one_rank(saved, runs, resumed)
