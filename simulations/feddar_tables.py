"""Tables and plots of the FedDAR experiments from the compare runs' files (docs/feddar.md).

    python simulations/feddar_tables.py synthetic docs/results/feddar_synthetic --plot docs/feddar_synthetic_mse.png
    python simulations/feddar_tables.py digits docs/results/feddar_digits_a0.1 docs/results/feddar_digits_a0.5 \
        docs/results/feddar_digits_a1 docs/results/feddar_digits_a100 --plot docs/feddar_digits.png

Figures are averaged over the last ``--last`` evaluation rounds of each run (the paper averages
the final 10 rounds), then mean +- std over seeds. Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np


def load(out: Path) -> dict[str, list[list[dict]]]:
    """algorithm -> per seed, the evaluation rows."""
    runs: dict[str, list[list[dict]]] = defaultdict(list)
    for metrics in sorted((out / "runs").glob("*/metrics.json")):
        algorithm = metrics.parent.name.rsplit("-s", 1)[0]
        rows = [r for r in json.loads(metrics.read_text()) if r["phase"] == "evaluate"]
        if rows:
            runs[algorithm].append(rows)
    return runs


def figure(runs: list[list[dict]], key: str, last: int) -> tuple[float, float]:
    values = [np.mean([r[key] for r in rows[-last:] if r.get(key) is not None]) for rows in runs]
    return float(np.mean(values)), float(np.std(values))


def synthetic(out: Path, last: int, plot: Path | None) -> str:
    runs = load(out)
    lines = ["| method | test MSE (client-weighted) | worst-domain MSE | domain-mean MSE | seeds |", "|---|---|---|---|---|"]
    for algorithm, per_seed in runs.items():
        cells = [figure(per_seed, k, last) for k in ("loss_wmean", "loss_domain_max", "loss_domain_mean")]
        lines.append(f"| {algorithm} | " + " | ".join(f"{m:.2e} ± {s:.1e}" for m, s in cells) + f" | {len(per_seed)} |")
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4))
        for algorithm, per_seed in runs.items():
            n = min(len(r) for r in per_seed)
            values = np.array([[row["loss_wmean"] for row in r[:n]] for r in per_seed])
            if not np.all(values[:, -1] < 1e3):  # diverged runs (listed in the table) would flatten the plot
                continue
            ax.semilogy(range(1, n + 1), values.mean(0), label=algorithm)
        ax.set_xlabel("round (one FedDAR round = head + representation exchange)")
        ax.set_ylabel("test MSE")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        plt.close(fig)
    return "\n".join(lines)


def digits(outs: list[Path], last: int, plot: Path | None) -> str:
    alphas = [o.name.rsplit("_a", 1)[-1] for o in outs]
    table: dict[str, dict[str, tuple]] = defaultdict(dict)
    for alpha, out in zip(alphas, outs):
        for algorithm, per_seed in load(out).items():
            table[algorithm][alpha] = tuple(
                figure(per_seed, k, last) for k in ("acc_domain_min", "acc_domain_mean", "accuracy_mean")
            ) + (_max_domain(per_seed, last),)
    head = "| method | " + " | ".join(f"α={a} Max | Min | Avg | Client Avg" for a in alphas) + " |"
    lines = [head, "|---|" + "---|---|---|---|" * len(alphas)]
    for algorithm, cells in table.items():
        row = []
        for a in alphas:
            if a not in cells:
                row += [""] * 4
                continue
            (mn, _), (avg, _), (client, _), mx = cells[a]
            row += [f"{100 * mx:.1f}", f"{100 * mn:.1f}", f"{100 * avg:.1f}", f"{100 * client:.1f}"]
        lines.append(f"| {algorithm} | " + " | ".join(row) + " |")
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
        width = 0.8 / max(len(table), 1)
        for j, (algorithm, cells) in enumerate(table.items()):
            for ax, idx, title in ((axes[0], 0, "worst-domain accuracy"), (axes[1], 1, "domain-average accuracy")):
                ys = [cells[a][idx][0] if a in cells else np.nan for a in alphas]
                ax.bar(np.arange(len(alphas)) + j * width, ys, width, label=algorithm)
                ax.set_title(title)
                ax.set_xticks(np.arange(len(alphas)) + 0.4 - width / 2, [f"α={a}" for a in alphas])
        axes[0].set_ylabel("test accuracy")
        axes[1].legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        plt.close(fig)
    return "\n".join(lines)


def _max_domain(per_seed: list[list[dict]], last: int) -> float:
    """Best domain's accuracy (the paper's Max), from the per-domain keys acc_d<m>."""
    values = []
    for rows in per_seed:
        keys = [k for k in rows[-1] if k.startswith("acc_d") and k[5:].isdigit()]
        values.append(np.mean([max(r[k] for k in keys if k in r) for r in rows[-last:]]))
    return float(np.mean(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("synthetic", "digits"))
    parser.add_argument("outs", nargs="+", type=Path)
    parser.add_argument("--last", type=int, default=3)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    if args.kind == "synthetic":
        print(synthetic(args.outs[0], args.last, args.plot))
    else:
        print(digits(args.outs, args.last, args.plot))


if __name__ == "__main__":
    main()
