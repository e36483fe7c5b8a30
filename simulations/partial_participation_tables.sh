#!/usr/bin/env bash
# Regenerate every docs/ table that comes from runs with partial participation (pFedFDA's
# q = 0.3, FMTL's 10 of 100 clients), over seeds 0 1 2. Resumable: runs that already finished
# with the same config are read, not run again (compare --reuse), so stopping and starting
# again loses nothing. Usage: simulations/partial_participation_tables.sh [pfedfda|fmtl]...
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-.venv/bin/python}"
SEEDS="${SEEDS:-0 1 2}"
families="${*:-pfedfda fmtl}"

for family in $families; do
  case "$family" in
    pfedfda)
      for d in fmnist mnist; do
        for layout in skew iid; do
          extra=(); out="docs/results/pfedfda_${d}_shift_skew"
          if [ "$layout" = iid ]; then extra=(-c "partitioner='one-domain-per-client'"); out="docs/results/pfedfda_${d}_shift"; fi
          "$PY" -m flwr_pfl.app.compare -c "flwr_pfl/presets/pfedfda_${d}_shift.toml" \
              -c "num-server-rounds=20" -c "local-epochs=2" -c "download=false" "${extra[@]}" \
              --algorithms pfedfda fedavg finetune fedrep fedper local --seeds $SEEDS --reuse --out "$out"
        done
      done ;;
    fmtl)
      for p in fmnist_100x2 fmnist_100x5 mnist_100x2 mnist_100x5; do
        "$PY" -m flwr_pfl.app.compare -c "flwr_pfl/presets/fmtl_$p.toml" \
            -c "num-server-rounds=20" -c "fmtl.t1-rounds=15" -c "learning-rate=0.05" \
            -c "fraction-evaluate=1.0" -c "download=false" --algorithms fedavg fmtl --seeds $SEEDS --reuse \
            --out "docs/results/fmtl_$p"
      done ;;
    *) echo "unknown family $family (pfedfda, fmtl)" >&2; exit 2 ;;
  esac
done
