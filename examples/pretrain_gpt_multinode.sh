#!/usr/bin/env bash
# GPT 350M pretraining with torchrun on several nodes: run this script once on every node.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 DATA=/data/corpus_text_document TOKENIZER_DIR=/data/tok \
#     bash examples/pretrain_gpt_multinode.sh
# The GPT-3 script (examples/gpt3/train_gpt3_175b_distributed.sh) with 350M sizes on TP=2, sequence parallel and
# the distributed optimizer; every size it reads can still be overridden (DATA=MOCK: mock data).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA to a preprocessed prefix such as /data/corpus_text_document, or MOCK}
TOKENIZER_DIR=${TOKENIZER_DIR:-}
CKPT=${CKPT:-checkpoints/gpt-350m}
export NUM_NODES=${NNODES:-${NUM_NODES:-1}} NODE_RANK=${NODE_RANK:-0} MASTER_ADDR=${MASTER_ADDR:-localhost}
export NUM_LAYERS=${NUM_LAYERS:-24} HIDDEN=${HIDDEN:-1024} HEADS=${HEADS:-16} SEQ=${SEQ:-2048}
export MBS=${MBS:-4} GBS=${GBS:-256} ITERS=${ITERS:-100000} DECAY_ITERS=${DECAY_ITERS:-100000} RAMPUP=${RAMPUP-}
export TP=${TP:-2} PP=${PP:-1} PRECISION=${PRECISION---bf16} LOG_INTERVAL=${LOG_INTERVAL:-10}
export SAVE_INTERVAL=${SAVE_INTERVAL:-1000} EVAL_INTERVAL=${EVAL_INTERVAL:-1000}
export EXTRA="--sequence-parallel --use-distributed-optimizer --overlap-grad-reduce ${EXTRA:-}"
exec bash examples/gpt3/train_gpt3_175b_distributed.sh "$CKPT" "$CKPT/tensorboard" \
  "$TOKENIZER_DIR/vocab.json" "$TOKENIZER_DIR/merges.txt" "$DATA"
