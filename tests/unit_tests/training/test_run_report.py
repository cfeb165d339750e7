"""Megatron's start-of-run and evaluation lines: the argument dump, the enabled summary, end-of-training labels."""

from __future__ import annotations

import argparse

from megatron.training.run_report import arguments_block, enabled_summary, loaded_line, saved_line
from megatron.training.training_log import format_evaluation_block, parse_evaluation_line


def test_arguments_block_is_megatrons_layout():
    args = argparse.Namespace(lr=0.001, Zeta="z", micro_batch_size=4, add_bias_linear=True)
    lines = arguments_block(args)
    assert lines[0] == "-" * 24 + " arguments " + "-" * 24
    assert lines[-1] == "-" * 20 + " end of arguments " + "-" * 21
    body = lines[1:-1]
    names = [line.split()[0] for line in body]
    assert names == sorted(vars(args), key=str.lower)  # case-insensitive order, as Megatron sorts
    for line in body:  # "  name " + dots up to column 48 + " value": every value starts at column 52
        name, dots, value = line.split()
        assert set(dots) == {"."} and line.index(value, 2 + len(name) + 1 + len(dots)) == 52
        assert str(getattr(args, name)) == value


def test_enabled_summary_names_precision_recipe_layout_and_implementation():
    args = argparse.Namespace(
        bf16=True, fp16=False, fp8="hybrid", fp8_recipe="delayed", fp8_param_gather=False, fp4=None,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1, expert_model_parallel_size=1, data_parallel_size=2, world_size=4,
        sequence_parallel=True, use_distributed_optimizer=False, transformer_impl="local", ckpt_format="torch_dist",
    )  # fmt: skip
    line = enabled_summary(args)
    for part in ("bf16", "FP8 hybrid recipe delayed", "TP=2", "DP=2", "(world 4)", "sequence parallel"):
        assert part in line, (part, line)
    assert "distributed optimizer" not in line and "transformer-impl local" in line and "\n" not in line


def test_checkpoint_lines_carry_iteration_layout_and_time():
    assert saved_line(200, "ckpt", (0, 2, 0, 1), 1.234).startswith(
        "  successfully saved checkpoint from iteration     200 to ckpt [ t 1/2, p 1/1 ] (1.23 s)"
    )
    assert "from ckpt [ t 1/2, p 1/2 ] at iteration 7 (model; 0.50 s)" in loaded_line(
        "ckpt", 7, (0, 2, 0, 2), 0.5, "model"
    )


def test_end_of_training_evaluations_are_labelled_per_split():
    block = format_evaluation_block("validation", "iteration 200 on test set", {"lm loss": 2.0})
    fields = parse_evaluation_line(block.splitlines()[1])
    assert (fields["prefix"], fields["iteration"], fields["final"]) == ("test", 200, True)
    in_loop = parse_evaluation_line(
        format_evaluation_block("validation", "iteration 200", {"lm loss": 2.0}).split("\n")[1]
    )
    assert in_loop["prefix"] == "validation" and "final" not in in_loop


def test_arguments_block_hides_the_servers_api_key():
    lines = arguments_block(argparse.Namespace(api_key="s3cret-token", port=5000))
    assert not any("s3cret-token" in line for line in lines)
    assert any(line.split()[0] == "api_key" and line.split()[-1] == "<hidden>" for line in lines)
    unset = arguments_block(argparse.Namespace(api_key=None))
    assert any(line.split()[0] == "api_key" and line.split()[-1] == "None" for line in unset)
