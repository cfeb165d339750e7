#!/usr/bin/env bash
# Create (or reuse) .venv with everything the project, its tools and its tests need.
# Offline-safe: every package comes from the package registry or the local torch wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# On a terminal pip shows its progress; otherwise (CI, logs) it stays quiet. Each step says what it does.
QUIET=-q
[[ -t 1 ]] && QUIET=
if [[ ! -x .venv/bin/python ]]; then
  echo "setup: creating .venv with $PY"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.installed-$(cat requirements.txt requirements-test.txt setup.py | sha1sum | cut -c1-12)
if [[ ! -f $stamp ]]; then
  echo "setup: installing the requirements into .venv (first time: a few minutes)"
  python -m pip install $QUIET --upgrade pip
  # pip byte-compiles every file here (about 80 CPU-s); --no-compile would move that cost into every test process
  # wherever PYTHONDONTWRITEBYTECODE is set (measured: the default tier 11 -> 17 min), so it is kept.
  python -m pip install $QUIET -r requirements-test.txt
  python -m pip install $QUIET --no-deps -e .
  touch "$stamp"
  echo "setup: .venv ready (activate it in your shell with: . .venv/bin/activate)"
fi
