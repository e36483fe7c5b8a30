"""The maths and the writing of a reproduced table: per-run figure, mean +- std over seeds, the
paired win rule, Markdown beside the paper's figures, and a plot.

A run's *figure* is the mean of its last ``table.last`` evaluation rows of the table's metric
(the papers average the final rounds). Over seeds: mean and sample std (ddof = 1). A method is
called better or worse than the table's reference only by the paired rule of
:func:`flwr_pfl.app.compare.paired_verdict`: every seed's difference has the same sign and the
mean difference exceeds the differences' std (on log10 for metrics spanning decades, e.g. MSE).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from flwr_pfl.app.compare import paired_verdict

#: verdict of a method against the reference (better = the method beats it), in words for the table
WORDS = {"ahead": "better", "behind": "worse", "tie": "tie (within spread)", "one seed": "one seed (no spread)"}


def evaluation_series(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[tuple[int, float]]:
    """The run's evaluation rows' (round, value) of the first key in ``keys`` it reports, in row
    order (empty if it reports none; a row without a round number counts by position, from 1)."""
    evaluate = [r for r in rows if r.get("phase", "evaluate") == "evaluate"]
    for key in keys:
        series = [(int(r.get("round", i)), float(r[key])) for i, r in enumerate(evaluate, 1) if r.get(key) is not None]
        if series:
            return series
    return []


def evaluation_values(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[float]:
    """The values of :func:`evaluation_series`, without their rounds."""
    return [value for _, value in evaluation_series(rows, keys)]


def run_figure(rows: list[dict[str, Any]], keys: tuple[str, ...], last: int) -> float | None:
    """Mean of the last ``last`` evaluation rows' value of the first key in ``keys`` the run reports
    (``None`` if it reports none)."""
    values = evaluation_values(rows, keys)
    return float(np.mean(values[-last:])) if values else None


def fit_mean(rows: list[dict[str, Any]], key: str) -> float | None:
    """Mean over the run's fit rows of ``key`` (e.g. FEDORA's ``lambda_active_mean``)."""
    values = [r[key] for r in rows if r.get("phase") == "fit" and r.get(key) is not None]
    return float(np.mean(values)) if values else None


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample std (ddof = 1; 0 for one value) of finite values (NaN if none)."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    if v.size == 0:
        return math.nan, math.nan
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def paired(method: dict[int, float], reference: dict[int, float], higher_is_better: bool, log: bool) -> dict[str, Any]:
    """Per-seed differences (positive = the method is better), their mean and std, and the verdict.

    Only seeds both have are paired. ``log``: differences of log10 values (for MSE), so that a
    factor of 10 counts the same at every scale.
    """
    seeds = sorted(set(method) & set(reference))
    a = np.array([method[s] for s in seeds], dtype=float)
    b = np.array([reference[s] for s in seeds], dtype=float)
    if log:
        a, b = np.log10(a), np.log10(b)
    diffs = (a - b) if higher_is_better else (b - a)
    diffs = diffs[np.isfinite(diffs)]
    if diffs.size == 0:
        return {"n": 0, "mean": math.nan, "std": math.nan, "verdict": "one seed"}
    return {"n": int(diffs.size), "mean": float(diffs.mean()),
            "std": float(diffs.std(ddof=1)) if diffs.size > 1 else 0.0, "verdict": paired_verdict(diffs)}


def paper_agreement(verdict: str, paper_method: float | None, paper_reference: float | None, higher_is_better: bool) -> str:
    """Whether our verdict matches the direction of the paper's figures ("" if a figure is missing)."""
    if paper_method is None or paper_reference is None or verdict == "one seed":
        return ""
    better = paper_method > paper_reference if higher_is_better else paper_method < paper_reference
    if paper_method == paper_reference:
        return "paper: equal"
    if verdict == "tie":
        return "not resolved"
    return "as paper" if (verdict == "ahead") == better else "opposite of paper"


def _fmt(value: float, log: bool) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.2e}" if log else f"{value:.4f}"


def summarize(table, figures: dict[str, dict[str, dict[int, float]]], extras: dict[str, dict[str, dict[str, dict[int, float]]]],
              failed: dict[str, dict[str, dict[int, str]]] | None = None) -> dict[str, Any]:
    """Everything the Markdown and the plot show, per column and method.

    Args:
        table: the :class:`reproduce_tables.Table`.
        figures: column -> method label -> seed -> figure.
        extras: column -> method label -> extra key -> seed -> value.
        failed: column -> method label -> seed -> why the app judged that run failed.
    """
    out: dict[str, Any] = {}
    for column in table.columns:
        per_method = figures.get(column.name, {})
        ref = per_method.get(table.reference, {})
        rows = {}
        for method in table.methods:
            values = per_method.get(method.label, {})
            if not values:
                continue
            mean, std = mean_std(list(values.values()))
            if table.log and values:
                logs = [math.log10(v) for v in values.values() if v > 0]
                log_mean, log_std = mean_std(logs)
            else:
                log_mean = log_std = math.nan
            diff = None if method.label == table.reference or not ref else paired(values, ref, table.higher_is_better, table.log)
            paper_m = method.paper.get(column.name)
            paper_r = next((m.paper.get(column.name) for m in table.methods if m.label == table.reference), None)
            rows[method.label] = {
                "mean": mean, "std": std, "log10_mean": log_mean, "log10_std": log_std, "n": len(values),
                "seeds": {str(s): v for s, v in sorted(values.items())}, "paper": paper_m, "paired": diff,
                "agreement": "" if diff is None else paper_agreement(diff["verdict"], paper_m, paper_r, table.higher_is_better),
                "extras": {k: mean_std(list(v.values())) for k, v in extras.get(column.name, {}).get(method.label, {}).items()},
                "failed": {str(s): why for s, why in sorted((failed or {}).get(column.name, {}).get(method.label, {}).items())},
            }
        out[column.name] = rows
    return out


def strongest_competitor(table, rows: dict[str, Any]) -> str:
    """One sentence on the column's strongest competitor: the row other than the reference with
    the best mean (log10 mean for a log metric), compared with the reference seed by seed (each
    seed's difference, positive where the reference is better) and by the table's win rule.
    "" when the column has no reference or no other row."""
    ref = rows.get(table.reference)
    others = {label: r for label, r in rows.items() if label != table.reference and r.get("paired")}
    if ref is None or not others:
        return ""
    key = "log10_mean" if table.log else "mean"
    pick = max if table.higher_is_better else min
    label = pick(others, key=lambda name: others[name][key])
    mine, theirs = ref["seeds"], others[label]["seeds"]
    seeds = sorted(set(mine) & set(theirs), key=int)
    diffs = {}
    for seed in seeds:
        a, b = float(mine[seed]), float(theirs[seed])
        if table.log:
            a, b = math.log10(a), math.log10(b)
        diffs[seed] = (a - b) if table.higher_is_better else (b - a)
    ahead = [seed for seed, d in diffs.items() if d > 0]
    behind = [seed for seed, d in diffs.items() if d < 0]
    verdict = {"ahead": f"{label} is better", "behind": f"{table.reference} is better",
               "tie": "a tie (within spread)", "one seed": "one seed (no spread)"}[others[label]["paired"]["verdict"]]
    where = []
    if ahead:
        where.append(f"{table.reference} ahead on seed{'s' if len(ahead) > 1 else ''} {', '.join(ahead)}")
    if behind:
        where.append(f"behind on seed{'s' if len(behind) > 1 else ''} {', '.join(behind)}")
    per_seed = ", ".join(f"seed {seed} {d:+.4f}" for seed, d in diffs.items())
    unit = " (log10)" if table.log else ""
    return (f"**Strongest competitor:** {label} (the best mean of the other rows). {table.reference} minus {label}, "
            f"seed by seed{unit}: {per_seed}; {'; '.join(where) or 'equal on every seed'}. By the win rule: {verdict}.")


def not_run(table, summary: dict[str, Any]) -> list[str]:
    """The table's cells with no finished run, per column: the whole column or its missing methods.

    A page written from part of a table (a long table run in pieces) says what it lacks, so a
    missing row or column is never mistaken for one that was dropped.
    """
    pending = []
    for column in table.columns:
        done = summary.get(column.name, {})
        missing = [m.label for m in table.methods if m.label not in done]
        if len(missing) == len(table.methods):
            pending.append(f"{column.name} (every method)")
        elif missing:
            pending.append(f"{column.name}: " + ", ".join(missing))
    return pending


def machine_label(record: dict[str, Any] | None) -> str:
    """One machine as a page names it: CPU model, torch's CPU kernel level, GPU (if any)."""
    if not record:
        return "not recorded (runs from before the driver kept it)"
    label = f"{record.get('cpu_model', 'unknown CPU')}, torch CPU kernels {record.get('cpu_capability', '?')}"
    return label + (f", GPU {record['gpu']}" if record.get("gpu") else "")


def markdown(table, scale_name: str, summary: dict[str, Any], command: str, seconds: float | None,
             machines: dict[str, int] | None = None) -> str:
    """The table's page: protocol, one table per column, the win rule, the command, and where the
    runs ran (``machines``: :func:`machine_label` -> number of runs; reruns are bit-identical only
    on one machine)."""
    scale = table.scales[scale_name]
    metric = table.metric_label
    lines = [f"# {table.title} — `{scale_name}` scale", "", table.description.strip(), "",
             f"**Protocol at this scale:** {scale.note}", "",
             f"**Metric:** {metric}; a run's figure is the mean of its last {table.last} evaluation round(s); "
             f"then mean ± sample std over seeds. **Paper:** {table.source.rstrip('.')}.", "",
             f"**Win rule:** against `{table.reference}`, seed by seed (paired: same data and initial model); "
             "a method is better or worse only when every seed agrees in sign and the mean difference exceeds the "
             "std of the differences" + (" (differences of log10 values)" if table.log else "") + "; otherwise a tie.", ""]
    for column in table.columns:
        rows = summary.get(column.name, {})
        if not rows:
            continue
        extra_keys = [k for k in table.extras if any(k in r["extras"] for r in rows.values())]
        lines += [f"## {column.name}", "", column.note.strip(), ""] if column.note else [f"## {column.name}", ""]
        head = ["method", f"{metric} (mean ± std)", "seeds", "paper", f"vs {table.reference} (paired)", "verdict", "vs paper"]
        head += [table.extras[k] for k in extra_keys]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for label, r in rows.items():
            if table.log:
                value = f"{_fmt(r['mean'], True)} (log10 {r['log10_mean']:.2f} ± {r['log10_std']:.2f})"
            else:
                value = f"{_fmt(r['mean'], False)} ± {_fmt(r['std'], False)}"
            d = r["paired"]
            diff = "reference" if d is None else f"{d['mean']:+.4f} ± {d['std']:.4f}"
            verdict = "" if d is None else WORDS[d["verdict"]]
            paper = "" if r["paper"] is None else _fmt(r["paper"], table.log)
            lost = r.get("failed") or {}
            if lost:
                value += f" (**{len(lost)} of {r['n']} failed**)"
            cells = [label, value, str(r["n"]), paper, diff, verdict, r["agreement"]]
            cells += [f"{r['extras'][k][0]:.4f} ± {r['extras'][k][1]:.4f}" if k in r["extras"] else "" for k in extra_keys]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        strongest = strongest_competitor(table, rows)
        if strongest:
            lines += [strongest, ""]
        failures = [(label, seed, why) for label, r in rows.items() for seed, why in (r.get("failed") or {}).items()]
        if failures:
            lines += ["**Failed runs**, judged as the app judges a run (a round in which every client asked to train "
                      "failed, or a loss that diverged and left the run at chance); their figures are not results:", ""]
            lines += [f"- {label}, seed {seed}: {why}" for label, seed, why in failures] + [""]
    pending = not_run(table, summary)
    if pending:
        lines += ["**Not run yet at this scale** (the command below runs only these; finished runs are kept): "
                  + "; ".join(pending) + ".", ""]
    lines += [f"![{table.name}]({table.name}-{scale_name}.png)", "", "Command:", "", "```", command, "```", ""]
    if seconds is not None:
        lines += [f"Compute: {seconds / 60:.1f} min of run time summed over all runs (in-process engine).", ""]
    if machines:
        lines += ["Machines: " + "; ".join(f"{label} ({n} run{'s' if n != 1 else ''})" for label, n in sorted(machines.items())) + ".", ""]
    return "\n".join(lines)


def plot(table, summary: dict[str, Any], path: Path) -> None:
    """One panel per column: mean ± std per method as bars (log tables: geometric mean ± one
    std of log10), the paper's figure as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [c.name for c in table.columns if summary.get(c.name)]
    if not columns:
        return
    fig, axes = plt.subplots(1, len(columns), figsize=(max(4.5, 3.2 * len(columns)), 3.8), squeeze=False)
    for ax, name in zip(axes[0], columns):
        rows = summary[name]
        labels = list(rows)
        x = np.arange(len(labels))
        if table.log:  # geometric mean, error bar = one std of log10 either side
            logs = np.array([rows[m]["log10_mean"] for m in labels])
            spread = np.array([rows[m]["log10_std"] for m in labels])
            means = 10.0 ** logs
            errors = np.vstack([means - 10.0 ** (logs - spread), 10.0 ** (logs + spread) - means])
        else:
            means = np.array([rows[m]["mean"] for m in labels])
            errors = np.array([rows[m]["std"] for m in labels])
        ax.bar(x, means, yerr=errors, capsize=3, color="tab:blue", alpha=0.7, label="this run")
        paper = [(i, rows[m]["paper"]) for i, m in enumerate(labels) if rows[m]["paper"] is not None]
        if paper:
            ax.scatter([p[0] for p in paper], [p[1] for p in paper], marker="D", color="tab:red", zorder=3, label="paper")
        if table.log:
            ax.set_yscale("log")
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel(table.metric_label, fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
