#!/usr/bin/env bash
# DeepSeek-V4-Flash-shaped pretraining (43 layers, hidden 4096, 64 heads of 512 channels sharing one key/value head,
# query latent 1024, partial interleaved RoPE on 64 channels; attention types: 2 heavily compressed (HCA, 128 tokens
# per entry) then CSA (4 per entry, a lightning indexer of 64 heads x 128 keeping 512 entries) and HCA alternating,
# each beside a 128-token sliding window, learned sinks, grouped low-rank output (8 groups of rank 1024); 4
# hyper-connection streams (20 Sinkhorn iterations); MoE in every layer, 256 routed experts (FFN 2048, top-6, scaling
# 1.5) plus one shared, the first 3 layers hash-routed by token id; SwiGLU clamped at 10), bf16:
#   bash examples/deepseek_v4/train_deepseek_v4_distributed.sh CKPT TENSORBOARD TOKENIZER_DIR DATA_PREFIX
# TOKENIZER_DIR is a Hugging Face tokenizer directory; DATA_PREFIX MOCK trains on mock data (NullTokenizer, VOCAB_SIZE
# tokens). Once per node with torchrun, or from a Slurm job (srun, one task per GPU). MTP_LAYERS prediction modules
# (default 1; 0 turns them off). Router scores are V4's sqrtsoftplus. Sizes come from
# the environment, so the same script runs at toy scale on CPU:
#   GPUS_PER_NODE=2 NUM_LAYERS=4 HIDDEN=32 HEADS=4 HEAD_DIM=16 ROPE_PERCENT=0.5 Q_LORA=12 O_GROUPS=2 O_LORA=6 \
#     WINDOW=8 CSA_RATE=4 HCA_RATE=8 INDEX_HEADS=2 INDEX_HEAD_DIM=8 INDEX_TOPK=3 HC=2 EXPERTS=4 MOE_FFN=16 TOPK=2 \
#     HASH_LAYERS=1 SEQ=32 MBS=2 GBS=8 ITERS=3 TP=2 EP=2 WARMUP_ITERS=1 PRECISION= VOCAB_SIZE=600 \
#     EXTRA="--distributed-backend gloo" bash examples/deepseek_v4/train_deepseek_v4_distributed.sh ckpt tb - MOCK
# TP=1 PP=2 EP=1 trains the same toy on 2 pipeline stages (they pass the HC hyper-connection streams on).
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

NUM_LAYERS=${NUM_LAYERS:-43}
LAYER_TYPES=()  # V4's default schedule: two HCA layers, then CSA and HCA alternating
for ((i = 0; i < NUM_LAYERS; i++)); do
  if ((i >= 2 && (i - 2) % 2 == 1)); then LAYER_TYPES+=(compressed_sparse_attention)
  else LAYER_TYPES+=(heavily_compressed_attention); fi
done
MODEL_ARGS=(
  --num-layers "$NUM_LAYERS" --hidden-size "${HIDDEN:-4096}" --ffn-hidden-size "${MOE_FFN:-2048}"
  --num-attention-heads "${HEADS:-64}" --kv-channels "${HEAD_DIM:-512}" --seq-length "${SEQ:-4096}"
  --max-position-embeddings "${SEQ:-4096}" --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
  --activation-func-clamp-value 10 --untie-embeddings-and-output-weights --disable-bias-linear
  --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.006
  --position-embedding-type rope --rotary-base 10000 --rotary-interleaved --rotary-percent "${ROPE_PERCENT:-0.125}"
)
ATTENTION_ARGS=(
  --compressed-attention-layer-types "${LAYER_TYPES[@]}" --q-lora-rank "${Q_LORA:-1024}"
  --window-size "$((${WINDOW:-128} - 1)),0" --csa-compress-rate "${CSA_RATE:-4}" --hca-compress-rate "${HCA_RATE:-128}"
  --compressed-attention-rotary-base 160000 --attention-output-groups "${O_GROUPS:-8}"
  --attention-output-lora-rank "${O_LORA:-1024}" --dsa-indexer-n-heads "${INDEX_HEADS:-64}"
  --dsa-indexer-head-dim "${INDEX_HEAD_DIM:-128}" --dsa-indexer-topk "${INDEX_TOPK:-512}"
  --hyper-connection-streams "${HC:-4}" --hyper-connection-sinkhorn-iterations 20
)
MOE_ARGS=(
  --num-experts "${EXPERTS:-256}" --moe-ffn-hidden-size "${MOE_FFN:-2048}"
  --moe-shared-expert-intermediate-size "${MOE_FFN:-2048}" --moe-num-hash-layers "${HASH_LAYERS:-3}"
  --moe-router-topk "${TOPK:-6}" --moe-router-score-function sqrtsoftplus --moe-router-topk-scaling-factor 1.5
  --moe-router-dtype fp32 --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
  --moe-grouped-gemm --moe-token-dispatcher-type alltoall
)
if [ "${MTP_LAYERS:-1}" -gt 0 ]; then
  MOE_ARGS+=(--mtp-num-layers "${MTP_LAYERS:-1}" --mtp-loss-scaling-factor 0.1)
fi
TRAINING_ARGS=(
  --micro-batch-size "${MBS:-1}" --global-batch-size "${GBS:-8192}" --train-iters "${ITERS:-500000}"
  --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine --lr-warmup-iters "${WARMUP_ITERS:-2000}"
  --weight-decay 0.1 --clip-grad 1.0 ${PRECISION---bf16} --use-distributed-optimizer --overlap-grad-reduce
)
MODEL_PARALLEL_ARGS=(  # PP stages pass the hyper-connection streams on; 43 layers split evenly only with PP=1 or 43
  --tensor-model-parallel-size "${TP:-8}" --pipeline-model-parallel-size "${PP:-1}"
  --expert-model-parallel-size "${EP:-64}" --expert-tensor-parallel-size "${ETP:-1}" --sequence-parallel
)
EVAL_AND_LOGGING_ARGS=(
  --log-interval "${LOG_INTERVAL:-1}" --save-interval "${SAVE_INTERVAL:-10000}"
  --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters "${EVAL_ITERS:-10}"
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

# shellcheck disable=SC2086  # EXTRA is a list of flags
megatron_launch pretrain_gpt.py "${MODEL_ARGS[@]}" "${ATTENTION_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" \
  "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" ${EXTRA:-}
