#!/usr/bin/env bash
# Install what is needed, then run the whole test suite (pytest). Extra arguments go to pytest.
#
# The tests run in parallel, one worker per CPU (pytest-xdist), each test file on one worker
# (files share module-level fixtures and some write under one temporary tree). Set
# FLWR_PFL_TEST_WORKERS to a number to choose, or to 0 to run in this process (e.g. with --pdb).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0
workers="${FLWR_PFL_TEST_WORKERS:-auto}"
if [ "$workers" = "0" ]; then
  exec .venv/bin/python -m pytest "$@"
fi
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"
