#!/usr/bin/env bash
# Install what is needed, then run the default experiment through the real `flwr run .`
# (Flower's Ray simulation engine). Extra arguments go to the launcher, e.g.
#   scripts/run.sh -c fmnist_label_skew -c "algorithm='fedrep' num-server-rounds=20"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m flwr_pfl.app.launch \
  -c "data-dir='$FLWR_PFL_DATA_DIR' output-dir='$PWD/outputs'" "$@"
