#!/usr/bin/env bash
# BERT-large ("340M") pretraining, Megatron-LM's example flag set:
#   bash examples/bert/train_bert_340m_distributed.sh CKPT TENSORBOARD VOCAB_FILE DATA_PREFIX
# DATA_PREFIX is a sentence-split corpus (tools/preprocess_data.py --split-sentences ..._text_sentence).
# Once per node with torchrun, or from a Slurm job (srun, one task per GPU): see examples/lib/launch.bash.
# Every size can be overridden from the environment, so the same script runs at toy scale on CPU:
#   GPUS_PER_NODE=2 NUM_LAYERS=2 HIDDEN=64 HEADS=4 SEQ=64 MBS=2 GBS=8 ITERS=20 TP=1 PP=2 PRECISION=--fp16 \
#     EXTRA="--num-workers 0" bash examples/bert/train_bert_340m_distributed.sh ckpt tb vocab.txt data_text_sentence
set -euo pipefail
# sbatch runs a copy of this file from Slurm's spool directory; the repository is then where sbatch was called.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
[ -f "$ROOT/examples/lib/launch.bash" ] || ROOT=${SLURM_SUBMIT_DIR:?run this script from the repository}
cd "$ROOT"
. examples/lib/launch.bash

CHECKPOINT_PATH=${1:?checkpoint directory}
TENSORBOARD_LOGS_PATH=${2:?tensorboard directory}
VOCAB_FILE=${3:?WordPiece vocab.txt}
DATA_PATH=${4:?sentence-split dataset prefix}

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

# shellcheck disable=SC2086  # EXTRA is a list of flags
megatron_launch pretrain_bert.py \
  "${BERT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
  "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" ${EXTRA:-}
