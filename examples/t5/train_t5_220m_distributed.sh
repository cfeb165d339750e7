#!/usr/bin/env bash
# T5-base ("220M") pretraining, Megatron-LM's example flag set:
#   bash examples/t5/train_t5_220m_distributed.sh CKPT TENSORBOARD VOCAB_FILE DATA_PREFIX
# DATA_PREFIX is a sentence-split corpus (tools/preprocess_data.py --split-sentences ..._text_sentence) tokenized
# with the WordPiece VOCAB_FILE; --vocab-extra-ids 100 adds the sentinels. Once per node with torchrun, or from a
# Slurm job (srun, one task per GPU): see examples/lib/launch.bash. Sizes come from the environment, so the
# same script runs at toy scale on CPU:
#   GPUS_PER_NODE=2 LAYERS=2 HIDDEN=64 HEADS=4 KV=16 FFN=256 ENC_SEQ=64 DEC_SEQ=32 MBS=2 GBS=8 ITERS=20 TP=2 \
#     EXTRA="--num-workers 0" bash examples/t5/train_t5_220m_distributed.sh ckpt tb vocab.txt data_text_sentence
set -euo pipefail
# sbatch runs a copy of this file from Slurm's spool directory; the repository is then where sbatch was called.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
[ -f "$ROOT/examples/lib/launch.bash" ] || ROOT=${SLURM_SUBMIT_DIR:?run this script from the repository}
cd "$ROOT"
. examples/lib/launch.bash

CHECKPOINT_PATH=${1:?checkpoint directory}
TENSORBOARD_DIR=${2:?tensorboard directory}
VOCAB_FILE=${3:?WordPiece vocab.txt}
DATA_PATH=${4:?sentence-split dataset prefix}

T5_ARGS="--encoder-num-layers ${LAYERS:-12} --decoder-num-layers ${LAYERS:-12} --hidden-size ${HIDDEN:-768} \
  --num-attention-heads ${HEADS:-12} --kv-channels ${KV:-64} --ffn-hidden-size ${FFN:-3072} \
  --encoder-seq-length ${ENC_SEQ:-512} --decoder-seq-length ${DEC_SEQ:-128} --max-position-embeddings ${ENC_SEQ:-512} \
  --micro-batch-size ${MBS:-64} --global-batch-size ${GBS:-512} --lr 0.0001 --train-iters ${ITERS:-1000000} \
  --lr-decay-iters ${ITERS:-1000000} --lr-decay-style linear --min-lr 0.00001 --weight-decay 1e-2 \
  --lr-warmup-fraction .01 --clip-grad 1.0 ${PRECISION:---bf16} --vocab-extra-ids 100 --init-method-std 0.015 \
  --transformer-impl transformer_engine --tensor-model-parallel-size ${TP:-1} --pipeline-model-parallel-size 1 \
  --attention-backend auto"

DATA_ARGS="--data-path $DATA_PATH --vocab-file $VOCAB_FILE --tokenizer-type BertWordPieceCase --split ${SPLIT:-99982,9,9}"

OUTPUT_ARGS="--log-interval ${LOG_INTERVAL:-100} --tensorboard-dir $TENSORBOARD_DIR --save-interval ${SAVE_INTERVAL:-500} \
  --eval-interval ${EVAL_INTERVAL:-1000} --eval-iters 10"

# shellcheck disable=SC2086  # the *_ARGS strings are lists of flags
megatron_launch pretrain_t5.py $T5_ARGS $DATA_ARGS $OUTPUT_ARGS \
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" ${EXTRA:-}
