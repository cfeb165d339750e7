#!/usr/bin/env bash
# The project's test command: set up .venv, then run the whole suite.
# Extra arguments go to pytest (e.g. scripts/run_tests.sh -k tensor_parallel).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
exec python -m pytest -q --durations=15 tests "$@"
