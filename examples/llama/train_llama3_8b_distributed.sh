#!/usr/bin/env bash
# Llama-3 8B pretraining (32 layers, hidden 4096, SwiGLU FFN 14336, 32 heads in 8 query groups, RMSNorm, RoPE with
# base 500000, 128256-token vocabulary, untied output, no biases), bf16 with the distributed optimizer:
#   bash examples/llama/train_llama3_8b_distributed.sh CKPT TENSORBOARD TOKENIZER_DIR DATA_PREFIX
# TOKENIZER_DIR holds the Hugging Face tokenizer files (HuggingFaceTokenizer); DATA_PREFIX MOCK trains on mock
# data (NullTokenizer, VOCAB_SIZE tokens). Once per node with torchrun, or from a Slurm job (srun, one task per GPU).
# Sizes come from the environment, so the same script runs at toy scale on CPU:
#   GPUS_PER_NODE=2 NUM_LAYERS=2 HIDDEN=64 FFN=128 HEADS=4 QUERY_GROUPS=2 SEQ=32 MBS=2 GBS=8 ITERS=5 TP=2 \
#     PRECISION= VOCAB_SIZE=600 EXTRA="--distributed-backend gloo" \
#     bash examples/llama/train_llama3_8b_distributed.sh ckpt tb - MOCK
set -euo pipefail
# sbatch runs a copy of this file from Slurm's spool directory; the repository is then where sbatch was called.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
[ -f "$ROOT/examples/lib/launch.bash" ] || ROOT=${SLURM_SUBMIT_DIR:?run this script from the repository}
cd "$ROOT"
. examples/lib/launch.bash

CHECKPOINT_PATH=${1:?checkpoint directory}
TENSORBOARD_LOGS_PATH=${2:?tensorboard directory}
TOKENIZER_DIR=${3:?Hugging Face tokenizer directory}
VOCAB_SIZE=${VOCAB_SIZE:-128256}
set_data_args "${4:?dataset prefix (..._text_document) or MOCK}" \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_DIR" --split 99,1,0

MODEL_ARGS=(
  --num-layers "${NUM_LAYERS:-32}" --hidden-size "${HIDDEN:-4096}" --ffn-hidden-size "${FFN:-14336}"
  --num-attention-heads "${HEADS:-32}" --group-query-attention --num-query-groups "${QUERY_GROUPS:-8}"
  --seq-length "${SEQ:-8192}" --max-position-embeddings "${SEQ:-8192}"
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope --rotary-base 500000
  --untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
  --init-method-std 0.0134
)
TRAINING_ARGS=(
  --micro-batch-size "${MBS:-1}" --global-batch-size "${GBS:-128}" --train-iters "${ITERS:-500000}"
  --lr 1.5e-4 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-iters "${WARMUP_ITERS:-2000}"
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 ${PRECISION---bf16}
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-1}"
  --context-parallel-size "${CP:-1}" --sequence-parallel
)
EVAL_AND_LOGGING_ARGS=(
  --log-interval "${LOG_INTERVAL:-10}" --save-interval "${SAVE_INTERVAL:-1000}"
  --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters "${EVAL_ITERS:-32}"
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

# shellcheck disable=SC2086  # EXTRA is a list of flags
megatron_launch pretrain_gpt.py "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
  "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" ${EXTRA:-}
