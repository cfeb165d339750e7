#!/usr/bin/env bash
# BERT-large ("340M") pretraining, Megatron-LM's example flag set:
#   bash examples/bert/train_bert_340m_distributed.sh CKPT TENSORBOARD VOCAB_FILE DATA_PREFIX
# DATA_PREFIX is a sentence-split corpus (tools/preprocess_data.py --split-sentences ..._text_sentence).
# Every size can be overridden from the environment, so the same script runs at toy scale on CPU:
#   GPUS_PER_NODE=2 NUM_LAYERS=2 HIDDEN=64 HEADS=4 SEQ=64 MBS=2 GBS=8 ITERS=20 TP=1 PP=2 PRECISION=--fp16 \
#     EXTRA="--num-workers 0" bash examples/bert/train_bert_340m_distributed.sh ckpt tb vocab.txt data_text_sentence
set -euo pipefail
cd "$(dirname "$0")/../.."

CHECKPOINT_PATH=${1:?checkpoint directory}
TENSORBOARD_LOGS_PATH=${2:?tensorboard directory}
VOCAB_FILE=${3:?WordPiece vocab.txt}
DATA_PATH=${4:?sentence-split dataset prefix}

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}

DISTRIBUTED_ARGS=(
  --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NUM_NODES" --node_rank "$NODE_RANK"
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
)
BERT_MODEL_ARGS=(
  --num-layers "${NUM_LAYERS:-24}" --hidden-size "${HIDDEN:-1024}" --num-attention-heads "${HEADS:-16}"
  --seq-length "${SEQ:-512}" --max-position-embeddings "${SEQ:-512}" --attention-backend auto
)
TRAINING_ARGS=(
  --micro-batch-size "${MBS:-4}" --global-batch-size "${GBS:-32}" --train-iters "${ITERS:-1000000}"
  --weight-decay 1e-2 --clip-grad 1.0 ${PRECISION:---fp16} --lr 0.0001 --lr-decay-iters "${DECAY_ITERS:-990000}"
  --lr-decay-style linear --min-lr 1.0e-5 --lr-warmup-fraction .01
)
MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size "${TP:-8}" --pipeline-model-parallel-size "${PP:-16}"
)
DATA_ARGS=(
  --data-path "$DATA_PATH" --vocab-file "$VOCAB_FILE" --split 949,50,1
)
EVAL_AND_LOGGING_ARGS=(
  --log-interval "${LOG_INTERVAL:-100}" --save-interval "${SAVE_INTERVAL:-10000}" --eval-interval "${EVAL_INTERVAL:-1000}"
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --eval-iters 10 --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

# shellcheck disable=SC2086  # EXTRA is a list of flags, TORCHRUN a command (default torchrun)
${TORCHRUN:-torchrun} "${DISTRIBUTED_ARGS[@]}" pretrain_bert.py \
  "${BERT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
  "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" ${EXTRA:-}
