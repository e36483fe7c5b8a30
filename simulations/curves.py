"""A reproduce table's comparison at every evaluated round, not only the last.

A table compares the rows at one point of training (its last round, or the mean of its last few).
Where a method leads early and is overtaken later (or the reverse), that point decides the
verdict. This reads the committed run files of ``simulations/reproduce.py <table> --scale
<scale>`` and prints, per column, every method's figure at the chosen rounds (mean ± std over
seeds) and its paired difference from the table's reference at the same round, with the suite's
win rule (:func:`flwr_pfl.app.compare.paired_verdict`: every seed the same sign and the mean
difference above the differences' spread). Rows at the table's own learning rate only. ``--metric``
compares another evaluation key instead of the table's (e.g. ``acc_d4``, the accuracy on domain 4).
Writes the cells as JSON with ``--out``.

    python simulations/curves.py pfedfda --scale paper --rounds 10 20 30 50 100 150 200 \\
        --out docs/reproduce/pfedfda_paper_curves.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reproduce_report as report  # noqa: E402
from reproduce import DOCS, over_seeds  # noqa: E402
from reproduce_tables import TABLES  # noqa: E402


def measure(table_name: str, scale: str, rounds: list[int], results: Path = DOCS / "results",
            metric: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """Per (column, method) at the table's learning rate: the metric (the table's, or the first of
    ``metric`` a run reports) at each of ``rounds`` (over the seeds that evaluated it) and, for
    every method but the reference, the paired difference from the reference at that round
    (positive = the method is better)."""
    table = TABLES[table_name]

    def per_run(rows: list[dict[str, Any]]) -> dict[str, float] | None:
        series = dict(report.evaluation_series(rows, metric or table.metric))
        return {f"round {r}": series[r] for r in rounds if r in series} or None

    found = [c for c in over_seeds(table, scale, per_run, results) if c["lr_factor"] == 1.0]
    by_seed = {(c["column"], c["method"]): {r: dict(zip(c["seeds"], c[f"round {r}_per_seed"]))
                                            for r in rounds if f"round {r}_per_seed" in c} for c in found}
    cells = []
    for c in found:
        cell = {k: v for k, v in c.items() if not k.startswith("round ")}
        reference = by_seed.get((c["column"], table.reference), {}) if c["method"] != table.reference else {}
        cell["rounds"] = {}
        for r, values in by_seed[(c["column"], c["method"])].items():
            at = {"mean": c[f"round {r}_mean"], "std": c[f"round {r}_std"], "per_seed": list(values.values())}
            if r in reference:
                at["vs_reference"] = report.paired(values, reference[r], table.higher_is_better, table.log)
            cell["rounds"][r] = at
        cells.append(cell)
    return cells


def markdown(table_name: str, cells: list[dict[str, Any]], rounds: list[int], metric_label: str | None = None) -> str:
    """One Markdown table per column: a row per method, a cell per round (mean ± std; under it
    the paired difference from the reference and its verdict)."""
    table = TABLES[table_name]
    out = []
    for column in dict.fromkeys(c["column"] for c in cells):
        out += [f"**{column}** ({metric_label or table.metric_label}; vs {table.reference}, paired over seeds)", "",
                "| method | " + " | ".join(f"round {r}" for r in rounds) + " |",
                "|---|" + "---|" * len(rounds)]
        for cell in (c for c in cells if c["column"] == column):
            parts = []
            for r in rounds:
                at = cell["rounds"].get(r)
                if at is None:
                    parts.append("-")
                    continue
                text = f"{at['mean']:.3f} ± {at['std']:.3f}"
                vs = at.get("vs_reference")
                if vs is not None:
                    text += f"<br>{vs['mean']:+.3f} ± {vs['std']:.3f} {report.WORDS.get(vs['verdict'], vs['verdict'])}"
                parts.append(text)
            out.append(f"| {cell['method']} | " + " | ".join(parts) + " |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", choices=sorted(TABLES))
    parser.add_argument("--scale", default="quick")
    parser.add_argument("--rounds", type=int, nargs="+", required=True, help="evaluated rounds to compare at")
    parser.add_argument("--metric", default=None, help="an evaluation key to compare instead of the table's metric")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    metric = (args.metric,) if args.metric else None
    cells = measure(args.table, args.scale, args.rounds, metric=metric)
    if not cells:
        raise SystemExit(f"no finished runs of {args.table} at scale {args.scale} under {DOCS / 'results'}"
                         + (f" that report {args.metric}" if args.metric else ""))
    print(markdown(args.table, cells, args.rounds, args.metric))
    if args.out:
        args.out.write_text(json.dumps({"table": args.table, "scale": args.scale, "rounds": args.rounds,
                                        "metric": args.metric or TABLES[args.table].metric[0], "cells": cells},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
