"""Shared pytest setup: keep torch to one thread per process on the 2-core machines, and the two tiers.

The default tier (``bash scripts/run_tests.sh``, or plain ``python -m pytest``) runs at least one test of
every feature and layout family (aiming at 12 minutes on 2 cores); paths or node ids given by name run all
their tests. ``FULL_ONLY`` lists the tests only the
full tier runs (``bash scripts/run_tests.sh --full`` or ``RUN_FULL=1``; ``.ci/run`` runs both), each with
the default-tier sibling that covers its family; ``tests/tiers.py`` holds the rule and its check. A test
can also carry ``@pytest.mark.full`` itself; ``slow`` and ``RUN_SLOW=1``, the former names, are still honoured.
"""

import os

import pytest
from _pytest.config import Config

from tests.tiers import full_only_reason, stale_entries, tier_problems

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The fused regions (megatron/core/fusions) run eagerly in tests, the same math without minutes of
# Inductor compiles per spawned rank; tests/unit_tests/fusions compiles them on purpose.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# node id, test function (all its parameters) or whole file -> the default-tier test that covers its family
FULL_ONLY = {  # one key per entry, however long
    "tests/unit_tests/fusions/test_fused_ops.py::test_compiled_fused_ops_match_their_references": (
        "test_fused_ops_match_their_references (the same regions, eager) and "
        "test_fused_regions_compile_once_per_shape (a region compiled, its graphs counted)"
    ),
    "tests/fault/test_async_save_faults.py::test_kill_during_async_save_keeps_the_last_complete_checkpoint[kill-before-publish]": (  # noqa: E501
        "[kill-writer]: the tracker is written only in the finalization"
    ),
    "tests/fault/test_async_save_faults.py::test_kill_during_async_save_keeps_the_last_complete_checkpoint[kill-before-tracker]": (  # noqa: E501
        "[kill-writer]: the tracker is written only in the finalization"
    ),
    "tests/functional_tests/test_pretrain_gpt.py::test_resume_with_dropout_reproduces_the_straight_run_bitwise[tp2pp2]": (  # noqa: E501
        "[tp2] and [pp2] resume bitwise"
    ),
    "tests/functional_tests/test_pretrain_bert.py::test_layouts_print_the_one_rank_losses[dp2]": (  # noqa: E501
        "BERT tp2/tp2_sp/pp2 layouts; DP is the GPT layouts' and the data-parallel tests'"
    ),
    "tests/unit_tests/tools/test_convert_qwen.py::test_convert_train_export[qwen2-1]": (  # noqa: E501
        "the qwen3_moe round trip; Qwen2 logits in test_qwen_hf_parity"
    ),
    "tests/unit_tests/tools/test_convert_qwen.py::test_convert_train_export[qwen3-2]": (  # noqa: E501
        "qwen3_moe's round trip (the same QK-layernorm attention)"
    ),
    "tests/unit_tests/tools/test_checkpoint_convert_t5.py::test_convert_train_export[tp1]": "[tp2]",
    "tests/unit_tests/distributed/test_data_parallel.py::test_dp_training_equals_single_rank[4-1]": "[4-2]",
    "tests/unit_tests/transformer/test_moe_expert_parallel.py::test_ep2_training_with_clipping_equals_single_rank[4-1]": (  # noqa: E501
        "[4-2]"
    ),
    "tests/unit_tests/transformer/test_moe_alltoall_etp.py::test_etp_alltoall_training_with_distributed_optimizer_equals_single_rank[2-1-1-True]": (  # noqa: E501
        "[2-2-1-True] (ETP=1 under TP=2+SP, all-to-all)"
    ),
    # Example scripts: the GPT family keeps gpt3's script, MoE keeps DeepSeek-V3's (MLA, MTP, EP), and
    # examples/quickstart.sh the corpus/tokenizer/preprocess path; BERT and T5 keep their Megatron scripts.
    "tests/functional_tests/test_example_scripts.py::test_example_script_runs_at_toy_size[examples/llama/train_llama3_8b_distributed.sh]": (  # noqa: E501
        "[examples/gpt3/train_gpt3_175b_distributed.sh] (same entry point); bf16 in test_pretrain_gpt_precision"
    ),
    "tests/functional_tests/test_example_scripts.py::test_example_script_runs_at_toy_size[examples/pretrain_gpt_multinode.sh]": (  # noqa: E501
        "[examples/gpt3/train_gpt3_175b_distributed.sh] (same torchrun entry point)"
    ),
    "tests/functional_tests/test_example_scripts.py::test_example_script_runs_at_toy_size[examples/slurm/pretrain_gpt.sbatch]": (  # noqa: E501
        "test_slurm_launch_and_signal.py; .ci/run's Slurm stage runs it under sbatch"
    ),
    "tests/functional_tests/test_example_scripts.py::test_example_script_runs_at_toy_size[examples/mixtral/train_mixtral_8x7b_distributed.sh]": (  # noqa: E501
        "[examples/deepseek_v3/train_deepseek_v3_distributed.sh] (EP=2 MoE)"
    ),
    "tests/functional_tests/test_example_scripts.py::test_example_script_runs_at_toy_size[examples/qwen3_moe/train_qwen3_moe_30b_a3b_distributed.sh]": (  # noqa: E501
        "[examples/deepseek_v3/...] and test_pretrain_gpt_moe's all-to-all TP2 EP2 run"
    ),
    "tests/functional_tests/test_example_scripts.py::test_example_script_runs_at_toy_size[examples/bert/quickstart.sh]": (  # noqa: E501
        "[examples/quickstart.sh] (corpus, tokenizer, preprocessing) and test_pretrain_bert"
    ),
    "tests/functional_tests/test_example_scripts.py::test_example_script_runs_at_toy_size[examples/t5/quickstart.sh]": (  # noqa: E501
        "[examples/quickstart.sh] (corpus, tokenizer, preprocessing) and test_pretrain_t5"
    ),
    "tests/functional_tests/test_example_scripts.py::test_example_script_runs_at_toy_size[examples/finetune/finetune.sh]": (  # noqa: E501
        "test_packed_sequences (packed == alone, TP/SP/PP/CP), test_sft_dataset, test_chat_completions and "
        "test_checkpoint_convert cover its stages (about 6 minutes end to end)"
    ),
    "tests/functional_tests/test_pretrain_gpt.py::test_mock_data_layouts_agree": (
        "test_tp2_and_dp2_print_the_single_rank_losses; mock data in resume[pp2] and the example scripts"
    ),
    "tests/functional_tests/test_pretrain_gpt_pipeline.py::test_pipeline_layout_prints_single_rank_losses[pp2]": (  # noqa: E501
        "[tp2-pp2] and [pp2-vp2]"
    ),
    "tests/functional_tests/test_pretrain_gpt_moe.py::test_moe_tp2_prints_the_single_rank_losses": (
        "test_moe_alltoall_etp1_tp2_ep2_prints_the_single_rank_losses (MoE under TP=2)"
    ),
    "tests/functional_tests/test_pretrain_bert.py::test_layouts_print_the_one_rank_losses[tp2]": "[tp2_sp]",
    "tests/functional_tests/test_pretrain_t5.py::test_layouts_print_the_one_rank_loss[tp2]": "[tp2_sp]",
    "tests/functional_tests/test_pretrain_t5.py::test_layouts_print_the_one_rank_loss[dp2]": (
        "[tp2_sp]; DP is the GPT layouts' and the data-parallel tests'"
    ),
    "tests/unit_tests/tools/test_convert_qwen.py::test_convert_train_export[mistral-1]": (
        "test_round_trip_is_exact (Mistral's names, sliding window); [qwen3_moe-2] the train and export path"
    ),
    "tests/unit_tests/tools/test_convert_qwen.py::test_convert_train_export[mixtral-2]": (
        "test_round_trip_is_exact (Mixtral's expert names); [qwen3_moe-2] the MoE train and export path"
    ),
    "tests/unit_tests/tools/test_checkpoint_convert.py::test_hf_to_megatron_logits[1]": "[2]",
    "tests/unit_tests/inference/test_engine_hf.py::test_greedy_equals_hugging_face[tp2-and-pp2]": (
        "test_engine_tp2_pp2.py::test_tp2_pp2_equals_hugging_face (the same greedy body under TP=2 and PP=2 at once)"
    ),
    "tests/unit_tests/distributed/test_data_parallel.py::test_dp_training_equals_single_rank[2-1]": (
        "[4-2] (DP=2, there under TP=2)"
    ),
    "tests/unit_tests/optimizer/test_distributed_optimizer.py::test_distributed_optimizer_state_is_sharded_and_portable[2]": (  # noqa: E501
        "[4] (the state sharded over 4 ranks and loaded elsewhere)"
    ),
    # The fake-CUDA dry-run grid: the default tier runs 7 of its 12 cases (the script runs only those).
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe[tp2-pp4-dp8-distopt-bf16]": (
        "[tp2-sp-pp2-dp2-distopt-bf16] (the same TP, PP, DP and distributed-optimizer layout on 8 ranks)"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe_as_its_middle_rank": (
        "test_case_is_gpu_safe[the same case] as its first and last rank: a middle rank's TP, PP, CP and EP"
        " coordinates are each 0 or the last; its one interior DP shard (ep2-moe-tp2-dp4's DP rank 1 of 4) is"
        " test_distributed_optimizer_state_is_sharded_and_portable[4]'s"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_every_case_runs_as_first_middle_and_last_rank": (
        "test_case_is_gpu_safe (each case it runs, as its first, middle and last rank)"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe[dp2-fp32-legacy-ckpt]": (
        "[tp2-dp2-gqa-bf16-legacy-ckpt]"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe[tp2-sp-fp8-tensorwise]": (
        "[tp2-sp-dp2-fp8-delayed], [tp2-sp-fp4-nvfp4]; every recipe's _scaled_mm layouts in test_fp8_cuda_layout"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe[tp2-sp-fp8-blockwise]": (
        "[tp2-sp-dp2-fp8-delayed], [tp2-sp-fp4-nvfp4]; every recipe's _scaled_mm layouts in test_fp8_cuda_layout"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe[tp2-sp-fp8-mxfp8]": (
        "[tp2-sp-dp2-fp8-delayed], [tp2-sp-fp4-nvfp4]; every recipe's _scaled_mm layouts in test_fp8_cuda_layout"
    ),
}


def _in_full_tier(item: pytest.Item) -> str | None:
    """Why ``item`` runs only in the full tier (None when it runs by default)."""
    why = full_only_reason(item.nodeid, FULL_ONLY)
    if why is not None:
        return why
    if item.get_closest_marker("full") is not None or item.get_closest_marker("slow") is not None:
        return "marked full"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the full-tier tests and skip them on whole-suite runs unless ``RUN_FULL=1``; check the tier rule there."""
    whole_suite = config.args_source == Config.ArgsSource.TESTPATHS  # no path given: tests/, before -k/-m
    # The default tier applies to the whole suite; paths or node ids given by name run all their tests.
    run_full = os.environ.get("RUN_FULL") == "1" or os.environ.get("RUN_SLOW") == "1" or not whole_suite
    stale = stale_entries((item.nodeid for item in items), FULL_ONLY)
    if stale:
        raise pytest.UsageError(f"tests/conftest.py FULL_ONLY names tests that do not exist: {stale}")
    reasons = {item.nodeid: _in_full_tier(item) for item in items}
    if whole_suite:
        problems = tier_problems({n: why is None for n, why in reasons.items()}, FULL_ONLY)
        if problems:
            raise pytest.UsageError(
                f"test files with no default-tier test (keep one default or list the file in FULL_ONLY "
                f"with its covering sibling, tests/tiers.py): {problems}"
            )
    for item in items:
        why = reasons[item.nodeid]
        if why is None:
            continue
        item.add_marker(pytest.mark.full)
        if not run_full:
            item.add_marker(pytest.mark.skip(reason=f"full tier (RUN_FULL=1 runs it); covered by {why}"))
