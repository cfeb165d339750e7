#!/usr/bin/env bash
# GPT pretraining with torchrun on several nodes: run this script once on every node.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash examples/pretrain_gpt_multinode.sh
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
DATA=${DATA:?set DATA to a preprocessed prefix such as /data/corpus_text_document}
TOKENIZER_DIR=${TOKENIZER_DIR:?set TOKENIZER_DIR to the folder with vocab.json and merges.txt}
CKPT=${CKPT:-checkpoints/gpt-350m}

torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" pretrain_gpt.py \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel \
  --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
  --seq-length 2048 --max-position-embeddings 2048 \
  --micro-batch-size 4 --global-batch-size 256 --train-iters 100000 \
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 \
  --weight-decay 0.1 --clip-grad 1.0 --bf16 --use-distributed-optimizer --overlap-grad-reduce \
  --tokenizer-type GPT2BPETokenizer --vocab-file "$TOKENIZER_DIR/vocab.json" \
  --merge-file "$TOKENIZER_DIR/merges.txt" --data-path "$DATA" --split 969,30,1 \
  --save "$CKPT" --load "$CKPT" --save-interval 1000 \
  --log-interval 10 --eval-interval 1000 --eval-iters 10 --tensorboard-dir "$CKPT/tensorboard"
