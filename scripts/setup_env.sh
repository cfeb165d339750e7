#!/usr/bin/env bash
# Create (or reuse) .venv with everything the project, its tools and its tests need.
# Offline-safe: every package comes from the package registry or the local torch wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.installed-$(cat requirements.txt requirements-test.txt setup.py | sha1sum | cut -c1-12)
if [[ ! -f $stamp ]]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q -r requirements-test.txt
  python -m pip install -q --no-deps -e .
  touch "$stamp"
fi
