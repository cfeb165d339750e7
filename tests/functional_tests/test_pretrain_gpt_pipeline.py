"""Pipeline layouts through the command line print the PP=1 losses.

With --use-cpu-initialization (each layer seeded by its global number), dropout off and
the same global batch, PP=2, PP=2 with two virtual chunks (interleaved 1F1B), TP=2 x PP=2 and
a custom --pipeline-model-parallel-layout print the same ``lm loss`` as one rank, to the printed
7 digits but for last-digit float noise (relative 2e-6).
"""

import math

import pytest

from tests.functional_tests.gpt_runs import assert_ok, mock_flags, run_gpt, tiny_gpt_flags

ITERS = 4
REL_TOL = 2e-6


def _flags():
    flags = tiny_gpt_flags(ITERS) + mock_flags()
    flags[flags.index("--num-layers") + 1] = "4"
    return flags


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    result = run_gpt(1, _flags(), str(tmp_path_factory.mktemp("pp1")))
    assert_ok(result, "PP=1")
    assert len(result.losses()) == ITERS
    return result.losses()


@pytest.mark.parametrize(
    "nproc, layout",
    [
        (2, ["--pipeline-model-parallel-size", "2"]),
        (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
        (4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]),
        # Megatron's custom layout: 1 + 0 layers on rank 0's two chunks, 2 + 1 on rank 1's (two chunks derived).
        (2, ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tt||tL"]),
    ],
    ids=["pp2", "pp2-vp2", "tp2-pp2", "pp2-custom-layout"],
)
def test_pipeline_layout_prints_single_rank_losses(reference, nproc, layout, tmp_path):
    result = run_gpt(nproc, _flags() + layout, str(tmp_path))
    assert_ok(result, " ".join(layout))
    losses = result.losses()
    assert len(losses) == ITERS
    for i, (got, want) in enumerate(zip(losses, reference)):
        assert math.isclose(got, want, rel_tol=REL_TOL), f"{layout} iteration {i + 1}: {got} vs {want}"


@pytest.mark.parametrize(
    "layout, message",
    [
        (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], "not divisible by the 2 pipeline stages"),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--global-batch-size",
                "6",
            ],
            "multiple of --pipeline-model-parallel-size",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split"],
            "--account-for-embedding-in-pipeline-split",  # 4 layers + the embedding: 5 slots on 2 stages
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|ttL"],
            "it holds 3 decoder layers (t), --num-layers 4",
        ),
    ],
    ids=["layers-vs-stages", "interleave-microbatches", "embedding-slot", "layout-layers"],
)
def test_invalid_pipeline_layouts_fail_at_validation(layout, message, tmp_path):
    flags = _flags()
    for i in range(0, len(layout), 2):
        if layout[i] in flags:
            flags[flags.index(layout[i]) + 1] = layout[i + 1]
        else:
            flags += layout[i : i + 2]
    result = run_gpt(2, flags, str(tmp_path))
    assert result.returncode != 0 and message in result.output, result.output[-3000:]
    assert not result.lines, "training started despite an invalid layout"
