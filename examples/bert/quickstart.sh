#!/usr/bin/env bash
# BERT from a fresh clone, no download: the standard-library docstring corpus, a WordPiece vocabulary
# trained offline, preprocessing with --split-sentences, then Megatron's BERT example flags at toy size on
# 2 CPU ranks (pipeline parallel, masked-LM + sentence-order losses).
#   bash examples/bert/quickstart.sh            # everything under runs/bert_quickstart
#   QUICKSTART_DIR=/tmp/b TRAIN_ITERS=20 bash examples/bert/quickstart.sh
#   QUICKSTART_DIR=/tmp/smoke CORPUS_MB=0.3 TRAIN_ITERS=3 LOG_INTERVAL=1 bash examples/bert/quickstart.sh   # a quick smoke test
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup_env.sh
. .venv/bin/activate

DIR=${QUICKSTART_DIR:-runs/bert_quickstart}
mkdir -p "$DIR"
python tools/make_sample_corpus.py --output "$DIR/corpus.jsonl" --max-mb "${CORPUS_MB:-3}"
python tools/train_tokenizer.py --input "$DIR/corpus.jsonl" --type wordpiece --vocab-size 8000 \
  --output-dir "$DIR/tokenizer"
python tools/preprocess_data.py --input "$DIR/corpus.jsonl" --output-prefix "$DIR/data" \
  --tokenizer-type BertWordPieceLowerCase --vocab-file "$DIR/tokenizer/vocab.txt" --split-sentences --workers 2

OMP_NUM_THREADS=1 GPUS_PER_NODE=2 NUM_LAYERS=4 HIDDEN=128 HEADS=4 SEQ=128 MBS=4 GBS=16 \
  ITERS=${TRAIN_ITERS:-200} DECAY_ITERS=${TRAIN_ITERS:-200} TP=1 PP=2 PRECISION=--bf16 \
  LOG_INTERVAL=${LOG_INTERVAL:-10} SAVE_INTERVAL=100 EVAL_INTERVAL=100 EXTRA="--num-workers 0 --lr 1e-3" \
  bash examples/bert/train_bert_340m_distributed.sh "$DIR/checkpoints" "$DIR/tensorboard" \
  "$DIR/tokenizer/vocab.txt" "$DIR/data_text_sentence"
