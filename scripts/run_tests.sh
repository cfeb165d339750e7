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
exec python -m pytest -q --durations=15 tests "$@"
