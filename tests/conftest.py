"""Shared pytest setup: keep torch to one thread per process on the 2-core machines, and the two tiers.

The default tier (``bash scripts/run_tests.sh``, or plain ``python -m pytest``) runs at least one test of
every feature and layout family in about 12 minutes on 2 cores. ``FULL_ONLY`` lists the tests only the
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

# node id, test function (all its parameters) or whole file -> the default-tier test that covers its family
FULL_ONLY = {  # one key per entry, however long
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
    """Mark the full-tier tests and skip them unless ``RUN_FULL=1``; check the tier rule on whole-suite runs."""
    run_full = os.environ.get("RUN_FULL") == "1" or os.environ.get("RUN_SLOW") == "1"
    stale = stale_entries((item.nodeid for item in items), FULL_ONLY)
    if stale:
        raise pytest.UsageError(f"tests/conftest.py FULL_ONLY names tests that do not exist: {stale}")
    reasons = {item.nodeid: _in_full_tier(item) for item in items}
    if config.args_source == Config.ArgsSource.TESTPATHS:  # the whole suite was collected (before -k/-m)
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
