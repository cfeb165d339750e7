#!/usr/bin/env bash
# Megatron-LM's hybrid Mamba example (examples/mamba/train.sh): Mamba-2 layers with ~8% attention and 50% MLP layers
# (--hybrid-attention-ratio 0.08 --hybrid-mlp-ratio 0.5), GQA, no position embedding, RMSNorm, TP with sequence
# parallelism and the distributed optimizer:
#   bash examples/mamba/train.sh DATA_PREFIX TOKENIZER_MODEL      # MODEL_SCALE=800M (default) or 8B
# DATA_PREFIX MOCK trains on mock data (NullTokenizer, VOCAB_SIZE tokens; TOKENIZER_MODEL unused). Sizes come from
# the environment, so the same flags run at toy scale on 2 CPU ranks:
#   GPUS_PER_NODE=2 NUM_LAYERS=4 HIDDEN=64 HEADS=4 QUERY_GROUPS=2 SEQ=64 MBS=2 GBS=8 ITERS=10 TP=2 PRECISION= \
#     MAMBA_EXTRA="--mamba-state-dim 16 --mamba-head-dim 16 --mamba-num-groups 2" VOCAB_SIZE=600 \
#     EXTRA="--distributed-backend gloo --num-workers 0" bash examples/mamba/train.sh MOCK -
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
. examples/lib/launch.bash

case "${MODEL_SCALE:-800M}" in
  800M) TP=${TP:-1} NUM_LAYERS=${NUM_LAYERS:-48} HIDDEN=${HIDDEN:-1024} HEADS=${HEADS:-16} GBS=${GBS:-32} ;;
  8B) TP=${TP:-4} NUM_LAYERS=${NUM_LAYERS:-56} HIDDEN=${HIDDEN:-4096} HEADS=${HEADS:-32} GBS=${GBS:-8} ;;
  *) echo "MODEL_SCALE=$MODEL_SCALE: use 800M or 8B" >&2; exit 2 ;;
esac
set_data_args "${1:?dataset prefix (..._text_document) or MOCK}" \
  --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "${2:?tokenizer model}" --split 99,1,0 \
  --data-cache-path "${DATACACHE_DIR:-./data-cache}"
CHECKPOINT_DIR=${CHECKPOINT_DIR:-./checkpoints}
SEQ=${SEQ:-4096}
TRAIN_SAMPLES=${TRAIN_SAMPLES:-73242188}  # 300B tokens / 4096
WARMUP=${LR_WARMUP_SAMPLES:-50000}

OPTIONS=(
  --tensor-model-parallel-size "$TP" --sequence-parallel --pipeline-model-parallel-size 1
  --use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce
  --untie-embeddings-and-output-weights --init-method-std 0.02 --position-embedding-type none
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
  --group-query-attention --num-query-groups "${QUERY_GROUPS:-8}"
  --hybrid-attention-ratio 0.08 --hybrid-mlp-ratio 0.5
  --seq-length "$SEQ" --max-position-embeddings "$SEQ"
  --micro-batch-size "${MBS:-4}" --global-batch-size "$GBS"
)
if [ -n "${ITERS:-}" ]; then  # toy runs count iterations; Megatron's example counts samples
  OPTIONS+=(--train-iters "$ITERS" --lr-warmup-iters 1)
else
  OPTIONS+=(--train-samples "$TRAIN_SAMPLES" --lr-warmup-samples "$WARMUP"
    --lr-decay-samples $((TRAIN_SAMPLES - WARMUP)))
fi
OPTIONS+=(
  --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR"
  --lr 2.5e-4 --min-lr 2.5e-5 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0
  --attention-dropout 0.0 --hidden-dropout 0.0 --disable-bias-linear --normalization RMSNorm
  --adam-beta1 0.9 --adam-beta2 0.95
  --log-interval "${LOG_INTERVAL:-10}" --save-interval "${SAVE_INTERVAL:-2000}"
  --eval-interval "${EVAL_INTERVAL:-2000}" --eval-iters "${EVAL_ITERS:-32}"
  ${PRECISION---bf16} --use-mcore-models --spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec
  --no-create-attention-mask-in-dataloader --tensorboard-dir "${TENSORBOARD_DIR:-./tensorboard}"
)

# shellcheck disable=SC2086  # MAMBA_EXTRA and EXTRA are lists of flags
megatron_launch pretrain_mamba.py "${OPTIONS[@]}" "${DATA_ARGS[@]}" ${MAMBA_EXTRA:-} ${EXTRA:-}
