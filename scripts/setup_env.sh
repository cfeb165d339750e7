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
  python -m pip install $QUIET --no-compile -r requirements-test.txt
  python -m pip install $QUIET --no-deps -e .
  # Byte-compiled here, on every core: pip compiles its 17,000 files one at a time (about 90 CPU-s, the
  # larger half of this set-up). Skipping it would move that cost into every test process wherever
  # PYTHONDONTWRITEBYTECODE is set (measured: the default tier 11 -> 17 min). The files that do not
  # compile are ones pip skips too (torch's Python 3.12-only test helper); they are listed, not fatal. The
  # packages' own test folders (about 3,300 files) are left out: nothing here imports them (matched below
  # site-packages only, so a clone inside a folder named tests still compiles everything).
  echo "setup: byte-compiling .venv"
  python -m compileall -q -j 0 -x 'site-packages/(.+/)?tests?/|/py312_intrinsics\.py$' \
    "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" ||
    echo "setup: the files above did not compile; Python reads them from source (as after pip's own compile)"
  touch "$stamp"
  echo "setup: .venv ready (activate it in your shell with: . .venv/bin/activate)"
fi
