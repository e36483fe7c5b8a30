#!/usr/bin/env bash
# Install what is needed, then run the whole test suite (pytest). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0
exec .venv/bin/python -m pytest "$@"
