#!/usr/bin/env bash
# The project's test command: set up .venv, lint, then run the default tier of the suite (or what it is given).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
usage: bash scripts/run_tests.sh [--full] [PYTEST ARGS...]

Sets up .venv (scripts/setup_env.sh), lints with ruff, installs the two test oracles outside the repository
when missing, then runs pytest on what it is given:
  (nothing)              the default tier of tests/: every feature and layout family (about 2,000 tests;
                         11 min of pytest on 2 quiet cores, measured 2026-12-02, see README)
  --full                 every test: the default tier plus the tests tests/conftest.py lists as full-only
                         (bash scripts/run_tests.sh --full -m full runs only those, as .ci/run does after
                         the default tier; 128 tests, about 15 min more)
  PATHS / NODE IDS       only those, every test in them (full-only ones too), e.g. tests/fault
  -k EXPR, -x, ...       any other pytest option, applied to the default tier (or to the given paths)
  -h, --help             this help; installs and downloads nothing
Two pytest-xdist workers share the files (-n 2 --dist loadfile: a file's tests stay in one worker, so its
module fixtures and spawned rank groups are shared as without xdist); TEST_WORKERS=1 (or -n/-p no:xdist
among the arguments) runs in this process.
Without this script: python -m pytest runs the default tier, RUN_FULL=1 python -m pytest everything.
EOF
}

pytest_args=()
for arg in "$@"; do
  case "$arg" in
    -h | --help)
      usage
      exit 0
      ;;
    --full) export RUN_FULL=1 ;;
    *) pytest_args+=("$arg") ;;
  esac
done

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
# Transformer Engine 2.9.0's sources, unpacked outside the repo and never installed (its core library needs
# CUDA), are the oracle of the TE adapter's keywords and of the fake TE's signatures
# (tests/unit_tests/test_te_oracle.py): a download and an unzip; without them that test skips.
TE_SOURCE_ORACLE=${TE_SOURCE_ORACLE:-$HOME/.cache/megatron-open/transformer_engine-2.9.0}
if [ ! -f "$TE_SOURCE_ORACLE/transformer_engine/pytorch/module/linear.py" ]; then
  te_wheels=$(mktemp -d)
  { python -m pip download --quiet --no-deps --dest "$te_wheels" transformer_engine==2.9.0 &&
    python -m zipfile -e "$te_wheels"/transformer_engine-2.9.0-py3-none-any.whl "$TE_SOURCE_ORACLE"; } ||
    echo "oracle not fetched: pip download --no-deps transformer_engine==2.9.0 failed; the TE oracle test will skip" >&2
  rm -rf "$te_wheels"
fi
export TE_SOURCE_ORACLE
# The project's own modules byte-compiled once (about 1.5 CPU-s): where PYTHONDONTWRITEBYTECODE is set, Python
# never caches them itself, and every process the tests start outside the fork server (torchrun's ranks, the
# scripts and tools they run) would compile the 240 modules it imports again, about 0.5 CPU-s each.
python -m compileall -q -j 0 megatron tools tests examples benchmarks ./*.py
# No path given: pytest.ini's testpaths (tests/) applies; given paths replace it.
# Two workers by default: much of a test's time is process start-up and waiting on its spawned ranks, which
# leaves a core idle; a second worker fills it (about 1.4x on 2 cores). Each file stays in one worker.
workers=()
case " ${pytest_args[*]-} " in
  *" -n "* | *" -n="* | *" -p no:xdist "* | *" -pno:xdist "*) ;;
  *) if [ "${TEST_WORKERS:-2}" -gt 1 ]; then workers=(-n "${TEST_WORKERS:-2}" --dist loadfile); fi ;;
esac
exec python -m pytest -q --durations=15 ${workers[@]+"${workers[@]}"} ${pytest_args[@]+"${pytest_args[@]}"}
