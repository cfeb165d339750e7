#!/usr/bin/env bash
# Llama-style ~1B training step on one GPU, seq 4096, bf16: ours with and without the fusions beside
# plain PyTorch eager and compiled (benchmarks/gpu_bench.py; about 5-8 minutes with compilation).
#
#   bash scripts/gpu_bench.sh            # one GPU, CUDA build of torch; JSON to ${OUT:-.}/gpu_bench.json
#   bash scripts/gpu_bench.sh --dry-run  # CPU, tiny model, nothing compiled: proves the script (CI runs it)
#
# PYTHON picks the interpreter (default: the project's .venv/bin/python, which scripts/setup_env.sh makes, else
# python3); extra arguments go to benchmarks/gpu_bench.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python3}
DEST=${OUT:-.}/gpu_bench.json
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ "${1:-}" = "--dry-run" ]; then
  shift
  DEST=${OUT:-${TMPDIR:-/tmp}}/gpu_bench_dry_run.json
  TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} timeout 600 \
    "$PY" benchmarks/gpu_bench.py --dry-run --warmup 1 --iters 1 --json "$DEST" "$@"
else
  timeout 900 "$PY" benchmarks/gpu_bench.py --json "$DEST" "$@"
fi
echo "wrote $DEST"
