#!/usr/bin/env bash
# GPT-3 175B pretraining with Megatron-LM's published layout (TP=8, PP=16 over 16 nodes of 8 GPUs, fp16, batch
# ramp-up to 1536):
#   bash examples/gpt3/train_gpt3_175b_distributed.sh CKPT TENSORBOARD VOCAB_FILE MERGE_FILE DATA_PREFIX
# DATA_PREFIX MOCK trains on mock data (NullTokenizer, VOCAB_SIZE tokens; VOCAB_FILE and MERGE_FILE unused).
# Once per node with torchrun (NUM_NODES, NODE_RANK, MASTER_ADDR), or from a Slurm job, where srun starts one
# task per GPU (examples/slurm/pretrain_gpt.sbatch adds signal handling and requeue). Sizes come from the
# environment, so the same script runs at toy scale on CPU:
#   GPUS_PER_NODE=2 NUM_LAYERS=2 HIDDEN=32 HEADS=4 SEQ=32 MBS=2 GBS=8 RAMPUP= ITERS=5 TP=2 PP=1 PRECISION= \
#     VOCAB_SIZE=600 EXTRA="--distributed-backend gloo" bash examples/gpt3/train_gpt3_175b_distributed.sh ckpt tb - - MOCK
set -euo pipefail
# sbatch runs a copy of this file from Slurm's spool directory; the repository is then where sbatch was called.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
[ -f "$ROOT/examples/lib/launch.bash" ] || ROOT=${SLURM_SUBMIT_DIR:?run this script from the repository}
cd "$ROOT"
. examples/lib/launch.bash

CHECKPOINT_PATH=${1:?checkpoint directory}
TENSORBOARD_LOGS_PATH=${2:?tensorboard directory}
VOCAB_FILE=${3:?GPT-2 vocab.json}
MERGE_FILE=${4:?GPT-2 merges.txt}
VOCAB_SIZE=${VOCAB_SIZE:-50257}
set_data_args "${5:?dataset prefix (..._text_document) or MOCK}" \
  --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" --split 949,50,1

GPT_MODEL_ARGS=(
  --num-layers "${NUM_LAYERS:-96}" --hidden-size "${HIDDEN:-12288}" --num-attention-heads "${HEADS:-96}"
  --seq-length "${SEQ:-2048}" --max-position-embeddings "${SEQ:-2048}" --init-method-std 0.006
)
# RAMPUP="" turns the batch-size ramp-up off (it needs GBS to be reachable in steps of its increment).
RAMPUP=${RAMPUP-16 16 5859375}
TRAINING_ARGS=(
  --micro-batch-size "${MBS:-1}" --global-batch-size "${GBS:-1536}" ${RAMPUP:+--rampup-batch-size $RAMPUP}
  --train-iters "${ITERS:-500000}" --lr-decay-iters "${DECAY_ITERS:-430000}" --lr 6.0e-5 --min-lr 6.0e-6
  --lr-decay-style cosine --lr-warmup-fraction .001 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
  --clip-grad 1.0 ${PRECISION---fp16}
)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size "${TP:-8}" --pipeline-model-parallel-size "${PP:-16}")
EVAL_AND_LOGGING_ARGS=(
  --log-interval "${LOG_INTERVAL:-100}" --save-interval "${SAVE_INTERVAL:-10000}"
  --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters "${EVAL_ITERS:-10}"
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

# shellcheck disable=SC2086  # EXTRA is a list of flags
megatron_launch pretrain_gpt.py "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
  "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" ${EXTRA:-}
