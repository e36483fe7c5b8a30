"""When each row of a reproduce table is at its best, and how much of that it has given back by the end.

A table reports every run at its last round. A row that peaks early and then declines is reported
late in its decline, and the ranking then says when each row stops improving as much as how good it
gets. This reads the committed run files that ``simulations/reproduce.py <table> --scale <scale>``
leaves under ``docs/reproduce/results/<table>/<scale>/`` and prints, per column, method and
learning-rate factor (mean and spread over seeds, and each seed's round):

* the evaluation round where the table's metric is best, and its value there;
* the metric at the last round, and how far that is from the best (the give-back);
* the round where the mean validation loss (``--val-key``, where the runs report one) is lowest,
  the round an early stop on that loss would pick, and the metric there.

Writes them as JSON with ``--out``.

    python simulations/peak_round.py fedora-lambda-ablation --scale paper \\
        --out docs/reproduce/fedora_lambda_peak_round.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reproduce import DOCS, over_seeds  # noqa: E402
from reproduce_report import evaluation_series  # noqa: E402
from reproduce_tables import TABLES  # noqa: E402

def peak(series: list[tuple[int, float]], higher_is_better: bool = True) -> tuple[int, float]:
    """The (round, value) of the best value of ``series`` (the first such round on ties)."""
    if not series:
        raise ValueError("peak() of an empty series: the run reports no value of the metric")
    best = max if higher_is_better else min
    return best(series, key=lambda point: point[1])


def value_at(series: list[tuple[int, float]], round_: int) -> float | None:
    """The value of ``series`` at ``round_`` (None when the series has no point there)."""
    return next((value for r, value in series if r == round_), None)


def run_peaks(rows: list[dict[str, Any]], metric: tuple[str, ...], higher_is_better: bool,
              val_key: str) -> dict[str, float | int | None] | None:
    """One run's figures: ``best_round``, ``best``, ``last``, ``give_back``, ``val_min_round`` and
    ``at_val_min``; None if it reports no value of the metric.

    ``give_back`` is the best value minus the last one for a higher-is-better metric (the other way
    round otherwise), so it is >= 0 and 0 for a run still at its best at the end. The
    validation-loss figures are None where the run's evaluation rows do not carry ``val_key``.
    """
    series = evaluation_series(rows, metric)
    if not series:
        return None
    best_round, best = peak(series, higher_is_better)
    last = series[-1][1]
    figures: dict[str, float | int | None] = {
        "best_round": best_round, "best": best, "last": last,
        "give_back": (best - last) if higher_is_better else (last - best),
        "val_min_round": None, "at_val_min": None,
    }
    val = evaluation_series(rows, (val_key,))
    if val:
        val_round, _ = peak(val, higher_is_better=False)
        figures["val_min_round"] = val_round
        figures["at_val_min"] = value_at(series, val_round)
    return figures


def measure(table_name: str, scale: str, val_key: str = "val_loss_mean",
            results: Path = DOCS / "results") -> list[dict[str, Any]]:
    """Per (column, method, factor): mean and std over the finished seeds of each figure of
    :func:`run_peaks`, with the per-seed values."""
    table = TABLES[table_name]
    return over_seeds(table, scale, lambda rows: run_peaks(rows, table.metric, table.higher_is_better, val_key), results)


def _rounds(values: list[int | None]) -> str:
    return " / ".join("-" if v is None else str(v) for v in values)


def _value(entry: dict[str, Any], name: str) -> str:
    mean, std = entry[f"{name}_mean"], entry[f"{name}_std"]
    return "-" if math.isnan(mean) else f"{mean:.4f} ± {std:.4f}"  # NaN: no seed reports it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", choices=sorted(TABLES))
    parser.add_argument("--scale", default="quick")
    parser.add_argument("--val-key", default="val_loss_mean",
                        help="evaluation-row key of the validation loss an early stop would watch")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    found = measure(args.table, args.scale, args.val_key)
    if not found:
        raise SystemExit(f"no finished runs of {args.table} at scale {args.scale} under {DOCS / 'results'}")
    print("| column | method | lr factor | best round (per seed) | best | last round | give-back "
          f"| lowest {args.val_key} round (per seed) | metric there |")
    print("|---|---|---|---|---|---|---|---|---|")
    for f in found:
        print(f"| {f['column']} | {f['method']} | x{f['lr_factor']:g} | {_rounds(f['best_round_per_seed'])} "
              f"| {_value(f, 'best')} | {_value(f, 'last')} | {_value(f, 'give_back')} "
              f"| {_rounds(f['val_min_round_per_seed'])} | {_value(f, 'at_val_min')} |")
    if args.out:
        args.out.write_text(json.dumps({"table": args.table, "scale": args.scale, "val_key": args.val_key,
                                        "cells": found}, indent=1) + "\n")


if __name__ == "__main__":
    main()
