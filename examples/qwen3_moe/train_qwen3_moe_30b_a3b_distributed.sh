#!/usr/bin/env bash
# Qwen3-30B-A3B pretraining (48 layers, hidden 2048, 32 query heads in 4 groups of head size 128 with QK layernorm,
# every layer a MoE of 128 SwiGLU experts of FFN 768 with top-8 routing and a load-balancing loss, RMSNorm,
# RoPE with base 1e6, 151936-token vocabulary), bf16, experts spread over EP ranks with expert-TP 1:
#   bash examples/qwen3_moe/train_qwen3_moe_30b_a3b_distributed.sh CKPT TENSORBOARD TOKENIZER_DIR DATA_PREFIX
# TOKENIZER_DIR is a Hugging Face tokenizer directory (HuggingFaceTokenizer); DATA_PREFIX MOCK trains on mock data
# (NullTokenizer, VOCAB_SIZE tokens). Once per node with torchrun, or from a Slurm job (srun, one task per GPU).
# Sizes come from the environment, so the same script runs at toy scale on CPU:
#   GPUS_PER_NODE=2 NUM_LAYERS=2 HIDDEN=32 HEADS=4 QUERY_GROUPS=2 KV_CHANNELS=8 EXPERTS=4 MOE_FFN=32 TOPK=2 \
#     SEQ=32 MBS=2 GBS=8 ITERS=5 TP=1 PP=1 EP=2 PRECISION= VOCAB_SIZE=600 EXTRA="--distributed-backend gloo" \
#     bash examples/qwen3_moe/train_qwen3_moe_30b_a3b_distributed.sh ckpt tb - MOCK
set -euo pipefail
# sbatch runs a copy of this file from Slurm's spool directory; the repository is then where sbatch was called.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
[ -f "$ROOT/examples/lib/launch.bash" ] || ROOT=${SLURM_SUBMIT_DIR:?run this script from the repository}
cd "$ROOT"
. examples/lib/launch.bash

CHECKPOINT_PATH=${1:?checkpoint directory}
TENSORBOARD_LOGS_PATH=${2:?tensorboard directory}
TOKENIZER_DIR=${3:?Hugging Face tokenizer directory}
VOCAB_SIZE=${VOCAB_SIZE:-151936}
set_data_args "${4:?dataset prefix (..._text_document) or MOCK}" \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_DIR" --split 99990,8,2

MODEL_ARGS=(
  --num-layers "${NUM_LAYERS:-48}" --hidden-size "${HIDDEN:-2048}" --ffn-hidden-size "${FFN:-6144}"
  --num-attention-heads "${HEADS:-32}" --group-query-attention --num-query-groups "${QUERY_GROUPS:-4}"
  --kv-channels "${KV_CHANNELS:-128}" --qk-layernorm
  --seq-length "${SEQ:-4096}" --max-position-embeddings "${MAX_POSITIONS:-40960}"
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --position-embedding-type rope --rotary-base 1000000
  --untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
  --init-method-std 0.02
)
MOE_ARGS=(
  --num-experts "${EXPERTS:-128}" --moe-ffn-hidden-size "${MOE_FFN:-768}" --moe-router-topk "${TOPK:-8}"
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 --moe-router-dtype fp32
  --moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-permute-fusion
)
TRAINING_ARGS=(
  --micro-batch-size "${MBS:-1}" --global-batch-size "${GBS:-1024}" --train-iters "${ITERS:-500000}"
  --lr 1.2e-4 --min-lr 1.2e-5 --lr-decay-style cosine --lr-warmup-iters "${WARMUP_ITERS:-2000}"
  --weight-decay 0.1 --clip-grad 1.0 ${PRECISION---bf16} --use-distributed-optimizer --overlap-grad-reduce
)
MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size "${TP:-2}" --pipeline-model-parallel-size "${PP:-4}"
  --expert-model-parallel-size "${EP:-8}" --expert-tensor-parallel-size "${ETP:-1}" --sequence-parallel
)
EVAL_AND_LOGGING_ARGS=(
  --log-interval "${LOG_INTERVAL:-1}" --save-interval "${SAVE_INTERVAL:-10000}"
  --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters "${EVAL_ITERS:-10}"
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

# shellcheck disable=SC2086  # EXTRA is a list of flags
megatron_launch pretrain_gpt.py "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" \
  "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" ${EXTRA:-}
