"""Train the quickstart GPT in bf16 and with each FP8/FP4 recipe; print final losses and bytes saved.

Usage: python benchmarks/bench_fp8_recipes.py [--iters 200] [--recipes bf16,tensorwise,...] [--dir runs/bench_fp8]

Every run is ``examples/quickstart.sh``'s model and data (4 layers, hidden 128, 4 heads, sequence
128, TP=2 on 2 CPU ranks, the sample corpus and its 8000-token BPE, built once under ``--dir``)
plus ``--bf16`` and the recipe's flags. The table gives the mean ``lm loss`` of the last 10
iterations, its ratio to bf16, and, measured on the quickstart's own shapes, the bytes each recipe
stores per weight element and per saved activation element (``storage_bytes`` of the quantized
weight and of the input the linear keeps for backward), against bf16's 2, and what autograd holds
here (counted with ``saved_tensors_hooks``; the emulation keeps FP4 values unpacked in fp32).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Dict, List, Tuple

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron.core.quantization.recipes import LinearQuantizer, QuantRecipe  # noqa: E402
from megatron.core.quantization.storage import storage_bytes  # noqa: E402
from megatron.core.tensor_parallel.linear_function import parallel_linear  # noqa: E402
from megatron.training.training_log import parse_log_line  # noqa: E402

RECIPES: Dict[str, List[str]] = {
    "bf16": [],
    "tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "1024",
                "--fp8-amax-compute-algo", "max"],
    "blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
    "mxfp8": ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"],
    "nvfp4": ["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"],
}  # fmt: skip


def _run(cmd: List[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, cwd=REPO, **kw)


def prepare_data(directory: str, corpus_mb: float) -> Dict[str, str]:
    """The quickstart's corpus, tokenizer and indexed dataset under ``directory`` (built once)."""
    os.makedirs(directory, exist_ok=True)
    paths = {
        "corpus": os.path.join(directory, "corpus.jsonl"),
        "vocab": os.path.join(directory, "tokenizer", "vocab.json"),
        "merges": os.path.join(directory, "tokenizer", "merges.txt"),
        "prefix": os.path.join(directory, "data_text_document"),
    }
    py = sys.executable
    if not os.path.exists(paths["corpus"]):
        _run([py, "tools/make_sample_corpus.py", "--output", paths["corpus"], "--max-mb", str(corpus_mb)])
    if not os.path.exists(paths["vocab"]):
        _run([py, "tools/train_tokenizer.py", "--input", paths["corpus"], "--type", "gpt2bpe", "--vocab-size", "8000",
              "--output-dir", os.path.join(directory, "tokenizer")])  # fmt: skip
    if not os.path.exists(paths["prefix"] + ".bin"):
        _run([py, "tools/preprocess_data.py", "--input", paths["corpus"], "--output-prefix",
              os.path.join(directory, "data"), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", paths["vocab"],
              "--merge-file", paths["merges"], "--append-eod", "--workers", "1"])  # fmt: skip
    return paths


def quickstart_flags(paths: Dict[str, str], iters: int) -> List[str]:
    """examples/quickstart.sh's training flags (no checkpoints, no TensorBoard, log every iteration)."""
    warmup = min(iters // 10, 20)
    return (
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --num-layers 4 --hidden-size 128 "
        "--num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 --micro-batch-size 4 "
        f"--global-batch-size 16 --train-iters {iters} --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
        f"--lr-warmup-iters {warmup} --weight-decay 0.1 --clip-grad 1.0 --tokenizer-type GPT2BPETokenizer "
        f"--vocab-file {paths['vocab']} --merge-file {paths['merges']} --data-path {paths['prefix']} "
        f"--split 949,50,1 --num-workers 0 --log-interval 1 --eval-interval {iters + 1} --eval-iters 1 --bf16"
    ).split()


def train(paths: Dict[str, str], iters: int, extra: List[str]) -> List[float]:
    """The per-iteration ``lm loss`` values of one 2-rank run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(REPO, "pretrain_gpt.py"), *quickstart_flags(paths, iters), *extra]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(extra) or 'bf16'} run failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    lines = [parse_log_line(line) for line in (proc.stdout + proc.stderr).splitlines()]
    return [line["lm loss"] for line in lines if line is not None and "lm loss" in line]


def _recipe(name: str) -> QuantRecipe:
    if name == "nvfp4":
        return QuantRecipe("nvfp4", "e2m1")
    return QuantRecipe(name, "e4m3" if name in ("blockwise", "mxfp8") else "hybrid")


def measured_bytes(name: str, tokens: int = 4 * 128, hidden: int = 128, out: int = 192) -> Tuple[float, float, float]:
    """Bytes per element of one quickstart-shaped TP=2 linear (QKV's shard ``[3h/tp, h]``, ``[s*b, h]`` input).

    (weight in its format, saved input in its format, what autograd holds here): the first two are
    ``storage_bytes`` (elements packed, scales included) of the tensors the linear quantizes and
    keeps for backward; the last counts the tensors actually saved (FP4 values are held unpacked in
    fp32 by the emulation).
    """
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)  # [s*b, h]
    w = torch.randn(out, hidden, dtype=torch.bfloat16, requires_grad=True)  # [o, h]
    if name == "bf16":
        return 2.0, 2.0, 2.0
    quantizer = LinearQuantizer(_recipe(name), None)
    weight_bytes = storage_bytes(quantizer.quantize("weight", w.detach())) / w.numel()
    kept = quantizer.quantize("input", x.detach()) if quantizer.per_tensor else None
    if kept is None:  # block recipes keep X quantized along the tokens for the weight gradient
        kept = quantizer.quantize("input", x.detach().t().contiguous(), "wgrad")
    saved: List[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() != w.data_ptr() and t.numel() == x.numel():  # the input, not scales or the weight
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        parallel_linear(x, w, None, None, "none", False, LinearQuantizer(_recipe(name), None))
    return weight_bytes, storage_bytes(kept) / x.numel(), sum(saved) / x.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--dir", default=os.path.join(REPO, "runs", "bench_fp8"))
    parser.add_argument("--corpus-mb", type=float, default=3.0)
    args = parser.parse_args()
    paths = prepare_data(args.dir, args.corpus_mb)
    names = args.recipes.split(",")
    results = {}
    for name in names:
        losses = train(paths, args.iters, RECIPES[name])
        results[name] = sum(losses[-10:]) / len(losses[-10:])
        print(f"{name:<11s} first loss {losses[0]:.4f}  mean of last 10 {results[name]:.4f}", flush=True)
    base = results.get("bf16")
    print(f"\n{'recipe':<11s} {'loss':>8s} {'/bf16':>7s} {'B/weight':>9s} {'B/saved act':>12s} {'held here':>10s}")
    for name in names:
        ratio = f"{results[name] / base:7.4f}" if base else "      -"
        w_bytes, a_bytes, held = measured_bytes(name)
        print(f"{name:<11s} {results[name]:8.4f} {ratio} {w_bytes:9.3f} {a_bytes:12.3f} {held:10.3f}")


if __name__ == "__main__":
    main()
