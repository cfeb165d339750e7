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

from tests.tiers import full_only_reason, stale_entries_of_run, tier_problems

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The fused regions (megatron/core/fusions) run eagerly in tests, the same math without minutes of
# Inductor compiles per spawned rank; tests/unit_tests/fusions compiles them on purpose.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# node id, test function (all its parameters) or whole file -> the default-tier test that covers its family
FULL_ONLY = {  # one key per entry, however long
    "tests/functional_tests/test_benchmark_commands.py::test_step_benchmark_reports_ours_beside_plain_pytorch": (
        "test_long_context_benchmark_reports_every_scheme (a README benchmark command runs to its report); the fused"
        " and unfused paths it times in tests/unit_tests/fusions/test_fused_ops.py"
    ),
    "tests/functional_tests/test_text_generation_server.py::test_lm_eval_chat_completions_concurrent_equal_sequential": (  # noqa: E501
        "test_lm_eval_accuracy_equals_scoring_with_the_engine (lm-eval with num_concurrent=4 against the same"
        " server); streamed and concurrent chat answers in test_dynamic_server.py"
    ),
    "tests/functional_tests/test_pretrain_gpt_hybrid.py": (
        "tests/unit_tests/distributed/test_hybrid_sharding.py (two instances at DP=4 against the distributed"
        " optimizer, under it and optim_grads_params, the reduction order and the checkpoint replica ids)"
    ),
    "tests/functional_tests/test_pretrain_mamba.py": (
        "tests/unit_tests/ssm/test_mamba_models.py (loss and gradients under TP+SP and PP) and "
        "test_example_scripts.py[examples/mamba/train.sh] (pretrain_mamba.py, TP=2+SP, distributed optimizer)"
    ),
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
    "tests/functional_tests/test_pretrain_gpt_fsdp.py::test_sharding_strategies_equal_the_distributed_optimizer[dp4]": (  # noqa: E501
        "[tp2dp2]; every strategy bitwise at DP=2 in test_megatron_fsdp.py"
    ),
    "tests/functional_tests/test_pretrain_gpt_fsdp.py::test_sharding_strategies_equal_the_distributed_optimizer[ep2]": (  # noqa: E501
        "[tp2dp2] (the per-layer units hold the expert buckets too)"
    ),
    "tests/functional_tests/test_pretrain_gpt_fsdp.py::test_checkpoints_move_between_fsdp_and_the_distributed_optimizer[fsdp-dp4-to-distopt-dp2]": (  # noqa: E501
        "[fsdp-dp2-to-fsdp-dp2] (the same load path; any DP size reads the by-name state)"
    ),
    "tests/functional_tests/test_pretrain_gpt_fsdp.py::test_checkpoints_move_between_fsdp_and_the_distributed_optimizer[distopt-dp2-to-fsdp-dp4]": (  # noqa: E501
        "[fsdp-dp2-to-fsdp-dp2] (the same load path; any DP size reads the by-name state)"
    ),
    "tests/functional_tests/test_pretrain_gpt_fsdp2.py::test_fsdp2_equals_the_distributed_optimizer[dp4]": (  # noqa: E501
        "[tp2dp2]; bitwise at DP=2 in test_torch_fsdp2.py"
    ),
    "tests/functional_tests/test_pretrain_gpt_fsdp2.py::test_fsdp2_equals_the_distributed_optimizer[ep2]": (  # noqa: E501
        "[tp2dp2] (experts are FSDP2 modules over expert-DP beside the layers)"
    ),
    "tests/functional_tests/test_pretrain_gpt_fsdp2.py::test_checkpoints_move_between_fsdp2_and_the_distributed_optimizer[distopt-dp2-to-fsdp2-dp4]": (  # noqa: E501
        "[fsdp2-dp2-to-distopt-dp1] (the same save and load paths; any DP size reads the whole tensors)"
    ),
    "tests/functional_tests/test_pretrain_gpt_fsdp2.py::test_checkpoints_move_between_fsdp2_and_the_distributed_optimizer[fsdp2-dp4-to-distopt-dp2]": (  # noqa: E501
        "[fsdp2-dp2-to-distopt-dp1] (the same save and load paths; any DP size reads the whole tensors)"
    ),
    "tests/fault/test_crafted_checkpoint.py::test_crafted_fsdp2_checkpoint_refused_on_resume": (
        "test_refused_by_training_resume_and_converter (the same .metadata read before any layout's load)"
    ),
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
    "tests/functional_tests/test_example_scripts.py::test_deepseek_v4_script_on_two_pipeline_stages_equals_one_stage": (  # noqa: E501
        "tests/unit_tests/models/test_deepseek_v4_parallel.py (the same model parts under PP=2 and PP=2 with virtual"
        " stages, loss and every gradient against one rank)"
    ),
    "tests/functional_tests/test_example_scripts.py::test_example_script_runs_at_toy_size[examples/deepseek_v4/train_deepseek_v4_distributed.sh]": (  # noqa: E501
        "tests/unit_tests/models/test_deepseek_v4_parallel.py (the same model parts under TP=2+SP and EP=2 with MTP)"
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
    # Megatron's BERT and T5 launch scripts (real torchrun, about 25-30 s each): their entry points' layouts stay.
    "tests/functional_tests/test_pretrain_bert.py::test_megatron_example_script_scaled_down": (
        "test_layouts_print_the_one_rank_losses[pp2] (pretrain_bert.py on 2 ranks, PP); fp16 in "
        "test_pretrain_gpt_precision; a Megatron launch script through torchrun: test_example_scripts[gpt3]"
    ),
    "tests/functional_tests/test_pretrain_t5.py::test_megatron_example_script_scaled_down": (
        "test_layouts_print_the_one_rank_loss[tp2_sp] (pretrain_t5.py on 2 ranks, with evaluation); T5's TE spec"
        " in test_t5_construction::test_specs; bf16 in test_pretrain_gpt_precision; a launch script: [gpt3]"
    ),
    "tests/functional_tests/test_pretrain_t5.py::test_layouts_print_the_one_rank_loss[dp2]": (
        "[tp2_sp]; DP is the GPT layouts' and the data-parallel tests'"
    ),
    "tests/unit_tests/tools/test_convert_qwen3_next.py::test_qwen3_next_convert_train_export": (
        "test_qwen3_next_round_trip_is_exact_and_flags_validate (HF -> ours -> HF bit for bit, the printed flags "
        "validated) and tests/unit_tests/ssm/test_qwen3_next_models.py (logits against transformers)"
    ),
    "tests/unit_tests/tools/test_convert_qwen.py::test_convert_train_export[mistral-1]": (
        "test_round_trip_is_exact (Mistral's names, sliding window); [qwen3_moe-2] the train and export path"
    ),
    "tests/unit_tests/tools/test_convert_qwen.py::test_convert_train_export[mixtral-2]": (
        "test_round_trip_is_exact (Mixtral's expert names); [qwen3_moe-2] the MoE train and export path"
    ),
    "tests/unit_tests/tools/test_checkpoint_convert.py::test_hf_to_megatron_logits[1]": "[2]",
    "tests/unit_tests/tools/test_convert_deepseek.py::test_convert_train_export[deepseek_v3]": (
        "[deepseek_v32]: the same model plus DSA's indexer through the same train and export path; "
        "test_round_trip_is_exact_and_refusals: V3's own names and config"
    ),
    "tests/unit_tests/inference/test_engine_hf.py::test_greedy_equals_hugging_face[tp2-and-pp2]": (
        "test_engine_tp2_pp2.py::test_tp2_pp2_equals_hugging_face (the same greedy body under TP=2 and PP=2 at once)"
    ),
    "tests/unit_tests/distributed/test_data_parallel.py::test_dp_training_equals_single_rank[2-1]": (
        "[4-2] (DP=2, there under TP=2)"
    ),
    "tests/unit_tests/optimizer/test_distributed_optimizer.py::test_distributed_optimizer_state_is_sharded_and_portable[2]": (  # noqa: E501
        "[4] (the state sharded over 4 ranks and loaded elsewhere)"
    ),
    "tests/functional_tests/test_pretrain_gpt_fp8.py::test_nvfp4_resumes_bitwise_from_the_legacy_checkpoint_format": (  # noqa: E501
        "test_nvfp4_resumes_bitwise_with_the_stochastic_rounding_state (the same halves, torch_dist); the legacy"
        " format's quantizer state in test_llama3_fp8_flags_train_on_two_ranks_and_resume_bitwise"
    ),
    "tests/fault/test_in_job_restart.py::test_without_restarts_left_the_killed_rank_fails_the_job": (
        "test_killed_rank_restarts_in_job_and_finishes_with_the_straight_losses (the same kill, one restart)"
    ),
    # The fake-CUDA dry-run grid: the default tier runs 6 of its 14 cases, one per layout family (the script
    # runs only those): TP+SP+PP+DP, interleaved PP (fp16), CP, EP/MoE, DP with the legacy checkpoint and the
    # TE spec; each as its first rank, the two PP cases as their last rank too. The quantized recipes' GPU
    # rules are test_dry_run_rules.py's (every recipe, fake CUDA, no host sync) and test_fp8_cuda_layout.py's
    # (every _scaled_mm call).
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe[tp2-pp4-dp8-distopt-bf16]": (
        "[tp2-sp-pp2-dp2-distopt-bf16] (the same TP, PP, DP and distributed-optimizer layout on 8 ranks)"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe_at_its_other_end": (
        "test_case_is_gpu_safe[the same case] at its one end: without pipeline stages every rank runs the same code"
        " on its own TP/CP/EP/DP coordinates; of the pipeline stages, [tp2-sp-pp2-dp2-distopt-bf16]'s last (loss,"
        " activations received, gradients sent) and [pp2-vpp2-dp2-distopt-fp16]'s first (activations sent,"
        " gradients received)"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe_as_its_middle_rank": (
        "test_case_is_gpu_safe[the same case] and at its other end: a middle rank's TP, PP, CP and EP"
        " coordinates are each 0 or the last; its one interior DP shard (ep2-moe-tp2-dp4's DP rank 1 of 4) is"
        " test_distributed_optimizer_state_is_sharded_and_portable[4]'s"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_every_case_runs_as_first_middle_and_last_rank": (
        "test_case_is_gpu_safe (each case it runs, as its first, middle and last rank)"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe[tp2-dp2-gqa-bf16-legacy-ckpt]": (
        "[dp2-fp32-legacy-ckpt] (the legacy torch checkpoint), [cp2-tp2-dp2-bf16] (TP+DP, bf16 without the"
        " distributed optimizer); grouped-query attention against Hugging Face in test_gpt_hf_parity"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe[moe-alltoall-grouped-gemm-tp2-sp-ep2-distopt-overlap-recompute-bf16]": (  # noqa: E501
        "[ep2-moe-tp2-dp4-distopt-bf16] (the MoE layer on fake CUDA); GroupedMLP on fake CUDA in"
        " test_moe_grouped_gemm.py (fake_world); the all-to-all dispatcher's one host read per layer in"
        " test_moe_alltoall_etp.py"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe[tp2-sp-dp2-fp8-delayed]": (
        "test_dry_run_rules.py::test_quantizers_run_on_the_gpu_without_host_syncs_or_uploads (every recipe on"
        " fake CUDA); delayed scaling's amax state in test_fp8_step.py; every recipe's _scaled_mm layouts in"
        " test_fp8_cuda_layout"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe[tp2-sp-fp4-nvfp4]": (
        "test_dry_run_rules.py::test_quantizers_run_on_the_gpu_without_host_syncs_or_uploads (NVFP4 among every"
        " recipe on fake CUDA); NVFP4's training and resume in test_pretrain_gpt_fp8; TP+SP in"
        " [tp2-sp-pp2-dp2-distopt-bf16]"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe[dp2-fsdp-optim-grads-params-bf16]": (
        "[tp2-sp-pp2-dp2-distopt-bf16] (the distributed optimizer's buffers on fake CUDA); Megatron-FSDP's CPU runs"
        " in test_megatron_fsdp.py"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe[dp4-fsdp-optim-grads-2-instances-bf16]": (  # noqa: E501
        "[tp2-sp-pp2-dp2-distopt-bf16] (the distributed optimizer's buffers on fake CUDA); hybrid sharding's CPU runs"
        " in test_hybrid_sharding.py"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe[tp2-sp-fp8-tensorwise]": (
        "test_dry_run_rules.py::test_quantizers_run_on_the_gpu_without_host_syncs_or_uploads (every recipe on"
        " fake CUDA); every recipe's _scaled_mm layouts in test_fp8_cuda_layout; TP+SP in [tp2-sp-pp2-dp2-distopt-bf16]"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe[tp2-sp-fp8-blockwise]": (
        "test_dry_run_rules.py::test_quantizers_run_on_the_gpu_without_host_syncs_or_uploads (every recipe on"
        " fake CUDA); every recipe's _scaled_mm layouts in test_fp8_cuda_layout; TP+SP in [tp2-sp-pp2-dp2-distopt-bf16]"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe[deepseek-v4-tp2-sp-ep2-bf16]": (
        "[ep2-moe-tp2-dp4-distopt-bf16] (TP+SP, EP and MoE on fake CUDA); DeepSeek-V4 under TP=2+SP and EP=2 on CPU"
        " ranks in tests/unit_tests/models/test_deepseek_v4_parallel.py"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe[hybrid-mamba-tp2-sp-pp2-distopt-bf16]": (
        "[tp2-sp-pp2-dp2-distopt-bf16] (TP+SP, PP and the distributed optimizer on fake CUDA); hybrid Mamba"
        " under TP+SP and PP on CPU ranks in tests/unit_tests/ssm/test_mamba_models.py"
    ),
    "tests/functional_tests/test_gpu_dry_run.py::test_case_is_gpu_safe[tp2-sp-fp8-mxfp8]": (
        "test_dry_run_rules.py::test_quantizers_run_on_the_gpu_without_host_syncs_or_uploads (every recipe on"
        " fake CUDA); every recipe's _scaled_mm layouts in test_fp8_cuda_layout; TP+SP in [tp2-sp-pp2-dp2-distopt-bf16]"
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
    stale = stale_entries_of_run(config.args, (item.nodeid for item in items), FULL_ONLY)
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
