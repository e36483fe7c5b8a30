"""How much each row of a reproduce table moves from one evaluation to the next.

A table reports a run's figure at its last round (or the mean of its last few). Where a method's
accuracy swings by several points between consecutive evaluations, that figure is a draw from the
swing, and a row whose swing is larger than the gaps between rows cannot be ranked from it. This
reads the committed run files that ``simulations/reproduce.py <table> --scale <scale>`` (with or
without ``--lr-factors``) leaves under ``docs/reproduce/results/<table>/<scale>/`` and prints, per
column, method and learning-rate factor: the mean absolute change of the table's metric between
consecutive evaluations over each run's last ``--last`` evaluations (mean and spread over seeds),
beside the table's figure. Writes them as JSON with ``--out``.

    python simulations/round_swing.py pfedfda --scale quick --out docs/reproduce/pfedfda_round_swing.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reproduce import DOCS, over_seeds  # noqa: E402
from reproduce_report import evaluation_values, run_figure  # noqa: E402
from reproduce_tables import TABLES  # noqa: E402


def swing(values: list[float], last: int) -> float | None:
    """Mean absolute change between consecutive values among the last ``last`` (None if < 2)."""
    tail = np.asarray(values[-last:], dtype=float)
    return float(np.mean(np.abs(np.diff(tail)))) if tail.size >= 2 else None


def measure(table_name: str, scale: str, last: int, results: Path = DOCS / "results") -> list[dict[str, Any]]:
    """Per (column, method, factor): the swing and the table's figure over the finished seeds."""
    table = TABLES[table_name]

    def per_run(rows: list[dict[str, Any]]) -> dict[str, float] | None:
        moved = swing(evaluation_values(rows, table.metric), last)
        figure = run_figure(rows, table.metric, table.last)
        return None if moved is None or figure is None else {"swing": moved, "figure": figure}

    return over_seeds(table, scale, per_run, results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", choices=sorted(TABLES))
    parser.add_argument("--scale", default="quick")
    parser.add_argument("--last", type=int, default=10, help="evaluations per run the swing is measured over")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.last < 2:
        raise SystemExit(f"--last {args.last}: a swing needs at least 2 evaluations")
    found = measure(args.table, args.scale, args.last)
    if not found:
        raise SystemExit(f"no finished runs of {args.table} at scale {args.scale} under {DOCS / 'results'}")
    print(f"| column | method | lr factor | swing over the last {args.last} evaluations | table figure |")
    print("|---|---|---|---|---|")
    for f in found:
        print(f"| {f['column']} | {f['method']} | x{f['lr_factor']:g} | {f['swing_mean']:.3f} ± {f['swing_std']:.3f} "
              f"| {f['figure_mean']:.3f} ± {f['figure_std']:.3f} |")
    if args.out:
        args.out.write_text(json.dumps({"table": args.table, "scale": args.scale, "last": args.last, "cells": found},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
