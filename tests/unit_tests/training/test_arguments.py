"""Flag table conformance, unsupported flags, derived defaults and validation (flags -> configs:
test_flags_to_configs.py)."""

import argparse
import ast
import enum
import filecmp
import os

import pytest

from megatron.core.optimizer import OptimizerConfig
from megatron.training import arguments as A
from megatron.training.flags import derive
from megatron.training.flags.registry import RECORDS, config_from_args, no_op_flags, not_supported_yet
from megatron.training.flags_table import FLAGS_TSV

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
