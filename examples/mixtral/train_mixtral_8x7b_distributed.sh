#!/usr/bin/env bash
# Mixtral 8x7B pretraining (32 layers, hidden 4096, 8 SwiGLU experts of FFN 14336 with top-2 routing and a
# load-balancing loss, 32 heads in 8 query groups, RMSNorm, RoPE with base 1e6, 32000-token vocabulary), bf16,
# experts spread over EP ranks:
#   bash examples/mixtral/train_mixtral_8x7b_distributed.sh CKPT TENSORBOARD TOKENIZER_MODEL DATA_PREFIX
# TOKENIZER_MODEL is the SentencePiece tokenizer.model (Llama2Tokenizer); DATA_PREFIX MOCK trains on mock data
# (NullTokenizer, VOCAB_SIZE tokens). Once per node with torchrun, or from a Slurm job (srun, one task per GPU).
# Sizes come from the environment, so the same script runs at toy scale on CPU:
#   GPUS_PER_NODE=2 NUM_LAYERS=2 HIDDEN=64 FFN=128 HEADS=4 QUERY_GROUPS=2 EXPERTS=4 SEQ=32 MBS=2 GBS=8 ITERS=5 \
#     TP=1 EP=2 PRECISION= VOCAB_SIZE=600 EXTRA="--distributed-backend gloo" \
#     bash examples/mixtral/train_mixtral_8x7b_distributed.sh ckpt tb - MOCK
set -euo pipefail
# sbatch runs a copy of this file from Slurm's spool directory; the repository is then where sbatch was called.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
[ -f "$ROOT/examples/lib/launch.bash" ] || ROOT=${SLURM_SUBMIT_DIR:?run this script from the repository}
cd "$ROOT"
. examples/lib/launch.bash

CHECKPOINT_PATH=${1:?checkpoint directory}
TENSORBOARD_LOGS_PATH=${2:?tensorboard directory}
TOKENIZER_MODEL=${3:?SentencePiece tokenizer.model}
VOCAB_SIZE=${VOCAB_SIZE:-32000}
set_data_args "${4:?dataset prefix (..._text_document) or MOCK}" \
  --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL" --split 99990,8,2

MODEL_ARGS=(
  --num-layers "${NUM_LAYERS:-32}" --hidden-size "${HIDDEN:-4096}" --ffn-hidden-size "${FFN:-14336}"
  --num-attention-heads "${HEADS:-32}" --group-query-attention --num-query-groups "${QUERY_GROUPS:-8}"
  --seq-length "${SEQ:-4096}" --max-position-embeddings "${SEQ:-4096}"
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope --rotary-base 1000000
  --untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
  --init-method-std 0.01
)
MOE_ARGS=(
  --num-experts "${EXPERTS:-8}" --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
  --moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall
)
TRAINING_ARGS=(
  --micro-batch-size "${MBS:-1}" --global-batch-size "${GBS:-256}" --train-iters "${ITERS:-500000}"
  --lr 1e-4 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-iters "${WARMUP_ITERS:-500}"
  --weight-decay 0.1 --clip-grad 1.0 ${PRECISION---bf16} --use-distributed-optimizer --overlap-grad-reduce
)
MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-4}"
  --expert-model-parallel-size "${EP:-8}" --sequence-parallel
)
EVAL_AND_LOGGING_ARGS=(
  --log-interval "${LOG_INTERVAL:-1}" --save-interval "${SAVE_INTERVAL:-10000}"
  --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters "${EVAL_ITERS:-10}"
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

# shellcheck disable=SC2086  # EXTRA is a list of flags
megatron_launch pretrain_gpt.py "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" \
  "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" ${EXTRA:-}
