"""Every flag has one record; every config field has exactly one source; help and refusal come from the records."""

import argparse

import pytest

from megatron.training import arguments as A
from megatron.training.flags import registry as R
from megatron.training.flags.record import Fill, Flag, NoOp, NotSupportedYet
from megatron.training.flags_table import load_flag_specs

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "2"]
BASE += ["--seq-length", "32", "--train-iters", "10", "--lr", "1e-3"]


def test_every_table_flag_has_exactly_one_record_with_a_status():
    table = [spec.dest for spec in load_flag_specs()]
    assert len(set(table)) == len(table)
    missing = sorted(set(table) - set(R.RECORDS))
    assert not missing, f"flags without a record (give each a status): {missing}"
    project = {d for d, r in R.RECORDS.items() if r.project is not None}
    assert set(R.RECORDS) == set(table) | project, sorted(set(R.RECORDS) - set(table) - project)
    assert not project & set(table)


def _sources(target):
    """Every field of ``target`` with the names of what fills it (records and not-a-flag entries)."""
    found = {name: [] for name in R.target_fields(target)}
    for record in R.RECORDS.values():
        for fill in record.fills:
            if issubclass(target, fill.target):  # a base class's fill holds for its subclasses
                found.setdefault(fill.field_for(record.dest), []).append(record.dest)
    for name in R.not_a_flag(target):
        found.setdefault(name, []).append("NOT_A_FLAG")
    return found


@pytest.mark.parametrize("target", R.CONFIG_TARGETS, ids=lambda t: t.__name__)
def test_every_config_field_has_exactly_one_source(target):
    sources = _sources(target)
    fields = set(R.target_fields(target))
    assert not set(sources) - fields, f"{target.__name__}: records fill fields it lacks: {set(sources) - fields}"
    bad = {name: who for name, who in sources.items() if len(who) != 1}
    assert not bad, f"{target.__name__}: fields with no source or several: {bad}"
    for reason in R.not_a_flag(target).values():
        assert reason.reason


def test_two_records_filling_one_field_are_refused(monkeypatch):
    from megatron.core.transformer.transformer_config import TransformerConfig

    doubled = R._ALL + (Flag("fp16", R.RECORDS["fp16"].status, fills=(Fill(TransformerConfig, "bf16"),)),)
    monkeypatch.setattr(R, "_ALL", doubled)
    R.fills_of.cache_clear()
    try:
        with pytest.raises(ValueError, match="TransformerConfig.bf16 is filled by both bf16 and fp16"):
            R.fills_of(TransformerConfig)
    finally:
        R.fills_of.cache_clear()


def test_every_config_builds_from_validated_default_flags():
    args = A.validate_args(A.parse_args(BASE), 1)
    args.padded_vocab_size = 128
    for target in R.CONFIG_TARGETS:
        kwargs = R.config_kwargs(target, args)
        assert set(kwargs) <= set(R.target_fields(target))
    assert A.ddp_config_from_args(args).bucket_size == args.ddp_bucket_size
    assert A.optimizer_config_from_args(args).params_dtype == args.params_dtype
    assert A.flops_config_from_args(args).padded_vocab_size == 128


def test_renamed_and_derived_fields_take_their_flags():
    args = A.validate_args(
        A.parse_args(BASE + ["--bf16", "--ddp-bucket-size", "1000", "--ddp-average-in-collective", "--swiglu"]), 1
    )
    ddp = A.ddp_config_from_args(args)
    assert (ddp.bucket_size, ddp.average_in_collective, ddp.grad_reduce_in_fp32) == (1000, True, True)
    cfg = A.core_transformer_config_from_args(args)
    assert cfg.gated_linear_unit and cfg.params_dtype == A.optimizer_config_from_args(args).params_dtype
    assert str(cfg.params_dtype) == "torch.bfloat16"


def test_unknown_override_is_a_type_error_naming_it():
    args = A.validate_args(A.parse_args(BASE), 1)
    with pytest.raises(TypeError, match="no_such_field"):
        R.config_from_args(R.CONFIG_TARGETS[1], args, no_such_field=1)


def test_help_is_generated_from_the_records():
    parser = A.build_megatron_parser()
    helps = {a.dest: a.help for a in parser._actions}
    for dest, record in R.RECORDS.items():
        if isinstance(record.status, NoOp):
            assert "no effect here: " + record.status.reason in helps[dest].replace("%%", "%"), dest
        elif isinstance(record.status, NotSupportedYet):
            assert "not supported yet" in helps[dest], dest
        if record.help:
            assert helps[dest].startswith(record.help.replace("%", "%%")), dest
    assert "no effect here" in helps["tp_comm_overlap_ag"] and "no effect here" not in helps["overlap_p2p_comm"]


def test_refusal_follows_the_record(monkeypatch):
    """A flag becomes refusable by editing its record alone."""
    argv = BASE + ["--log-interval", "7"]
    A.validate_args(A.parse_args(argv), 1)
    record = R.RECORDS["log_interval"]
    monkeypatch.setitem(R.RECORDS, "log_interval", Flag(record.dest, NotSupportedYet((100,)), fills=record.fills))
    with pytest.raises(A.UnsupportedFlagError, match="not supported yet: --log-interval=7"):
        A.validate_args(A.parse_args(argv), 1)


def test_args_namespace_is_not_read_with_hasattr():
    """Fills read declared flags only: a namespace lacking one fails loudly instead of taking a default."""
    args = A.validate_args(A.parse_args(BASE), 1)
    del args.ddp_bucket_size
    with pytest.raises(AttributeError, match="ddp_bucket_size"):
        A.ddp_config_from_args(argparse.Namespace(**vars(args)))


class _Tokenizer:
    eod = 0


def test_dataset_config_from_data_flags():
    import pretrain_gpt

    tok = _Tokenizer()
    args = A.validate_args(A.parse_args(BASE + ["--data-path", "0.3", "a", "0.7", "b", "--reset-attention-mask"]), 1)
    cfg = pretrain_gpt.dataset_config(args, tokenizer=tok)
    assert (cfg.blend, cfg.blend_per_split, cfg.split) == ((["a", "b"], [0.3, 0.7]), None, "969, 30, 1")
    assert (cfg.sequence_length, cfg.random_seed, cfg.tokenizer) == (32, args.seed, tok)
    assert cfg.reset_attention_mask and cfg.create_attention_mask
    args = A.validate_args(A.parse_args(BASE + ["--train-data-path", "t", "--valid-data-path", "v"]), 1)
    cfg = pretrain_gpt.dataset_config(args, tokenizer=tok)
    assert (cfg.blend, cfg.split) == (None, None) and not cfg.create_attention_mask
    assert cfg.blend_per_split == [(["t"], None), (["v"], None), None]


def test_implemented_flags_are_read_by_the_code():
    """A flag marked IMPLEMENTED fills a config field, is named by code outside the records (or by a derivation
    of ``flags/derive.py``), or is acted on through its record (``replaced_by``, ``stands_for``)."""
    import os
    import re

    from megatron.training.flags.record import Implemented

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    paths = [os.path.join(root, name) for name in os.listdir(root) if name.startswith("pretrain_")]
    for folder, _, files in os.walk(os.path.join(root, "megatron")):
        if not folder.endswith(os.path.join("training", "flags")):
            paths += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    paths.append(os.path.join(root, "megatron", "training", "flags", "derive.py"))
    code = "\n".join(open(p, encoding="utf-8").read() for p in paths)
    unread = [
        dest
        for dest, record in R.RECORDS.items()
        if isinstance(record.status, Implemented)
        and not (record.fills or record.replaced_by or record.stands_for)
        and not re.search(rf"\b{dest}\b", code)
    ]
    assert not unread, f"IMPLEMENTED but read nowhere (mark them no_op or not_yet): {unread}"
