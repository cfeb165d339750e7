"""Shared pytest setup: keep torch to one thread per process on the 2-core machines, and skip the
``slow`` checks unless ``RUN_SLOW=1``.

``SLOW`` lists end-to-end checks whose layout or family a faster sibling already covers, so the
default suite (CI, ``bash scripts/run_tests.sh``) stays near 20 minutes on 2 cores; ``RUN_SLOW=1 bash
scripts/run_tests.sh`` runs everything. A test can also carry ``@pytest.mark.slow`` itself.
"""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# node id -> the sibling that keeps the capability in the default run
SLOW = {  # one node id per entry, however long
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


def pytest_collection_modifyitems(config, items):
    """Mark the ``SLOW`` node ids and skip every slow test unless ``RUN_SLOW=1``."""
    run_slow = os.environ.get("RUN_SLOW") == "1"
    collected = {item.nodeid for item in items}
    files = {nodeid.split("::")[0] for nodeid in collected}
    stale = [n for n in SLOW if n.split("::")[0] in files and n not in collected]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py SLOW names tests that do not exist: {stale}")
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)
        if not run_slow and item.get_closest_marker("slow") is not None:
            why = SLOW.get(item.nodeid, "marked slow")
            item.add_marker(pytest.mark.skip(reason=f"slow (RUN_SLOW=1 runs it); covered by {why}"))
