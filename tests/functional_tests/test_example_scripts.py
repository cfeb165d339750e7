"""Every launch script under ``examples/`` runs at toy size on CPU (2 gloo ranks) and prints Megatron's log lines.

The scripts take their sizes from the environment (``example_runs.toy_env``); each runs a few iterations of a
hidden-32/64 model on mock data. A script run by another test is listed in ``COVERED_ELSEWHERE`` with that test,
which must exist; a new script that is in neither table fails ``test_every_example_script_is_run``.
"""

from __future__ import annotations

import glob
import os
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List

import pytest

from tests.functional_tests.example_runs import GPT3, REAL_TORCHRUN, RUN_TIMEOUT_S, SBATCH_GPT, run_script, toy_env
from tests.functional_tests.gpt_runs import REPO

ITERS = 3


@dataclass(frozen=True)
class Case:
    """How to run one script: its arguments ({tmp} is a fresh directory) and environment changes."""

    args: List[str] = field(default_factory=list)
    env: Dict[str, str] = field(default_factory=dict)
    timeout: float = RUN_TIMEOUT_S


GPT_FAMILY_ARGS = ["{tmp}/ckpt", "{tmp}/tb", "-", "MOCK"]
# MLA latents with V3.2's sparse attention (4 keys per query), a dense first layer, sigmoid routing over 2 groups,
# expert parallelism and one MTP layer.
DEEPSEEK_TOY = dict(DENSE_LAYERS="1", MOE_FFN="32", ROUTER_GROUPS="2", GROUP_TOPK="1", TOPK="2", TP="1", EP="2")
DEEPSEEK_TOY.update(Q_LORA="16", KV_LORA="16", QK_HEAD="8", QK_POS="8", V_HEAD="8", MTP_LAYERS="1")
DEEPSEEK_TOY.update(DSA_TOPK="4", DSA_HEADS="4", DSA_HEAD_DIM="8")
# DeepSeek-V4: HCA, HCA, HCA, CSA (4 tokens per entry, top-3) beside an 8-token window, 2 hyper-connection streams,
# one hash-routed MoE layer then learned ones, MTP, TP=2 with SP and EP=2.
DEEPSEEK_V4_TOY = dict(NUM_LAYERS="4", HEAD_DIM="16", ROPE_PERCENT="0.5", Q_LORA="12", O_GROUPS="2", O_LORA="6")
DEEPSEEK_V4_TOY.update(WINDOW="8", CSA_RATE="4", HCA_RATE="8", INDEX_HEADS="2", INDEX_HEAD_DIM="8", INDEX_TOPK="3")
DEEPSEEK_V4_TOY.update(HC="2", MOE_FFN="16", TOPK="2", HASH_LAYERS="1", TP="2", EP="2")
QUICKSTART_ENV = dict(QUICKSTART_DIR="{tmp}/q", CORPUS_MB="0.3", TRAIN_ITERS=str(ITERS))
CASES = {
    # Through torchrun itself (the others: its one-node stand-in, tests/torchrun_standin.py; the same
    # examples/lib/launch.bash line starts them all).
    GPT3: Case(["{tmp}/ckpt", "{tmp}/tb", "-", "-", "MOCK"], dict(TORCHRUN=REAL_TORCHRUN)),
    "examples/llama/train_llama3_8b_distributed.sh": Case(GPT_FAMILY_ARGS, dict(HIDDEN="64", PRECISION="--bf16")),
    "examples/mixtral/train_mixtral_8x7b_distributed.sh": Case(GPT_FAMILY_ARGS, dict(TP="1", EP="2")),
    # QK layernorm, grouped experts and the all-to-all dispatcher; TP=2 with SP and EP=2 with expert-TP 1 on the same
    # 2 ranks (expert-DP 1); the toy defaults give 4 experts, top-2.
    "examples/qwen3_moe/train_qwen3_moe_30b_a3b_distributed.sh": Case(
        GPT_FAMILY_ARGS, dict(KV_CHANNELS="8", MOE_FFN="32", TOPK="2", TP="2", PP="1", EP="2", MAX_POSITIONS="32")
    ),
    "examples/deepseek_v3/train_deepseek_v3_distributed.sh": Case(GPT_FAMILY_ARGS, DEEPSEEK_TOY),
    "examples/deepseek_v4/train_deepseek_v4_distributed.sh": Case(GPT_FAMILY_ARGS, DEEPSEEK_V4_TOY),
    "examples/pretrain_gpt_multinode.sh": Case([], dict(DATA="MOCK", CKPT="{tmp}/ckpt", PRECISION="")),
    # Outside a Slurm job the sbatch script trains with torchrun and has nothing to requeue.
    SBATCH_GPT: Case(["{tmp}/ckpt", "{tmp}/tb", "-", "-", "MOCK"]),
    # Megatron's hybrid Mamba flags (ratios 0.08 / 0.5, GQA, TP=2 with SP, distributed optimizer): layers "M-".
    "examples/mamba/train.sh": Case(
        ["MOCK", "-"],
        dict(
            HIDDEN="64",
            CHECKPOINT_DIR="{tmp}/ckpt",
            TENSORBOARD_DIR="{tmp}/tb",
            DATACACHE_DIR="{tmp}/cache",
            MAMBA_EXTRA="--mamba-state-dim 16 --mamba-head-dim 16 --mamba-num-groups 2",
        ),
    ),
    "examples/bert/quickstart.sh": Case([], QUICKSTART_ENV),
    "examples/t5/quickstart.sh": Case([], QUICKSTART_ENV),
    # HF model made locally -> convert -> SFT (TP=2 + SP, packed) -> export (logits checked) -> chat endpoint.
    # Five stages, each its own process (tokenizer training, two conversions, the export check, the server): slower.
    "examples/finetune/finetune.sh": Case(
        [], dict(FINETUNE_DIR="{tmp}/ft", TRAIN_ITERS=str(ITERS), LOG_INTERVAL="1"), timeout=3 * RUN_TIMEOUT_S
    ),
}
COVERED_ELSEWHERE = {
    "examples/quickstart.sh": (
        "tests/functional_tests/test_example_scripts.py",
        "test_quickstart_reruns_reusing_its_data_and_resuming",
    ),
    "examples/bert/train_bert_340m_distributed.sh": (
        "tests/functional_tests/test_pretrain_bert.py",
        "test_megatron_example_script_scaled_down",
    ),
    "examples/t5/train_t5_220m_distributed.sh": (
        "tests/functional_tests/test_pretrain_t5.py",
        "test_megatron_example_script_scaled_down",
    ),
}


def launch_scripts() -> List[str]:
    """Every ``*.sh`` and ``*.sbatch`` under examples/, relative to the repository."""
    found = glob.glob(os.path.join(REPO, "examples", "**", "*.sh"), recursive=True)
    found += glob.glob(os.path.join(REPO, "examples", "**", "*.sbatch"), recursive=True)
    return sorted(os.path.relpath(path, REPO) for path in found)


def test_every_example_script_is_run():
    assert launch_scripts() == sorted(set(CASES) | set(COVERED_ELSEWHERE))
    for test_file, test_name in COVERED_ELSEWHERE.values():
        with open(os.path.join(REPO, test_file)) as f:
            assert f"def {test_name}(" in f.read(), f"{test_file} has no {test_name}"


@pytest.mark.parametrize("script", sorted(CASES))
def test_example_script_runs_at_toy_size(script):
    case = CASES[script]
    if script.endswith("quickstart.sh") and not os.path.exists(os.path.join(REPO, ".venv", "bin", "python")):
        pytest.skip(f"{script} sets up and uses {REPO}/.venv (bash scripts/setup_env.sh creates it)")
    with tempfile.TemporaryDirectory() as tmp:
        args = [a.format(tmp=tmp) for a in case.args]
        env = toy_env(ITERS, **{k: v.format(tmp=tmp) for k, v in case.env.items()})
        result = run_script(script, args, env, timeout=case.timeout)
    assert result.returncode == 0, f"{script} exited {result.returncode}:\n{result.output[-6000:]}"
    assert [line["iteration"] for line in result.lines] == list(range(1, ITERS + 1)), result.output[-6000:]


def test_quickstart_reruns_reusing_its_data_and_resuming():
    """The quickstart at toy size, then again in the same directory with more iterations: the second run
    reuses the corpus, tokenizer and data, resumes from the first run's checkpoint and says so."""
    if not os.path.exists(os.path.join(REPO, ".venv", "bin", "python")):
        pytest.skip(f"examples/quickstart.sh sets up and uses {REPO}/.venv (bash scripts/setup_env.sh creates it)")
    with tempfile.TemporaryDirectory() as tmp:
        env = toy_env(ITERS, **{k: v.format(tmp=tmp) for k, v in QUICKSTART_ENV.items()})
        first = run_script("examples/quickstart.sh", [], env)
        assert first.returncode == 0, first.output[-6000:]
        assert [line["iteration"] for line in first.lines] == list(range(1, ITERS + 1)), first.output[-6000:]
        assert "quickstart: training from scratch" in first.output
        again = run_script("examples/quickstart.sh", [], dict(env, TRAIN_ITERS=str(ITERS + 2)))
    assert again.returncode == 0, again.output[-6000:]
    for what in ("the corpus", "the tokenizer", "the preprocessed data"):
        assert f"quickstart: reusing {what}" in again.output, again.output[-6000:]
    assert f"(iteration {ITERS}) up to {ITERS + 2} iterations" in again.output
    assert (
        f"successfully loaded checkpoint from {tmp}/q/checkpoints [ t 1/2, p 1/1 ] at iteration {ITERS}" in again.output
    )
    assert [line["iteration"] for line in again.lines] == [ITERS + 1, ITERS + 2], again.output[-6000:]


def test_deepseek_v4_script_on_two_pipeline_stages_equals_one_stage():
    """The V4 toy on 2 pipeline stages (the hyper-connection streams cross the stage boundary; hash-routed layers on
    both stages; MTP on the last) logs the losses of the same toy on one stage with DP=2: both start from the same
    weights (``--use-cpu-initialization``: each layer seeded by its global name), rtol 1e-5."""
    logged = {}
    for pp in ("2", "1"):
        toy = dict(DEEPSEEK_V4_TOY, TP="1", PP=pp, EP="1", HASH_LAYERS="3")
        with tempfile.TemporaryDirectory() as tmp:
            args = [a.format(tmp=tmp) for a in GPT_FAMILY_ARGS]
            env = toy_env(ITERS, **toy)
            env["EXTRA"] += " --use-cpu-initialization"
            result = run_script("examples/deepseek_v4/train_deepseek_v4_distributed.sh", args, env)
        assert result.returncode == 0, f"PP={pp} exited {result.returncode}:\n{result.output[-6000:]}"
        assert [line["iteration"] for line in result.lines] == list(range(1, ITERS + 1)), result.output[-6000:]
        logged[pp] = [line[key] for line in result.lines for key in ("lm loss", "mtp_1 loss")]
    assert logged["2"] == pytest.approx(logged["1"], rel=1e-5), logged
