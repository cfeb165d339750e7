#!/usr/bin/env bash
# The project's test command: set up .venv, lint, then run the whole suite.
# Extra arguments go to pytest (e.g. scripts/run_tests.sh -k tensor_parallel).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
# Lint first (rules in ruff.toml): a style or import error fails before the suite runs.
ruff check .
ruff format --check .
# megatron-core 0.16.1, installed outside the repo, is the oracle of the BERT dataset parity test
# (tests/unit_tests/datasets/test_bert_dataset_oracle.py); without it that test skips.
MCORE_ORACLE=${MCORE_ORACLE:-$HOME/.cache/megatron-open/megatron-core-0.16.1}
[ -d "$MCORE_ORACLE/megatron" ] ||
  python -m pip install --quiet --no-deps --target "$MCORE_ORACLE" megatron-core==0.16.1 ||
  echo "oracle not installed: pip install --no-deps --target $MCORE_ORACLE megatron-core==0.16.1 failed; the BERT parity test will skip" >&2
export MCORE_ORACLE
exec python -m pytest -q --durations=15 tests "$@"
