"""Rules for training only (``megatron/training/training_validation.py``): ``pretrain`` refuses the layout at
start-up, while ``validate_args`` (shared with the tools) and the text-generation server's start-up accept it.

The entry point itself (``pretrain_gpt.py`` exiting with the message before any rank meets another) is
``tests/fault/test_newcomer_mistakes.py::test_moe_with_tensor_parallelism_and_no_sequence_parallelism``.
"""

import pytest

import megatron.training.initialize as initialize
from megatron.training import arguments as A
from megatron.training.training import pretrain
from megatron.training.training_validation import validate_training_args
from tests.functional_tests.gpt_runs import mock_flags, tiny_gpt_flags, with_flags
from tools.text_generation.model_loading import load_served_model

MOE_TP2 = ["--num-experts", "4", "--tensor-model-parallel-size", "2"]
MESSAGE = "--num-experts 4 with --tensor-model-parallel-size 2 needs --sequence-parallel to train"


class _RanksStarting(Exception):
    """Raised where torch.distributed would start: every start-up check before it has passed."""


def _stop_before_ranks(*_args, **_kwargs):
    raise _RanksStarting


def test_moe_tp_without_sp_refused_for_training_only(monkeypatch):
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)  # rank 0 of 2, as torchrun starts it
    monkeypatch.setattr(initialize, "initialize_distributed", _stop_before_ranks)
    train_flags = tiny_gpt_flags(2) + mock_flags() + MOE_TP2

    args = A.validate_args(A.parse_args(train_flags), 2)  # the shared validation accepts the layout
    assert (args.num_experts, args.tensor_model_parallel_size, args.sequence_parallel) == (4, 2, False)
    with pytest.raises(SystemExit, match=MESSAGE) as refused:
        validate_training_args(args)
    assert refused.value.code  # non-zero

    with pytest.raises(SystemExit, match=MESSAGE):  # pretrain (every pretrain_*.py) stops before the ranks start
        pretrain(None, None, None, None, argv=train_flags)
    for accepted in (["--sequence-parallel"], ["--skip-train"]):  # the rule's two ways out
        with pytest.raises(_RanksStarting):
            pretrain(None, None, None, None, argv=train_flags + accepted)

    serve_flags = with_flags(train_flags, {"--train-iters": None}) + ["--load", "unused", "--port", "0"]
    with pytest.raises(_RanksStarting):  # the server serves the layout (its MoE layers run in eval mode)
        load_served_model(None, argv=serve_flags)
