#!/usr/bin/env bash
# The main job, from a fresh clone: set up .venv, make a small corpus that needs no download
# (Python standard-library docstrings), train a GPT-2 BPE tokenizer on it, preprocess it into
# Megatron's .bin/.idx format, then pretrain a small GPT on 2 CPU ranks (tensor parallel).
#
#   bash examples/quickstart.sh            # everything under runs/quickstart
#   QUICKSTART_DIR=/tmp/q TRAIN_ITERS=50 bash examples/quickstart.sh
#   QUICKSTART_DIR=/tmp/smoke CORPUS_MB=0.3 TRAIN_ITERS=3 LOG_INTERVAL=1 bash examples/quickstart.sh   # a quick smoke test
# Rerunnable: a second run reuses the corpus, tokenizer and data it finds, and resumes from the checkpoints
# (with TRAIN_ITERS above the last run's it trains on; at or below, it only evaluates); each step says which.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate

DIR=${QUICKSTART_DIR:-runs/quickstart}
ITERS=${TRAIN_ITERS:-200}
WARMUP=$((ITERS / 10 < 20 ? ITERS / 10 : 20))
mkdir -p "$DIR"
say() { echo "quickstart: $*"; }

# A second run reuses what the first made (delete the file or folder to make it again).
if [[ -s "$DIR/corpus.jsonl" ]]; then
  say "reusing the corpus $DIR/corpus.jsonl"
else
  say "writing a sample corpus to $DIR/corpus.jsonl"
  python tools/make_sample_corpus.py --output "$DIR/corpus.jsonl" --max-mb "${CORPUS_MB:-3}"
fi
if [[ -s "$DIR/tokenizer/vocab.json" && -s "$DIR/tokenizer/merges.txt" ]]; then
  say "reusing the tokenizer in $DIR/tokenizer"
else
  say "training a GPT-2 BPE tokenizer into $DIR/tokenizer"
  python tools/train_tokenizer.py --input "$DIR/corpus.jsonl" --type gpt2bpe --vocab-size 8000 \
    --output-dir "$DIR/tokenizer"
fi
if [[ -s "$DIR/data_text_document.bin" && -s "$DIR/data_text_document.idx" ]]; then
  say "reusing the preprocessed data $DIR/data_text_document.{bin,idx}"
else
  say "preprocessing the corpus into $DIR/data_text_document.{bin,idx}"
  python tools/preprocess_data.py --input "$DIR/corpus.jsonl" --output-prefix "$DIR/data" \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$DIR/tokenizer/vocab.json" \
    --merge-file "$DIR/tokenizer/merges.txt" --append-eod --workers 2
fi

LOAD=()
if [[ -f "$DIR/checkpoints/latest_checkpointed_iteration.txt" ]]; then
  say "resuming from $DIR/checkpoints (iteration $(cat "$DIR/checkpoints/latest_checkpointed_iteration.txt")) \
up to $ITERS iterations; to train from scratch: rm -rf $DIR/checkpoints"
  LOAD=(--load "$DIR/checkpoints" --override-opt-param-scheduler)  # the LR schedule follows this TRAIN_ITERS
else
  say "training from scratch: checkpoints in $DIR/checkpoints, TensorBoard logs in $DIR/tensorboard"
fi

# TORCHRUN replaces the launcher (default torchrun; the tests give a one-node stand-in).
# shellcheck disable=SC2086  # TORCHRUN is a command with its arguments
OMP_NUM_THREADS=1 ${TORCHRUN:-torchrun} --standalone --nproc-per-node 2 pretrain_gpt.py \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 \
  --seq-length 128 --max-position-embeddings 128 \
  --micro-batch-size 4 --global-batch-size 16 \
  --train-iters "$ITERS" --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters "$WARMUP" \
  --weight-decay 0.1 --clip-grad 1.0 \
  --tokenizer-type GPT2BPETokenizer --vocab-file "$DIR/tokenizer/vocab.json" \
  --merge-file "$DIR/tokenizer/merges.txt" \
  --data-path "$DIR/data_text_document" --split 949,50,1 --num-workers 0 \
  --log-interval "${LOG_INTERVAL:-10}" --eval-interval 100 --eval-iters 5 \
  --save "$DIR/checkpoints" --save-interval 100 --tensorboard-dir "$DIR/tensorboard" "${LOAD[@]}"
say "done: checkpoints in $DIR/checkpoints; TensorBoard: tensorboard --logdir $DIR/tensorboard"
