"""The learning-rate sweep of a reproduced table: every method (the reference included) at its
learning rate times each factor of a grid, the best factor per method, and the table's comparison
redone with every method at its best factor.

A reviewer's question about any "method beats baseline" claim is whether the baseline was tuned
as well as the method. ``python simulations/reproduce.py <table> --lr-factors 0.5 2`` answers it
for the learning rate, the hyperparameter every row shares: each row runs at x0.5, x1 and x2 of
its table learning rate (every other rate of the suite is a ratio of ``learning-rate``, so a
method's secondary rates move with it).

**Selection rule.** A row's best factor is the one with the best mean figure over seeds (the mean
of log10 for log-scale tables such as MSE); ties go to the factor nearer 1. The figure is the
table's test metric, chosen the same way for every row, the reference included: this is the
optimistic reading for every method alike (a validation split would lower each row a little, the
same way), and it cannot favour the method a table is about. A best factor at either end of the
grid is flagged: the optimum may lie outside it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import reproduce_report as report

#: column -> method label -> learning-rate factor -> seed -> the run's figure
SweepFigures = dict[str, dict[str, dict[float, dict[int, float]]]]


def _score(values: dict[int, float], log: bool) -> float:
    """The number a factor is ranked by: the mean figure over seeds (mean log10 for log tables)."""
    v = [math.log10(x) if log else x for x in values.values() if x is not None and math.isfinite(x) and (x > 0 or not log)]
    return float(np.mean(v)) if v else math.nan


def best_factor(per_factor: dict[float, dict[int, float]], higher_is_better: bool, log: bool) -> float | None:
    """The factor with the best mean figure (see the module's selection rule); None if no factor
    has a finite figure."""
    scored = [(f, _score(v, log)) for f, v in per_factor.items()]
    scored = [(f, s) for f, s in scored if math.isfinite(s)]
    if not scored:
        return None
    sign = 1.0 if higher_is_better else -1.0
    return max(scored, key=lambda fs: (sign * fs[1], -abs(math.log(fs[0]))))[0]


def summarize(table, figures: SweepFigures) -> dict[str, Any]:
    """Per column: each method's figure at each factor (mean, std, seeds), its best factor, whether
    that is at the grid's edge, and its paired comparison with the reference when both are at
    their best factors (``tuned``) and when both are at factor 1 (``untuned``)."""
    out: dict[str, Any] = {}
    for column in table.columns:
        per_method = figures.get(column.name, {})
        best = {m: best_factor(v, table.higher_is_better, table.log) for m, v in per_method.items()}
        reference = per_method.get(table.reference, {})
        ref_best = reference.get(best.get(table.reference)) if reference else None
        rows = {}
        for method in table.methods:
            per_factor = per_method.get(method.label)
            if not per_factor:
                continue
            factors = sorted(per_factor)
            chosen = best[method.label]
            is_reference = method.label == table.reference
            rows[method.label] = {
                "factors": {f"{f:g}": dict(zip(("mean", "std"), report.mean_std(list(per_factor[f].values()))),
                                           n=len(per_factor[f]), score=_score(per_factor[f], table.log)) for f in factors},
                "best": chosen,
                "edge": chosen is not None and len(factors) > 1 and chosen in (factors[0], factors[-1]),
                "tuned": None if is_reference or not ref_best or chosen is None else report.paired(
                    per_factor[chosen], ref_best, table.higher_is_better, table.log),
                "untuned": None if is_reference or 1.0 not in per_factor or 1.0 not in reference else report.paired(
                    per_factor[1.0], reference[1.0], table.higher_is_better, table.log),
            }
        out[column.name] = rows
    return out


def _cell(entry: dict[str, Any] | None, log: bool, best: bool) -> str:
    if entry is None or not math.isfinite(entry["mean"]):
        return "-"
    if log:
        text = f"{entry['mean']:.2e} (log10 {entry['score']:.2f})"
    else:
        text = f"{entry['mean']:.4f} ± {entry['std']:.4f}"
    return f"**{text}**" if best else text


def _verdict(d: dict[str, Any] | None) -> str:
    return "" if d is None else f"{d['mean']:+.4f} ± {d['std']:.4f}, {report.WORDS[d['verdict']]}"


def markdown(table, scale_name: str, summary: dict[str, Any], command: str) -> str:
    """The sweep's page: per column, the grid (best factor in bold) and both comparisons."""
    lines = [f"# {table.title} — `{scale_name}` scale, learning-rate sweep", "",
             f"Every method at its table learning rate times each factor; {table.metric_label}, a run's figure as on "
             f"the table's page, mean ± sample std over seeds" + (" (log10 of the geometric mean in brackets)" if table.log else "")
             + ". **Selection:** a row's best factor has the best mean figure over seeds on the table's test metric, "
             "chosen the same way for every row, the reference included (optimistic for every row alike; it cannot "
             "favour the table's method). `edge`: the best factor is at an end of the grid, so the optimum may lie "
             "outside it. **Compared** with the reference, seed by seed, by the table's win rule: at factor 1 "
             "(the table's own runs) and with every row at its best factor.", "",
             f"**Protocol:** {table.scales[scale_name].note}", ""]
    for column in table.columns:
        rows = summary.get(column.name, {})
        if not rows:
            continue
        factors = sorted({float(f) for r in rows.values() for f in r["factors"]})
        head = ["method"] + [f"lr x{f:g}" for f in factors] + ["best", f"vs {table.reference}, both at x1",
                                                                f"vs {table.reference}, both at their best"]
        lines += [f"## {column.name}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for label, r in rows.items():
            cells = [label] + [_cell(r["factors"].get(f"{f:g}"), table.log, r["best"] == f) for f in factors]
            best = "-" if r["best"] is None else f"x{r['best']:g}" + (" (edge)" if r["edge"] else "")
            if label == table.reference:
                cells += [best, "reference", "reference"]
            else:
                cells += [best, _verdict(r["untuned"]), _verdict(r["tuned"])]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Command:", "", "```", command, "```", ""]
    return "\n".join(lines)
