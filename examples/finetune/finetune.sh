#!/usr/bin/env bash
# Supervised fine-tuning end to end, offline, on 2 CPU ranks:
#   a tiny Llama-style chat model made locally -> convert.py -> fine-tune on a generated chat set
#   (packed conversations, loss on assistant tokens, evaluation on a held-out split)
#   -> export to Hugging Face (logits checked against our checkpoint, 1e-4) -> serve, ask /v1/chat/completions.
#
#   bash examples/finetune/finetune.sh                      # everything under runs/finetune
#   FINETUNE_DIR=/tmp/ft TRAIN_ITERS=10 bash examples/finetune/finetune.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup_env.sh
. .venv/bin/activate

DIR=${FINETUNE_DIR:-runs/finetune}
ITERS=${TRAIN_ITERS:-40}
PORT=${PORT:-0}  # 0: a free one, read from the server's first line
LOG_INTERVAL=${LOG_INTERVAL:-10}
say() { echo "finetune: $*"; }
mkdir -p "$DIR"

say "1/5 a tiny chat model ($DIR/hf) and a generated chat set ($DIR/chat.jsonl)"
python examples/finetune/make_tiny_chat_model.py --out "$DIR"

say "2/5 Hugging Face -> our checkpoint ($DIR/ckpt_in)"
rm -rf "$DIR/ckpt_in" "$DIR/ckpt_ft" "$DIR/hf_ft"
python tools/checkpoint/convert.py --direction hf-to-megatron --hf-dir "$DIR/hf" --save "$DIR/ckpt_in"
# The model flags convert.py printed for this model:
MODEL=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --kv-channels 16
  --max-position-embeddings 256 --normalization RMSNorm --norm-epsilon 1e-05 --position-embedding-type rope
  --make-vocab-size-divisible-by 128 --group-query-attention --num-query-groups 2 --rotary-base 10000
  --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$DIR/hf" --seq-length 128)

say "3/5 fine-tune (TP=2 + sequence parallel, packed conversations, 10% held out for evaluation)"
OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 pretrain_gpt.py "${MODEL[@]}" \
  --tensor-model-parallel-size 2 --sequence-parallel \
  --pretrained-checkpoint "$DIR/ckpt_in" --load "$DIR/ckpt_ft" --no-load-optim --no-load-rng \
  --sft --data-path "$DIR/chat.jsonl" --split 90,10,0 --calculate-per-token-loss \
  --micro-batch-size 2 --global-batch-size 8 --train-iters "$ITERS" \
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2 \
  --log-interval "$LOG_INTERVAL" --eval-interval 20 --eval-iters 2 --num-workers 0 \
  --save "$DIR/ckpt_ft" --save-interval "$ITERS"

say "4/5 our checkpoint -> Hugging Face ($DIR/hf_ft), logits checked"
python tools/checkpoint/convert.py --direction megatron-to-hf --load "$DIR/ckpt_ft" --hf-dir-out "$DIR/hf_ft" \
  --model-type llama
python examples/finetune/check_export.py --load "$DIR/ckpt_ft" --hf-dir "$DIR/hf_ft" --tokenizer "$DIR/hf" \
  --data "$DIR/chat.jsonl"

say "5/5 serve the fine-tuned checkpoint and ask POST /v1/chat/completions"
OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 1 tools/run_text_generation_server.py "${MODEL[@]}" \
  --load "$DIR/ckpt_ft" \
  --port "$PORT" > "$DIR/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null || true' EXIT
URL=
for _ in $(seq 300); do
  URL=$(sed -n 's/^text generation server listening on //p' "$DIR/server.log")
  [[ -n $URL ]] && break
  kill -0 $SERVER 2>/dev/null || { cat "$DIR/server.log"; exit 1; }
  sleep 1
done
[[ -n $URL ]] || { cat "$DIR/server.log"; exit 1; }
say "server at $URL"
curl -sf -X POST "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "What is 2 plus 3?"}], "max_tokens": 24, "temperature": 0}'
echo
say "done: $DIR/hf_ft is the fine-tuned model in Hugging Face format"
