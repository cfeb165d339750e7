"""Flag table conformance, unsupported flags, derived defaults, validation and config mapping."""

import argparse
import ast
import enum
import filecmp
import os

import pytest
import torch
import torch.nn.functional as F

from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training import arguments as A
from megatron.training.flags import derive
from megatron.training.flags.registry import RECORDS, config_from_args, no_op_flags, not_supported_yet
from megatron.training.flags_table import FLAGS_TSV
from tests.dist_harness import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# The compatibility facts live beside the checkout (shared/docs); CI lays a copy there too.
SHARED_TSV = os.path.join(os.path.dirname(REPO), "shared", "docs", "megatron-flags.tsv")
ENTRY_POINTS = ("gpt", "bert", "t5")
ACTION_KIND = {
    "storetrue": argparse._StoreTrueAction,
    "storefalse": argparse._StoreFalseAction,
    "store": argparse._StoreAction,
}


def _shared_rows():
    """The shared table (else the package's copy), read here independently of the package's loader."""
    with open(SHARED_TSV if os.path.exists(SHARED_TSV) else FLAGS_TSV) as f:
        lines = [l.rstrip("\n").split("\t") for l in f if l.strip() and not l.startswith("#")]
    header, rows = lines[0], lines[1:]
    return [dict(zip(header, row)) for row in rows]


def _sample_words(row):
    """A valid command-line value for a row: its first choice, else '1', repeated per nargs."""
    if row["action"] != "store":
        return []
    word = ast.literal_eval(row["choices"])[0] if row["choices"] else "1"
    count = int(row["nargs"]) if row["nargs"].isdigit() else 1
    return [word] * count


def _as_table_text(value):
    return str(int(value)) if isinstance(value, enum.IntEnum) else str(value)


def _check_parsed(row, value):
    if row["action"] == "storetrue":
        assert value is True, row
        return
    if row["action"] == "storefalse":
        assert value is False, row
        return
    values = value if isinstance(value, list) else [value]
    for v, word in zip(values, _sample_words(row)):
        if row["choices"]:
            assert _as_table_text(v) == word, (row["dest"], v)
        else:
            assert v in (1, "1", (1,)), (row["dest"], v)  # (1,): a tuple flag (--window-size)


def test_repo_table_is_a_copy_of_the_shared_table():
    if not os.path.exists(SHARED_TSV):
        pytest.skip(f"{SHARED_TSV} is not beside this checkout")
    assert os.path.dirname(FLAGS_TSV).endswith(os.path.join("megatron", "training"))
    assert filecmp.cmp(FLAGS_TSV, SHARED_TSV, shallow=False)


def test_parser_matches_table_option_dest_default_choices_nargs_action():
    parser = A.build_megatron_parser()
    by_option = {opt: act for act in parser._actions for opt in act.option_strings}
    for row in _shared_rows():
        options = row["flags"].split()
        action = by_option[options[0]]
        assert sorted(action.option_strings) == sorted(options), row
        assert action.dest == row["dest"]
        assert repr(action.default) == row["default"], (row["dest"], action.default)
        assert type(action) is ACTION_KIND[row["action"]], row["dest"]
        extended = RECORDS[row["dest"]].choices  # this project's extension of the table's choices
        if row["choices"]:
            table = ast.literal_eval(row["choices"])
            assert [str(c) for c in action.choices] == list(extended or table), row["dest"]
            assert set(table) <= {str(c) for c in action.choices}, row["dest"]
        else:
            assert action.choices is None
        if row["action"] == "store":  # store_true/false carry argparse's nargs=0
            assert str(action.nargs) == (row["nargs"] or "None"), row["dest"]


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_every_option_string_parses(entry_point):
    rows = _shared_rows()
    parser = A.build_megatron_parser(entry_point)
    for row in rows:
        for option in row["flags"].split():
            ns = parser.parse_args([option, *_sample_words(row)])
            _check_parsed(row, getattr(ns, row["dest"]))
    # All flags at once through the public entry, as a launch script would pass them.
    argv = [w for row in rows for w in (row["flags"].split()[-1], *_sample_words(row))]
    ns = A.parse_args(argv, entry_point=entry_point)
    for row in rows:
        _check_parsed(row, getattr(ns, row["dest"]))


def test_help_lists_megatron_groups_and_exits_cleanly(capsys):
    # In this process (a python start costs seconds): --help prints and raises SystemExit(0), the clean exit.
    with pytest.raises(SystemExit) as stop:
        A.parse_args(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for group in {row["group"] for row in _shared_rows()}:
        assert f"\n{group}:\n" in out
    assert "not supported yet" in out and "no effect here" in out
    assert "this project's flag; not in Megatron-LM" in " ".join(out.split())  # --no-verify-checkpoint


# ----------------------------------------------------------------------------------
# Unsupported and no-op flag tables.
# ----------------------------------------------------------------------------------
def test_status_tables_name_real_flags_with_default_as_harmless():
    rows = {row["dest"]: row for row in _shared_rows()}
    for dest, status in not_supported_yet().items():
        assert dest in rows, dest
        assert status.accepts(ast.literal_eval(rows[dest]["default"])), dest
    assert set(no_op_flags()) <= set(rows)


BASE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--micro-batch-size",
    "2",
    "--seq-length",
    "32",
    "--train-iters",
    "10",
    "--lr",
    "1e-3",
]


def _validated(extra=(), world_size=1, entry_point="gpt"):
    args = A.parse_args(BASE + list(extra), entry_point=entry_point)
    return A.validate_args(args, world_size)


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--num-experts", "8", "--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type"),
        (["--mtp-num-layers", "1", "--mtp-standalone"], "--mtp-standalone"),
        (["--optimizer", "dist_muon"], "--optimizer"),
        (["--multi-latent-attention", "--cache-mla-latents"], "--cache-mla-latents"),
        (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "custom"], "--fp8-recipe"),
        (["--position-embedding-type", "mrope"], "--position-embedding-type"),
        (["--window-size", "8,0", "--window-attn-skip-freq", "2"], "--window-attn-skip-freq"),
    ],
)
def test_unsupported_flag_is_refused_not_ignored(extra, flag):
    with pytest.raises(A.UnsupportedFlagError) as err:
        _validated(extra, world_size=2)
    assert f"not supported yet: {flag}=" in str(err.value)
    assert isinstance(err.value, SystemExit) and err.value.code  # a non-zero exit for the launcher


def test_muon_flags_fill_the_optimizer_config():
    extra = ["--optimizer", "muon", "--muon-no-split-qkv", "--muon-tp-mode", "duplicated", "--muon-use-nesterov"]
    args = _validated(extra + ["--muon-num-ns-steps", "10", "--muon-extra-scale-factor", "0.2"])
    config = config_from_args(OptimizerConfig, args)
    assert (config.optimizer, config.muon_split_qkv, config.muon_tp_mode, config.muon_use_nesterov) == (
        "muon",
        False,
        "duplicated",
        True,
    )
    assert (config.muon_num_ns_steps, config.muon_extra_scale_factor, config.muon_momentum) == (10, 0.2, 0.9)
    assert config_from_args(OptimizerConfig, _validated(["--optimizer", "muon"])).muon_split_qkv
    # The distributed optimizer keeps each Muon matrix whole on one DP rank (no refusal); dist_muon is refused.
    assert _validated(["--optimizer", "muon", "--use-distributed-optimizer"]).use_distributed_optimizer
    with pytest.raises(A.ArgumentsError, match="dist_muon"):
        _validated(["--optimizer", "dist_muon"])


def test_fp8_flags_fill_the_config_and_need_bf16():
    args = _validated(["--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--no-fp8-wgrad"])
    assert (args.fp8, args.fp8_recipe, args.fp8_amax_history_len, args.fp8_wgrad) == ("hybrid", "delayed", 1024, False)
    with pytest.raises(
        A.ArgumentsError, match="--fp8-format='hybrid', --bf16=False, --fp16=False: FP8 GEMMs with fp32"
    ):
        _validated(["--fp8-format", "hybrid"])


def test_supported_alternatives_and_no_op_flags_are_accepted():
    args = _validated(
        [
            "--optimizer",
            "sgd",
            "--position-embedding-type",
            "rope",
            "--no-masked-softmax-fusion",
            "--attention-backend",
            "flash",
            "--use-flash-attn",
        ]
    )
    assert args.optimizer == "sgd" and args.position_embedding_type == "rope"


# ----------------------------------------------------------------------------------
# Derived defaults.
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("h", [64, 1000, 4096, 5120])
def test_ffn_hidden_size_defaults(h):
    plain = _validated(["--hidden-size", str(h), "--num-attention-heads", "8"])
    assert plain.ffn_hidden_size == 4 * h
    glu = _validated(["--hidden-size", str(h), "--num-attention-heads", "8", "--swiglu"])
    assert glu.ffn_hidden_size == (8 * h // 3) // 64 * 64  # largest multiple of 64 <= 2/3 of 4h
    assert glu.ffn_hidden_size % 64 == 0 and 0 <= 8 * h / 3 - glu.ffn_hidden_size < 64


def test_kv_channels_split_tokenizer_and_batch_defaults():
    args = _validated(["--data-path", "corpus_text_document"], world_size=8)
    assert args.kv_channels == 64 // 4
    assert args.split is None and derive.split(args) == "969, 30, 1"  # derived into the dataset config
    assert args.data_parallel_size == 8 and args.global_batch_size is None
    assert A.training_config_from_args(args).global_batch_size == 2 * 8  # derived: micro batch x DP
    assert args.max_position_embeddings == 32
    assert derive.split(_validated(["--split", "1,0,0", "--data-path", "x"])) == "1,0,0"
    assert derive.split(_validated()) is None
    assert A.parse_args(BASE, entry_point="gpt").tokenizer_type == "GPT2BPETokenizer"
    for ep in ("bert", "t5"):
        assert A.parse_args(BASE, entry_point=ep).tokenizer_type == "BertWordPieceLowerCase"
    assert (
        A.parse_args(BASE + ["--tokenizer-type", "NullTokenizer"], entry_point="bert").tokenizer_type == "NullTokenizer"
    )


def test_data_parallel_size_from_world_and_model_sizes():
    args = _validated(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], world_size=12)
    assert args.data_parallel_size * 2 * 2 == 12


@pytest.mark.parametrize(
    "vocab, div, tp", [(50257, 128, 1), (50257, 128, 8), (32000, 128, 2), (256, 128, 2), (1, 1, 1), (30522, 64, 3)]
)
def test_vocab_padding(vocab, div, tp):
    padded = A.vocab_size_with_padding(vocab, div, tp)
    multiple = div * tp
    assert padded % multiple == 0 and vocab <= padded < vocab + multiple


def test_defaults_argument_fills_only_unset_flags():
    args = A.parse_args(BASE, defaults={"tokenizer_type": "NullTokenizer", "num_layers": 99})
    assert args.tokenizer_type == "NullTokenizer" and args.num_layers == 4


def test_extra_args_provider_and_unknown_args():
    def extra(parser):
        parser.add_argument_group("mine").add_argument("--my-flag", type=int, default=3)
        return parser

    assert A.parse_args(BASE + ["--my-flag", "5"], extra_args_provider=extra).my_flag == 5
    with pytest.raises(SystemExit):
        A.parse_args(BASE + ["--not-a-flag"])
    assert A.parse_args(BASE + ["--not-a-flag"], ignore_unknown_args=True).num_layers == 4


def test_flags_file_reads_a_pasted_launch_block(tmp_path, capsys):
    flags = tmp_path / "gpt.args"
    flags.write_text(
        "# model\n--num-layers 6 --hidden-size 64 \\\n  --num-attention-heads 4  # heads\n\n"
        "--data-path '/data/my corpus_text_document'\n"
    )
    args = A.parse_args(BASE + [f"@{flags}", "--hidden-size", "128"])
    # The file overrides earlier flags, later command-line flags override the file.
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (6, 128, 4)
    assert args.data_path == ["/data/my corpus_text_document"]
    with pytest.raises(SystemExit):
        A.parse_args(BASE + [f"@{tmp_path / 'missing.args'}"])
    assert "missing.args" in capsys.readouterr().err
    flags.write_text("--data-path 'unclosed\n")
    with pytest.raises(SystemExit):
        A.parse_args(BASE + [f"@{flags}"])
    assert "flags file line" in capsys.readouterr().err


# ----------------------------------------------------------------------------------
# Validation errors name their flags.
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, world, pattern",
    [
        (["--global-batch-size", "6"], 2, r"--global-batch-size \(6\).*--micro-batch-size \(2\).*\(2\)"),
        (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"], 1, r"--lr-warmup-fraction.*--lr-warmup-iters"),
        (["--train-samples", "100"], 1, r"--train-iters and --train-samples"),
        (["--tensor-model-parallel-size", "2"], 3, r"world size 3.*--tensor-model-parallel-size \(2\)"),
        (
            ["--tensor-model-parallel-size", "8"],
            8,
            r"--num-attention-heads 4 must be divisible by --tensor-model-parallel-size 8",
        ),
        (["--fp16", "--bf16"], 1, r"--fp16 and --bf16: choose at most one"),
        (["--pipeline-model-parallel-size", "3"], 3, r"--num-layers.*--pipeline-model-parallel-size \(3\)"),
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
            2,
            r"--num-layers-per-virtual-pipeline-stage \(3\)",
        ),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--global-batch-size",
                "6",
            ],
            2,
            r"number of microbatches \(3.*--pipeline-model-parallel-size \(2\)",
        ),
        (
            ["--group-query-attention", "--num-query-groups", "3"],
            1,
            r"--num-attention-heads 4 must be divisible by --num-query-groups 3",
        ),
        (["--batch-size", "4"], 1, r"--batch-size.*--micro-batch-size"),
        (
            ["--recompute-granularity", "full"],
            1,
            r"--recompute-granularity='full', --recompute-method=None: full recomputation with no recomputation",
        ),
        (
            ["--recompute-method", "block"],
            1,
            r"--recompute-method='block', --recompute-granularity=None: a recomputation method with no full",
        ),
        (
            ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]
            + ["--distribute-saved-activations"],
            1,
            r"--distribute-saved-activations=True, --tensor-model-parallel-size=1: saved activations split",
        ),
        (
            ["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size", "4"],
            4,
            r"--num-query-groups 2 must be divisible by --tensor-model-parallel-size 4",
        ),
        (["--hidden-size", "66"], 1, r"--hidden-size 66 must be divisible by --num-attention-heads 4"),
        (["--overlap-param-gather"], 1, r"--overlap-param-gather=True, --use-distributed-optimizer=False: "),
        (["--save-interval", "0"], 1, r"--save-interval 0: must be an integer >= 1"),
        (["--adam-beta1", "1.5"], 1, r"--adam-beta1 1.5"),
        (["--log-interval", "0"], 1, r"--log-interval=0 must be at least 1"),
        (["--window-size", "8"], 1, r"--window-size \(8,\): need \(left, right\) integers"),
        (["--lr-decay-samples", "10"], 1, r"--lr-decay-samples.*--train-samples"),
        (
            ["--num-experts", "6", "--expert-model-parallel-size", "4"],
            4,
            r"--num-experts 6 must be divisible by --expert-model-parallel-size 4",
        ),
        (["--expert-model-parallel-size", "2"], 2, r"--expert-model-parallel-size=2 needs --num-experts"),
        (
            ["--context-parallel-size", "2", "--seq-length", "30"],
            2,
            r"--seq-length 30 must be divisible by 2 x --context-parallel-size 2 = 4",
        ),
        (
            [
                "--context-parallel-size",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--seq-length",
                "36",
            ],
            4,
            r"--seq-length 36 must be divisible by 2 x --context-parallel-size 2 x "
            r"--tensor-model-parallel-size 2 = 8 with --sequence-parallel",
        ),
        (
            ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "33"],
            2,
            r"--seq-length 33 must be divisible by --tensor-model-parallel-size 2 = 2 with --sequence-parallel",
        ),
        (["--context-parallel-size", "2", "--cp-comm-type", "ring"], 2, r"--cp-comm-type 'ring': must be one of"),
        (
            ["--cp-comm-type", "p2p", "a2a", "p2p"],
            1,
            r"--cp-comm-type .*give one value or one per layer \(--num-layers 4\)",
        ),
        (
            ["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"],
            2,
            r"--cp-comm-type 'a2a\+p2p' with --hierarchical-context-parallel-sizes None: needs two sizes "
            r"\[a2a, p2p\] whose product is --context-parallel-size 2",
        ),
        (
            ["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "3"],
            4,
            r"--hierarchical-context-parallel-sizes \[2, 3\]: must be positive integers whose product is "
            r"--context-parallel-size 4",
        ),
        (
            ["--num-experts", "4", "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"],
            2,
            r"world size 2 .*--tensor-model-parallel-size \(2\) x --expert-model-parallel-size \(2\)",
        ),
        (
            ["--num-experts", "4", "--expert-model-parallel-size", "2", "--ckpt-format", "torch"],
            2,
            r"--ckpt-format='torch', --expert-model-parallel-size=2: .* not supported",
        ),
        (
            ["--num-experts", "4", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"],
            2,
            r"world size 2 .*--expert-tensor-parallel-size \(2\) x --expert-model-parallel-size \(2\)",
        ),
        (["--expert-tensor-parallel-size", "2"], 2, r"--expert-tensor-parallel-size=2 needs --num-experts"),
        (
            ["--num-experts", "4", "--expert-tensor-parallel-size", "2", "--ckpt-format", "torch"],
            2,
            r"--ckpt-format='torch', --expert-tensor-parallel-size=2, --tensor-model-parallel-size=1: ",
        ),
    ],
)
def test_validation_errors_name_flags_and_values(extra, world, pattern):
    with pytest.raises(A.ArgumentsError, match=pattern):
        _validated(extra, world_size=world)


def test_expert_tensor_parallel_size_apart_from_tp_fills_the_config():
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"]
    extra = ["--num-experts", "4", "--expert-tensor-parallel-size", "1", "--moe-token-dispatcher-type", "alltoall"]
    args = _validated(layout + extra, world_size=4)
    cfg = A.core_transformer_config_from_args(args)
    assert (cfg.expert_tensor_parallel_size, cfg.tensor_model_parallel_size) == (1, 2)
    assert cfg.moe_token_dispatcher_type == "alltoall"


def test_eval_interval_left_out_is_megatrons_1000():
    """Leaving --eval-interval out used to crash sizing the validation split with a TypeError."""
    from megatron.training.data import samples_per_split

    assert A.parse_args(BASE).eval_interval is None  # the flag table's default column
    cfg = A.training_config_from_args(_validated())
    assert cfg.eval_interval == 1000  # Megatron's argparse default, derived into the config
    batch = cfg.global_batch_size
    assert samples_per_split(cfg) == [10 * batch, (10 // 1000 + 1) * cfg.eval_iters * batch, cfg.eval_iters * batch]
    assert A.training_config_from_args(_validated(["--eval-interval", "3"])).eval_interval == 3
    with pytest.raises(A.ArgumentsError, match=r"--eval-interval=0 must be >= 1"):
        _validated(["--eval-interval", "0"])


def test_train_length_required():
    argv = [w for w in BASE if w not in ("--train-iters", "10")]
    with pytest.raises(A.ArgumentsError, match="--train-iters or --train-samples"):
        A.validate_args(A.parse_args(argv), 1)


def test_sequence_parallel_with_tp1_warns_and_disables():
    with pytest.warns(UserWarning, match="--sequence-parallel with --tensor-model-parallel-size 1: disabling"):
        args = _validated(["--sequence-parallel"])
    assert args.sequence_parallel is False
    assert _validated(["--sequence-parallel", "--tensor-model-parallel-size", "2"], 2).sequence_parallel


def test_virtual_pipeline_and_uneven_stages():
    args = _validated(
        [
            "--num-layers",
            "8",
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "2",
            "--global-batch-size",
            "8",
        ],
        world_size=2,
    )
    assert args.virtual_pipeline_model_parallel_size == 8 // 2 // 2
    ok = _validated(
        ["--num-layers", "7", "--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "1"],
        world_size=3,
    )
    assert ok.decoder_first_pipeline_num_layers == 1


# ----------------------------------------------------------------------------------
# Flags -> configs.
# ----------------------------------------------------------------------------------
def test_context_parallel_size_is_accepted_and_reaches_the_config():
    args = _validated(
        [
            "--context-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--cp-comm-type",
            "all_gather",
        ],
        world_size=8,
    )
    assert args.data_parallel_size == 2
    config = A.core_transformer_config_from_args(args)
    assert config.context_parallel_size == 2 and config.sequence_parallel
    per_layer = _validated(
        ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a", "all_gather", "p2p"], world_size=2
    )
    assert per_layer.cp_comm_type == ["p2p", "a2a", "all_gather", "p2p"]
    assert A.core_transformer_config_from_args(per_layer).cp_comm_type == ["p2p", "a2a", "all_gather", "p2p"]
    nested = _validated(
        [
            "--context-parallel-size",
            "4",
            "--cp-comm-type",
            "a2a+p2p",
            "--hierarchical-context-parallel-sizes",
            "2",
            "2",
        ],
        world_size=4,
    )
    assert A.core_transformer_config_from_args(nested).hierarchical_context_parallel_sizes == [2, 2]


def test_expert_model_parallel_size_is_accepted_and_reaches_the_config():
    args = _validated(
        ["--num-experts", "4", "--expert-model-parallel-size", "2", "--global-batch-size", "8"], world_size=4
    )
    assert args.data_parallel_size == 4
    assert A.core_transformer_config_from_args(args).expert_model_parallel_size == 2


def test_moe_flags_map_to_config():
    args = _validated(
        [
            "--num-experts",
            "8",
            "--moe-router-topk",
            "2",
            "--moe-aux-loss-coeff",
            "1e-2",
            "--moe-z-loss-coeff",
            "1e-3",
            "--moe-layer-freq",
            "([1]*1+[0])*2",
            "--moe-router-pre-softmax",
            "--moe-token-dispatcher-type",
            "alltoall",
            "--moe-grouped-gemm",
        ]
    )
    cfg = A.core_transformer_config_from_args(args)
    moe = (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff)
    assert moe == (8, 2, 1e-2, 1e-3)
    assert cfg.moe_layer_freq == [1, 0, 1, 0] and cfg.moe_router_pre_softmax
    assert cfg.moe_ffn_hidden_size == cfg.ffn_hidden_size == 256
    assert cfg.moe_router_load_balancing_type == "aux_loss" and cfg.moe_token_dispatcher_type == "alltoall"
    assert (
        A.core_transformer_config_from_args(_validated(["--num-experts", "4", "--moe-layer-freq", "2"])).moe_layer_freq
        == 2
    )
    with pytest.raises(A.ArgumentsError, match="--moe-router-topk 9 must be <= --num-experts 8"):
        _validated(["--num-experts", "8", "--moe-router-topk", "9"])
    with pytest.raises(A.ArgumentsError, match="--moe-layer-freq"):
        _validated(["--num-experts", "8", "--moe-layer-freq", "[1,0]"])


def test_transformer_config_from_args():
    args = _validated(
        [
            "--swiglu",
            "--disable-bias-linear",
            "--add-qkv-bias",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--normalization",
            "RMSNorm",
            "--bf16",
            "--hidden-dropout",
            "0.0",
            "--attention-dropout",
            "0.05",
            "--init-method-std",
            "0.01",
            "--qk-layernorm",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--recompute-activations",
            "--calculate-per-token-loss",
            "--apply-layernorm-1p",
            "--norm-epsilon",
            "1e-6",
            "--window-size",
            "(7, 0)",
            "--embedding-init-method-std",
            "0.05",
            "--init-method-xavier-uniform",
        ],
        world_size=2,
    )
    cfg = A.core_transformer_config_from_args(args)
    assert cfg.gated_linear_unit and cfg.activation_func is F.silu
    assert cfg.add_bias_linear is False and cfg.add_qkv_bias is True
    assert cfg.num_query_groups == 2 and cfg.normalization == "RMSNorm"
    assert cfg.params_dtype is torch.bfloat16 and cfg.pipeline_dtype is torch.bfloat16
    assert (cfg.hidden_dropout, cfg.attention_dropout, cfg.init_method_std) == (0.0, 0.05, 0.01)
    assert cfg.qk_layernorm and cfg.sequence_parallel and cfg.tensor_model_parallel_size == 2
    assert cfg.recompute_granularity == "selective" and cfg.calculate_per_token_loss
    assert cfg.layernorm_zero_centered_gamma and cfg.layernorm_epsilon == 1e-6 and cfg.window_size == (7, 0)
    assert cfg.embedding_init_method_std == 0.05
    assert cfg.init_method is torch.nn.init.xavier_uniform_ and cfg.output_layer_init_method is cfg.init_method
    assert cfg.ffn_hidden_size == args.ffn_hidden_size and cfg.num_attention_heads == 4
    plain = A.core_transformer_config_from_args(_validated())
    assert plain.activation_func is F.gelu and plain.num_query_groups == 4 and plain.params_dtype is torch.float32
    assert plain.embedding_init_method_std == plain.init_method_std
    assert plain.init_method is not torch.nn.init.xavier_uniform_


def _entry_point_rotary(rank, world_size, extra):
    import pretrain_gpt
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    args = _validated(extra)
    model = pretrain_gpt.model_provider(config=A.core_transformer_config_from_args(args), args=args)
    return model.rotary_pos_emb.inv_freq


def test_rope_flags_reach_the_entry_point_model():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import llama3_scaled_frequencies

    rope = ["--position-embedding-type", "rope", "--rotary-base", "500000"]
    plain = run_distributed(_entry_point_rotary, 1, rope)[0]
    scaled = run_distributed(_entry_point_rotary, 1, rope + ["--use-rope-scaling", "--rope-scaling-factor", "4"])[0]
    assert torch.equal(plain, 1.0 / 500000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))  # kv_channels 16
    assert torch.equal(scaled, llama3_scaled_frequencies(plain, factor=4.0))


def test_scheduler_kwargs_count_samples():
    args = _validated(
        [
            "--global-batch-size",
            "8",
            "--train-iters",
            "100",
            "--lr-warmup-iters",
            "10",
            "--lr-decay-style",
            "cosine",
            "--min-lr",
            "1e-5",
        ]
    )
    kw = A.optimizer_param_scheduler_kwargs(args)
    assert (kw["lr_warmup_steps"], kw["lr_decay_steps"], kw["wd_incr_steps"]) == (10 * 8, 100 * 8, 100 * 8)
    model = torch.nn.Linear(2, 2)
    sched = OptimizerParamScheduler(torch.optim.SGD(model.parameters(), lr=0.0), **kw)
    sched.step(10 * 8)
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    frac = _validated(["--train-iters", "100", "--lr-warmup-fraction", "0.25", "--lr-decay-iters", "40"])
    kw = A.optimizer_param_scheduler_kwargs(frac)
    assert kw["lr_warmup_steps"] == pytest.approx(0.25 * 40 * A.training_config_from_args(frac).global_batch_size)


def test_encoder_flags_stand_for_num_layers_and_seq_length():
    """Megatron's T5 flags: --encoder-num-layers / --encoder-seq-length instead of --num-layers / --seq-length."""
    plain = list(BASE)
    for flag in ("--num-layers", "--seq-length"):
        del plain[plain.index(flag) : plain.index(flag) + 2]
    t5 = ["--encoder-num-layers", "3", "--encoder-seq-length", "48", "--decoder-seq-length", "16"]
    args = A.validate_args(A.parse_args(plain + t5, entry_point="t5"), 1)
    assert (args.num_layers, args.encoder_num_layers, args.decoder_num_layers) == (3, 3, 3)
    assert (args.seq_length, args.encoder_seq_length, args.decoder_seq_length) == (48, 48, 16)
    assert _validated(["--decoder-num-layers", "2"]).decoder_num_layers == 2
    with pytest.raises(A.ArgumentsError, match=r"--encoder-num-layers=3 and --num-layers=4: give one of the two"):
        _validated(["--encoder-num-layers", "3"])
