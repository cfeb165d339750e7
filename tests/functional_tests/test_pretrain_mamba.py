"""``pretrain_mamba.py`` prints the one-rank losses under DP=2 with the distributed optimizer, TP=2 with
sequence parallelism and PP=2 (a ``M*M-`` hybrid, mock data, CPU initialization so every layout starts from
the same weights; the vocabulary padded to the same size for TP=1 and TP=2). Full tier: the model-level
sibling is ``tests/unit_tests/ssm/test_mamba_models.py`` (loss and every gradient under TP+SP and PP), and
``test_example_scripts.py`` runs Megatron's hybrid example flags through this entry point in the default tier.
"""

import os

import pytest

from tests.functional_tests.gpt_runs import REPO, assert_ok, run_gpt

FLAGS = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64"
FLAGS += " --hybrid-override-pattern M*M- --mamba-state-dim 16 --mamba-head-dim 16 --mamba-num-groups 2"
FLAGS += " --position-embedding-type none --normalization RMSNorm --disable-bias-linear --squared-relu"
FLAGS += " --untie-embeddings-and-output-weights --micro-batch-size 2 --global-batch-size 8 --train-iters 3"
FLAGS += " --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 600 --num-workers 0 --log-interval 1"
FLAGS += " --transformer-impl local --use-cpu-initialization --attention-dropout 0 --hidden-dropout 0"
FLAGS += " --eval-iters 0 --make-vocab-size-divisible-by 64"
LAYOUTS = {
    "dp2 distributed optimizer": ["--use-distributed-optimizer"],
    "tp2 sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}


def test_layouts_print_the_one_rank_losses(tmp_path):
    script = [os.path.join(REPO, "pretrain_mamba.py")]
    reference = run_gpt(1, FLAGS.split(), str(tmp_path), script=script)
    assert_ok(reference, "one rank")
    for name, extra in LAYOUTS.items():
        result = run_gpt(2, FLAGS.split() + extra, str(tmp_path), script=script)
        assert_ok(result, name)
        assert result.losses() == pytest.approx(reference.losses(), rel=1e-5), name
        assert len(result.losses()) == 3, name
