#!/usr/bin/env bash
# Create .venv (if missing), install flwr_pfl with its test extra, and provide the offline
# datasets (MNIST, Fashion-MNIST) in torchvision's layout under $FLWR_PFL_DATA_DIR.
# Sourced by run.sh and test.sh; safe to run again (each step skips what is already done).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export FLWR_PFL_DATA_DIR="${FLWR_PFL_DATA_DIR:-$HOME/.cache/flwr_pfl/data}"
PYTHON="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
# Installing torch and torchvision first, pinned, keeps pip from picking another CUDA build.
if ! .venv/bin/python -c "import torch, torchvision, flwr, flwr_datasets, matplotlib, pytest, xdist, hypothesis, dp_accounting, tensorboard, mlflow, flwr_pfl" 2>/dev/null; then
  .venv/bin/pip install -q "torch==2.14.1" "torchvision==0.29.1"
  .venv/bin/pip install -q -e ".[test]"
fi
.venv/bin/python -m flwr_pfl.data.provision --data-dir "$FLWR_PFL_DATA_DIR" --datasets mnist fashion-mnist
