"""A new user's usual mistakes stop a run early, in one clear message, once, with no Python traceback.

Each probe starts the real entry point (``pretrain_gpt.py`` or the text-generation server) with one
mistake and checks: non-zero exit, the message printed exactly once (not once per rank), no
traceback through our code (torchrun's own failure summary aside) and nothing built (the model's
parameter count and theoretical memory, printed just before building, never appear). Two ranks
where the mistake could be reported per rank, one where one suffices.
"""

from __future__ import annotations

import os
import socket
import sys

from tests.functional_tests.gpt_runs import REPO, RunResult, mock_flags, run_gpt, tiny_gpt_flags, with_flags
from tests.ports import free_port

SERVER = os.path.join(REPO, "tools", "run_text_generation_server.py")
VENV = os.path.join(REPO, ".venv")
BUILT_MARKERS = ("number of parameters", "Theoretical memory")


def assert_one_clear_message(result: RunResult, message: str) -> None:
    out = result.output
    assert result.returncode != 0, out[-3000:]
    assert out.count(message) == 1, f"{message!r} printed {out.count(message)} times:\n{out[-4000:]}"
    # Frames in our code; torchrun's own summary (its frames live in the venv, which may sit inside the repo) aside.
    ours = [line for line in out.splitlines() if f'File "{REPO}' in line and f'File "{VENV}' not in line]
    assert not ours and "[rank" not in out, f"a traceback through our code:\n{out[-4000:]}"
    assert not any(marker in out for marker in BUILT_MARKERS), f"the model was built first:\n{out[-4000:]}"


def null_tokenizer_flags() -> list:
    return tiny_gpt_flags(2) + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "600"]


def test_wrong_data_path_is_one_message_from_two_ranks(tmp_path):
    prefix = str(tmp_path / "corpus_text_documnet")  # a typo
    # Through real torchrun, as a user starts it (the other probes use the tests' preloaded launcher).
    result = run_gpt(
        2, null_tokenizer_flags() + ["--data-path", prefix], str(tmp_path), timeout=240, launcher="torchrun"
    )
    assert_one_clear_message(result, f"--data-path {prefix}: {prefix}.bin and {prefix}.idx not found")


def test_tensor_parallel_not_dividing_heads_is_one_message_from_two_ranks(tmp_path):
    flags = with_flags(tiny_gpt_flags(2), {"--num-attention-heads": "3"}) + mock_flags()
    result = run_gpt(2, flags + ["--tensor-model-parallel-size", "2"], str(tmp_path), timeout=240)
    assert_one_clear_message(result, "--num-attention-heads 3 must be divisible by --tensor-model-parallel-size 2")


def test_missing_vocab_file(tmp_path):
    vocab, merges = str(tmp_path / "vocab.jsn"), str(tmp_path / "merges.txt")
    open(merges, "w").close()
    flags = tiny_gpt_flags(2) + ["--mock-data", "--tokenizer-type", "GPT2BPETokenizer"]
    result = run_gpt(1, flags + ["--vocab-file", vocab, "--merge-file", merges], str(tmp_path))
    assert_one_clear_message(result, f"--vocab-file {vocab}: no such file (--tokenizer-type GPT2BPETokenizer)")


def _no_checkpoint(load: str, why: str) -> str:
    return (
        f"--load {load}: no checkpoint to load: {load}/latest_checkpointed_iteration.txt not found "
        f"(directory {load} does not exist), and {why}: check the path"
    )


def test_load_typo_with_exit_on_missing_checkpoint(tmp_path):
    load = str(tmp_path / "chekpoints")
    flags = tiny_gpt_flags(2) + mock_flags() + ["--load", load, "--exit-on-missing-checkpoint"]
    result = run_gpt(1, flags, str(tmp_path))
    assert_one_clear_message(result, _no_checkpoint(load, "--exit-on-missing-checkpoint is set"))


def test_load_typo_with_skip_train(tmp_path):
    load = str(tmp_path / "chekpoints")
    result = run_gpt(1, tiny_gpt_flags(2) + mock_flags() + ["--load", load, "--skip-train"], str(tmp_path))
    assert_one_clear_message(result, _no_checkpoint(load, "nothing is trained (--skip-train: evaluating or serving)"))


def test_load_typo_for_the_server(tmp_path):
    load = str(tmp_path / "chekpoints")
    flags = with_flags(tiny_gpt_flags(2), {"--train-iters": None}) + mock_flags() + ["--load", load, "--port", "0"]
    result = run_gpt(1, flags, str(tmp_path), script=[SERVER])
    assert_one_clear_message(result, _no_checkpoint(load, "nothing is trained (--skip-train: evaluating or serving)"))


def _one_rank_of(world_size: int, flags: list, port: int, cwd: str) -> RunResult:
    """``pretrain_gpt.py flags`` as rank 0 of ``world_size``, started the way srun starts a rank (its
    RANK/WORLD_SIZE/MASTER_*): no other rank ever comes, so only a start-up error ends it in time."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE=str(world_size))
    env.update(LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cmd = [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *flags]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    return RunResult(proc.returncode, proc.stdout + proc.stderr)


def test_busy_rendezvous_port(tmp_path):
    """Started by srun (or by hand with RANK/WORLD_SIZE/MASTER_*), rank 0 listens on MASTER_PORT itself."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = _one_rank_of(1, tiny_gpt_flags(2) + mock_flags(), port, str(tmp_path))
    assert_one_clear_message(result, f"the rendezvous port {port} (MASTER_PORT) is already in use on 127.0.0.1")


def test_moe_with_tensor_parallelism_and_no_sequence_parallelism(tmp_path):
    """Refused at start-up, before the ranks meet (Megatron's MoE layer refuses it at the first training step);
    the text-generation server accepts the layout (tests/unit_tests/training/test_training_validation.py)."""
    flags = tiny_gpt_flags(2) + mock_flags() + ["--num-experts", "4", "--tensor-model-parallel-size", "2"]
    port = free_port()
    result = _one_rank_of(2, flags, port, str(tmp_path))
    assert_one_clear_message(
        result, "--num-experts 4 with --tensor-model-parallel-size 2 needs --sequence-parallel to train"
    )
