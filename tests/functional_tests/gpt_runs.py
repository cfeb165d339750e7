"""Run ``pretrain_gpt.py`` under torchrun on CPU ranks and read back what it printed.

Shared by the end-to-end tests: a tiny preprocessed corpus (built once per process from
standard-library docstrings with a locally trained GPT-2 BPE), a base set of Megatron flags
for a tiny model, and helpers that launch a run with a timeout and parse its log lines.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from megatron.training.training_log import parse_evaluation_line, parse_log_line
from tests.entry_launcher import LaunchTimeout, launch
from tests.ports import free_port
from tests.tokenizer_files import corpus_texts, make_tokenizer_files, write_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_TIMEOUT_S = 600  # a hang detector (the longest run takes about a minute on 2 loaded cores here), not a bound
# Losses of two layouts of one model (another TP, DP or CP size sums in another order) agree to the printed 7
# digits but for last-digit float noise; bitwise equality holds only within one layout (and one CPU's kernels).
LAYOUT_REL_TOL = 2e-6


@dataclass
class RunResult:
    """One finished run: exit code, full output and the parsed log lines."""

    returncode: int
    output: str
    lines: List[Dict] = field(default_factory=list)
    evaluations: List[Dict] = field(default_factory=list)

    def losses(self) -> List[float]:
        return [line["lm loss"] for line in self.lines]


_BUILT: Dict[str, str] = {}  # kind (a corpus, the served checkpoint) -> the private folder this process built it in


def built_once(kind: str, build: Callable[[str], Dict[str, str]], tmp_dir: str) -> Dict[str, str]:
    """``build(folder)``'s files, built once per process and copied into ``tmp_dir`` (paths moved along)."""
    if kind not in _BUILT:
        folder = tempfile.mkdtemp(prefix=f"{kind}-")
        atexit.register(shutil.rmtree, folder, True)
        built = build(folder)  # a failed build leaves nothing cached: the next test builds again
        with open(os.path.join(folder, "paths.json"), "w") as f:
            json.dump(built, f)
        _BUILT[kind] = folder
    shutil.copytree(_BUILT[kind], tmp_dir, dirs_exist_ok=True)
    with open(os.path.join(tmp_dir, "paths.json")) as f:
        paths = json.load(f)
    return {name: os.path.join(tmp_dir, os.path.relpath(path, _BUILT[kind])) for name, path in paths.items()}


def build_corpus(tmp_dir: str) -> Dict[str, str]:
    """Tokenizer files and a preprocessed dataset prefix under ``tmp_dir`` (preprocessed once per process)."""
    return built_once("gpt_corpus", _build_corpus, tmp_dir)


def _build_corpus(tmp_dir: str) -> Dict[str, str]:
    tok = make_tokenizer_files(os.path.join(tmp_dir, "tok"))["GPT2BPETokenizer"]
    corpus = write_jsonl(os.path.join(tmp_dir, "corpus.jsonl"), corpus_texts(200_000))
    prefix = os.path.join(tmp_dir, "data")
    cmd = [
        sys.executable,
        os.path.join(REPO, "tools", "preprocess_data.py"),
        "--input",
        corpus,
        "--output-prefix",
        prefix,
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        tok["vocab_file"],
        "--merge-file",
        tok["merge_file"],
        "--append-eod",
        "--workers",
        "1",
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=RUN_TIMEOUT_S)
    return {"vocab_file": tok["vocab_file"], "merge_file": tok["merge_file"], "data_prefix": prefix + "_text_document"}


def build_sentence_corpus(tmp_dir: str) -> Dict[str, str]:
    """A WordPiece vocabulary and the sample corpus preprocessed with ``--split-sentences`` (BERT, T5), once per
    process."""
    return built_once("sentence_corpus", _build_sentence_corpus, tmp_dir)


def _build_sentence_corpus(tmp_dir: str) -> Dict[str, str]:
    vocab = make_tokenizer_files(os.path.join(tmp_dir, "tok"))["BertWordPieceLowerCase"]["vocab_file"]
    texts = write_jsonl(os.path.join(tmp_dir, "corpus.jsonl"), corpus_texts(200_000))
    prefix = os.path.join(tmp_dir, "data")
    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", texts]
    cmd += ["--output-prefix", prefix, "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab]
    cmd += ["--split-sentences", "--workers", "1"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=RUN_TIMEOUT_S)
    return {"vocab_file": vocab, "data_prefix": prefix + "_text_sentence", "jsonl": texts}


def tiny_gpt_flags(train_iters: int, seed: int = 1234) -> List[str]:
    """A 2-layer, hidden-32 GPT with dropout off and CPU initialization (layout-invariant start)."""
    return [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--max-position-embeddings",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--train-iters",
        str(train_iters),
        "--lr",
        "3e-3",
        "--min-lr",
        "3e-4",
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        "2",
        "--weight-decay",
        "0.01",
        "--clip-grad",
        "1.0",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--use-cpu-initialization",
        "--seed",
        str(seed),
        "--log-interval",
        "1",
        "--eval-interval",
        "1000",
        "--eval-iters",
        "1",
        "--num-workers",
        "0",
        # 600-token vocabularies pad to 1024 for TP=1 and TP=2 alike, so the layouts share one model.
        "--make-vocab-size-divisible-by",
        "512",
    ]


def with_flags(flags: Sequence[str], changes: Dict[str, Optional[str]]) -> List[str]:
    """``flags`` with each ``--flag value`` of ``changes`` set (appended when absent; None removes it)."""
    out = list(flags)
    for name, value in changes.items():
        if name in out:
            i = out.index(name)
            del out[i : i + 2]
        if value is not None:
            out += [name, value]
    return out


def data_flags(corpus: Dict[str, str]) -> List[str]:
    return [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        corpus["vocab_file"],
        "--merge-file",
        corpus["merge_file"],
        "--data-path",
        corpus["data_prefix"],
        "--split",
        "90,5,5",
    ]


def mock_flags() -> List[str]:
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "600"]


def run_gpt(
    nproc: int,
    flags: Sequence[str],
    cwd: str,
    timeout: float = RUN_TIMEOUT_S,
    env: Optional[Dict[str, str]] = None,
    script: Optional[Sequence[str]] = None,
    launcher: str = "fork",
    launcher_args: Sequence[str] = (),
) -> RunResult:
    """``pretrain_gpt.py flags`` on ``nproc`` local ranks with a hard timeout.

    ``script`` replaces ``pretrain_gpt.py`` (a path and its leading arguments). ``launcher="fork"`` starts
    the ranks from the tests' preloaded fork server (``tests/entry_launcher.py``: torchrun's environment
    without its start-up cost); ``"torchrun"`` runs ``torchrun --standalone --nproc-per-node nproc``, with
    ``launcher_args`` (``--max-restarts 1``; they need torchrun).
    """
    if launcher_args and launcher != "torchrun":
        raise ValueError(f"launcher_args={list(launcher_args)} need launcher='torchrun'")
    entry = list(script) if script else [os.path.join(REPO, "pretrain_gpt.py")]
    full_env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false"
    )
    full_env.update(env or {})
    if launcher == "fork":
        try:
            returncode, stdout, stderr = launch(nproc, [*entry, *flags], cwd, full_env, free_port(), timeout)
        except LaunchTimeout as err:
            raise AssertionError(str(err)) from err
        output = stdout + stderr
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        try:
            proc = subprocess.run(
                cmd + list(launcher_args) + entry + list(flags),
                cwd=cwd,
                env=full_env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as err:
            raise AssertionError(
                f"pretrain_gpt.py on {nproc} ranks did not finish in {timeout}s:\n"
                f"{(err.stdout or b'')[-4000:]!r}\n{(err.stderr or b'')[-4000:]!r}"
            ) from err
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    return parse_run(returncode, output)


# The head of a training line ("[time] iteration N/ M |"), wherever it stands in a line.
_TRAINING_HEAD = re.compile(r"(?<=[^\n])(?=\[[^\]\n]+\]\s+iteration\s+\d+/\s*\d+\s*\|)")


def parse_run(returncode: int, output: str) -> RunResult:
    """``output``'s training and evaluation lines. A training line is found anywhere in a line: under real
    torchrun the ranks share one pipe with block-buffered stdouts, so another rank's unfinished line can
    precede it (each line the last rank prints is written whole, with its newline, by ``print(flush=True)``)."""
    split = _TRAINING_HEAD.sub("\n", output).splitlines()
    lines = [p for p in map(parse_log_line, split) if p is not None]
    evals = [p for p in map(parse_evaluation_line, split) if p is not None]
    return RunResult(returncode, output, lines, evals)


def assert_ok(result: RunResult, what: str) -> None:
    assert result.returncode == 0, f"{what} exited {result.returncode}:\n{result.output[-6000:]}"


def tb_losses(tb_dir: str) -> Dict[int, float]:
    """TensorBoard's ``lm loss`` scalars of a run: {iteration: float32 loss}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb_dir)
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("lm loss")}


def check_resume(case: str, base: Sequence[str], save_run: tuple, load_run: tuple, cwd: str) -> None:
    """Save after 2 of 4 iterations as ``save_run`` = (ranks, flags), load as ``load_run`` and train 2 more: the
    losses are the uninterrupted run's under the loading layout, bitwise (printed and TensorBoard's float32) when
    both halves have the same layout, else to ``LAYOUT_REL_TOL``. ``base`` trains 4 iterations."""
    (save_ranks, save_flags), (load_ranks, load_flags) = save_run, load_run
    base = list(base)
    ckpt, tb, tb_straight = (os.path.join(cwd, name) for name in ("ckpt", "tb", "tb_straight"))
    straight = run_gpt(load_ranks, base + load_flags + ["--tensorboard-dir", tb_straight], cwd)
    assert_ok(straight, f"{case}: uninterrupted")
    save = ["--save", ckpt, "--save-interval", "2", "--exit-interval", "2", "--tensorboard-dir", tb]
    first = run_gpt(save_ranks, base + save_flags + save, cwd)
    assert_ok(first, f"{case}: first half")
    second = run_gpt(load_ranks, base + load_flags + ["--load", ckpt, "--tensorboard-dir", tb], cwd)
    assert_ok(second, f"{case}: resumed")
    assert [line["iteration"] for line in second.lines] == [3, 4]
    resumed = first.losses() + second.losses()
    if (save_ranks, save_flags) == (load_ranks, load_flags):
        assert resumed == straight.losses(), case
        assert tb_losses(tb) == tb_losses(tb_straight), case  # float32 scalars, exactly
    else:  # another DP size sums the gradients in another order: equal but for float noise
        assert len(resumed) == len(straight.losses()), case
        for i, (x, y) in enumerate(zip(resumed, straight.losses())):
            assert math.isclose(x, y, rel_tol=LAYOUT_REL_TOL), f"{case}: iteration {i + 1}: {x} vs {y}"
