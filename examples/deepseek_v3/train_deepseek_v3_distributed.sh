#!/usr/bin/env bash
# DeepSeek-V3 pretraining (61 layers, hidden 7168, multi-latent attention with q/kv latents of 1536/512 and YaRN RoPE,
# 3 dense layers then 58 MoE layers of 256 routed experts (FFN 2048, top-8 of 8 groups / 4 chosen, sigmoid scores,
# aux-loss-free expert bias, scaling 2.5) plus one shared expert, 129280-token vocabulary), bf16:
#   bash examples/deepseek_v3/train_deepseek_v3_distributed.sh CKPT TENSORBOARD TOKENIZER_DIR DATA_PREFIX
# TOKENIZER_DIR is a Hugging Face tokenizer directory (HuggingFaceTokenizer); DATA_PREFIX MOCK trains on mock data
# (NullTokenizer, VOCAB_SIZE tokens). Once per node with torchrun, or from a Slurm job (srun, one task per GPU).
# Multi-token prediction: MTP_LAYERS modules (DeepSeek trains with 1, the default; 0 turns it off) on the last
# pipeline stage. DSA_TOPK=K: DeepSeek-V3.2's sparse attention (a lightning indexer of DSA_HEADS heads of DSA_HEAD_DIM
# channels, V3.2's 64 and 128 by default, keeps K keys per query; V3.2 uses 2048). Sizes come from the environment,
# so the same script runs at toy scale on CPU:
#   GPUS_PER_NODE=2 NUM_LAYERS=2 DENSE_LAYERS=1 HIDDEN=32 FFN=64 HEADS=4 EXPERTS=4 MOE_FFN=32 ROUTER_GROUPS=2 \
#     GROUP_TOPK=1 TOPK=2 Q_LORA=16 KV_LORA=16 QK_HEAD=8 QK_POS=8 V_HEAD=8 SEQ=32 MBS=2 GBS=8 ITERS=5 TP=1 PP=1 EP=2 \
#     MTP_LAYERS=1 WARMUP_ITERS=1 PRECISION= VOCAB_SIZE=600 EXTRA="--distributed-backend gloo" \
#     bash examples/deepseek_v3/train_deepseek_v3_distributed.sh ckpt tb - MOCK
set -euo pipefail
# sbatch runs a copy of this file from Slurm's spool directory; the repository is then where sbatch was called.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
[ -f "$ROOT/examples/lib/launch.bash" ] || ROOT=${SLURM_SUBMIT_DIR:?run this script from the repository}
cd "$ROOT"
. examples/lib/launch.bash

CHECKPOINT_PATH=${1:?checkpoint directory}
TENSORBOARD_LOGS_PATH=${2:?tensorboard directory}
TOKENIZER_DIR=${3:?Hugging Face tokenizer directory}
VOCAB_SIZE=${VOCAB_SIZE:-129280}
set_data_args "${4:?dataset prefix (..._text_document) or MOCK}" \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_DIR" --split 99990,8,2

NUM_LAYERS=${NUM_LAYERS:-61}
DENSE_LAYERS=${DENSE_LAYERS:-3}
MODEL_ARGS=(
  --num-layers "$NUM_LAYERS" --hidden-size "${HIDDEN:-7168}" --ffn-hidden-size "${FFN:-18432}"
  --num-attention-heads "${HEADS:-128}" --seq-length "${SEQ:-4096}" --max-position-embeddings "${SEQ:-4096}"
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights
  --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.006
  --position-embedding-type rope --rotary-base 10000
)
MLA_ARGS=(
  --multi-latent-attention --q-lora-rank "${Q_LORA:-1536}" --kv-lora-rank "${KV_LORA:-512}"
  --qk-head-dim "${QK_HEAD:-128}" --qk-pos-emb-head-dim "${QK_POS:-64}" --v-head-dim "${V_HEAD:-128}" --qk-layernorm
  --rope-type yarn --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
)
MOE_ARGS=(
  --num-experts "${EXPERTS:-256}" --moe-ffn-hidden-size "${MOE_FFN:-2048}"
  --moe-shared-expert-intermediate-size "${MOE_FFN:-2048}"
  --moe-layer-freq "([0]*$DENSE_LAYERS+[1]*$((NUM_LAYERS - DENSE_LAYERS)))"
  --moe-router-topk "${TOPK:-8}" --moe-router-num-groups "${ROUTER_GROUPS:-8}" --moe-router-group-topk "${GROUP_TOPK:-4}"
  --moe-router-score-function sigmoid --moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32
  --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
  --moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-permute-fusion
)
if [ -n "${DSA_TOPK:-}" ]; then
  MLA_ARGS+=(--experimental-attention-variant dsa --dsa-indexer-n-heads "${DSA_HEADS:-64}"
    --dsa-indexer-head-dim "${DSA_HEAD_DIM:-128}" --dsa-indexer-topk "$DSA_TOPK")
fi
if [ "${MTP_LAYERS:-1}" -gt 0 ]; then
  MOE_ARGS+=(--mtp-num-layers "$MTP_LAYERS" --mtp-loss-scaling-factor 0.1)
fi
TRAINING_ARGS=(
  --micro-batch-size "${MBS:-1}" --global-batch-size "${GBS:-8192}" --train-iters "${ITERS:-500000}"
  --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine --lr-warmup-iters "${WARMUP_ITERS:-2000}"
  --weight-decay 0.1 --clip-grad 1.0 ${PRECISION---bf16} --use-distributed-optimizer --overlap-grad-reduce
)
MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size "${TP:-2}" --pipeline-model-parallel-size "${PP:-16}"
  --expert-model-parallel-size "${EP:-64}" --expert-tensor-parallel-size "${ETP:-1}" --sequence-parallel
)
EVAL_AND_LOGGING_ARGS=(
  --log-interval "${LOG_INTERVAL:-1}" --save-interval "${SAVE_INTERVAL:-10000}"
  --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters "${EVAL_ITERS:-10}"
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

# shellcheck disable=SC2086  # EXTRA is a list of flags
megatron_launch pretrain_gpt.py "${MODEL_ARGS[@]}" "${MLA_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" \
  "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" ${EXTRA:-}
