#!/usr/bin/env bash
# T5 from a fresh clone, no download: the standard-library docstring corpus, a WordPiece vocabulary trained offline,
# preprocessing with --split-sentences, then Megatron's T5 example flags at toy size on 2 CPU ranks (tensor parallel,
# span corruption with --vocab-extra-ids 100 sentinels).
#   bash examples/t5/quickstart.sh            # everything under runs/t5_quickstart
#   QUICKSTART_DIR=/tmp/t TRAIN_ITERS=20 bash examples/t5/quickstart.sh
#   QUICKSTART_DIR=/tmp/smoke CORPUS_MB=0.3 TRAIN_ITERS=3 LOG_INTERVAL=1 bash examples/t5/quickstart.sh   # a quick smoke test
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup_env.sh
. .venv/bin/activate

DIR=${QUICKSTART_DIR:-runs/t5_quickstart}
mkdir -p "$DIR"
python tools/make_sample_corpus.py --output "$DIR/corpus.jsonl" --max-mb "${CORPUS_MB:-3}"
python tools/train_tokenizer.py --input "$DIR/corpus.jsonl" --type wordpiece --cased --vocab-size 8000 \
  --output-dir "$DIR/tokenizer"
python tools/preprocess_data.py --input "$DIR/corpus.jsonl" --output-prefix "$DIR/data" \
  --tokenizer-type BertWordPieceCase --vocab-file "$DIR/tokenizer/vocab.txt" --split-sentences --workers 2

OMP_NUM_THREADS=1 GPUS_PER_NODE=2 LAYERS=2 HIDDEN=128 HEADS=4 KV=32 FFN=512 ENC_SEQ=128 DEC_SEQ=64 MBS=4 GBS=16 \
  ITERS=${TRAIN_ITERS:-200} TP=2 SPLIT=949,50,1 LOG_INTERVAL=${LOG_INTERVAL:-10} SAVE_INTERVAL=100 EVAL_INTERVAL=100 \
  EXTRA="--num-workers 0 --lr 1e-3" \
  bash examples/t5/train_t5_220m_distributed.sh "$DIR/checkpoints" "$DIR/tensorboard" \
  "$DIR/tokenizer/vocab.txt" "$DIR/data_text_sentence"
