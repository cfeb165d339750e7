#!/usr/bin/env bash
# GPU smoke test (one GPU, under 10 minutes), and its CPU part for CI.
#
#   bash scripts/gpu_smoke.sh            # on a machine with one GPU and a CUDA build of torch
#   bash scripts/gpu_smoke.sh --dry-run  # CPU only: the fake-CUDA dry-run grid (CI runs this)
#
# On the GPU: the dry run's device rules tried for real (NCCL at world size 1), our attention
# on the flash SDPA kernel, pretrain_gpt.py through torchrun --nproc-per-node 1 with real NCCL
# (bf16 + distributed optimizer + both overlaps + selective recompute; fp16 + full recompute;
# bf16 with the legacy checkpoint format), each saving and then resuming, and the dry-run grid
# with the real CUDA runtime. Each step prints PASS/FAIL with its time; the summary goes to
# stdout and, when $OUT is set, to $OUT/gpu_smoke_summary.txt (the grid's JSON beside it).
# PYTHON picks the interpreter (default: .venv/bin/python where scripts/setup_env.sh made one, else python3). Exit status 1 if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python3}
MODE=gpu
case "${1:-}" in
  --dry-run) MODE=dry-run ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-smoke.XXXXXX")
SUMMARY=$WORK/summary.txt
FAILED=0
export PYTHONUNBUFFERED=1

STEP_TIMEOUT_S=${STEP_TIMEOUT_S:-300}  # one hung NCCL step must not spend the whole device lease

# step NAME COMMAND...: run it with its output in $WORK/NAME.log; record PASS/FAIL and seconds.
# A step still running after STEP_TIMEOUT_S is terminated (with its children) and fails.
step() {
  local name=$1; shift
  local start rc ms line pid waited=0
  start=$(date +%s%N)
  "$@" >"$WORK/$name.log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    if (( waited >= STEP_TIMEOUT_S )); then
      echo "gpu_smoke: $name still running after ${STEP_TIMEOUT_S}s: terminated" >>"$WORK/$name.log"
      pkill -TERM -P "$pid"; kill -TERM "$pid" 2>/dev/null
      break
    fi
    sleep 1; waited=$((waited + 1))
  done
  wait "$pid"
  rc=$?
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  line=$(printf '%-4s %-28s %5d.%d s' "$([[ $rc == 0 ]] && echo PASS || echo FAIL)" "$name" $((ms / 1000)) \
         $((ms % 1000 / 100)))
  echo "$line" | tee -a "$SUMMARY"
  if [[ $rc != 0 ]]; then
    FAILED=1
    tail -n 25 "$WORK/$name.log" | sed 's/^/    | /'
  fi
}

GPT=(--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256
     --micro-batch-size 4 --global-batch-size 32 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
     --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 --mock-data --tokenizer-type NullTokenizer
     --vocab-size 1024 --num-workers 2 --log-interval 1 --eval-interval 1000 --eval-iters 2 --seed 1234
     --train-iters 6 --log-num-zeros-in-grad)

# train_and_resume NAME FLAGS...: 3 iterations and a save, then a new process resumes for 3 more.
train_and_resume() {
  local name=$1; shift
  local ckpt=$WORK/$name.ckpt
  $PY -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt.py "${GPT[@]}" "$@" \
      --exit-interval 3 --save "$ckpt" || return 1
  $PY -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt.py "${GPT[@]}" "$@" \
      --load "$ckpt" | tee "$WORK/$name.resume.out" || return 1
  grep -q "iteration        6/" "$WORK/$name.resume.out" || { echo "resume did not reach iteration 6"; return 1; }
  if grep -qiE "lm loss: (nan|inf)" "$WORK/$name.resume.out"; then echo "non-finite loss"; return 1; fi
}

dry_run_grid() {
  $PY tools/gpu_dry_run.py --dry-run-grid "${DRY_RUN_GRID:-all}" --dry-run-rank "${DRY_RUN_RANKS:-first,middle,last}" \
    --dry-run-workdir "$WORK/grid" --dry-run-json "$WORK/dry_run_grid.json"
}

echo "gpu_smoke ($MODE): logs in $WORK (removed if every step passes, unless KEEP_WORK is set)"
if [[ $MODE == gpu ]]; then
  step environment bash -c "nvidia-smi -L && $PY -c 'import torch; print(torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name(0)); assert torch.cuda.is_available()'"
  step device-rules $PY -m torch.distributed.run --standalone --nproc-per-node 1 scripts/gpu_checks.py rules
  step flash-attention $PY scripts/gpu_checks.py flash
  step bf16-distopt-overlap train_and_resume bf16 --bf16 --use-distributed-optimizer --overlap-grad-reduce \
      --overlap-param-gather --recompute-granularity selective
  step fp16-full-recompute train_and_resume fp16 --fp16 --recompute-granularity full --recompute-method uniform \
      --recompute-num-layers 1
  step bf16-legacy-checkpoint train_and_resume legacy --bf16 --ckpt-format torch
fi
step dry-run-grid dry_run_grid
tail -n 30 "$WORK/dry-run-grid.log"

if [[ -n ${OUT:-} ]]; then
  mkdir -p "$OUT"
  cp "$SUMMARY" "$OUT/gpu_smoke_summary.txt"
  [[ -f $WORK/dry_run_grid.json ]] && cp "$WORK/dry_run_grid.json" "$OUT/dry_run_grid.json"
  for name in device-rules flash-attention; do
    [[ -f $WORK/$name.log ]] && cp "$WORK/$name.log" "$OUT/$name.log"
  done
fi
echo "== gpu_smoke ($MODE) summary"
cat "$SUMMARY"
if [[ $FAILED == 0 && -z ${KEEP_WORK:-} ]]; then
  rm -rf "$WORK"  # logs, checkpoints and grid work dirs stay only when a step failed (or KEEP_WORK is set)
fi
exit $FAILED
