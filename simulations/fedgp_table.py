"""Target-domain table and plot for FedGP / FedDA comparisons written by ``flwr_pfl.app.compare``.

Reads ``<dir>/runs/<algorithm>-s<seed>/metrics.json`` of one or more compare outputs and reports,
per algorithm, the target's test accuracy: last round and the mean of the last five evaluations
(the paper's metric), as the accuracy on the target's domain (``acc_d<target domain>``), which
every algorithm reports (FedAvg included), plus the sources' mean accuracy where available.
Without domains (a label shift), ``--target-client K`` reads the FDA algorithms' own
``target_accuracy`` and, for algorithms that do not report it (FedAvg), client K's accuracy in
the last round from ``clients.json``.

    python simulations/fedgp_table.py --target-domain 3 --out docs/results/fedgp_rotated_mnist \\
        docs/results/fedgp_rotated_mnist docs/results/fedgp_rotated_mnist_auto
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def target_curve(run: Path, domain: int | None, client: int | None) -> list[float]:
    """One run's target accuracy per evaluation round."""
    rows = [r for r in json.loads((run / "metrics.json").read_text()) if r["phase"] == "evaluate"]
    if domain is not None:
        return [r.get(f"acc_d{domain}", np.nan) for r in rows]
    if all("target_accuracy" in r for r in rows):
        return [r["target_accuracy"] for r in rows]
    clients = {c["partition_id"]: c for c in json.loads((run / "clients.json").read_text())}
    return [float(clients[client]["accuracy"])]  # the last round only


def load(dirs: list[Path], domain: int | None, client: int | None = None) -> dict[str, list[list[float]]]:
    curves: dict[str, list[list[float]]] = {}
    for d in dirs:
        suffix = "_auto" if d.name.endswith("_auto") else ""
        for run in sorted((d / "runs").glob("*-s*")):
            algorithm = run.name.rsplit("-s", 1)[0] + suffix
            curves.setdefault(algorithm, []).append(target_curve(run, domain, client))
    return curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--target-domain", type=int)
    where.add_argument("--target-client", type=int)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    curves = load(args.dirs, args.target_domain, args.target_client)
    lines = ["| algorithm | target acc. (last round) | target acc. (last-5 mean) | seeds |", "|---|---|---|---|"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in sorted(curves.items(), key=lambda kv: -np.mean([np.mean(r[-5:]) for r in kv[1]])):
        last = [r[-1] for r in runs]
        last5 = [float(np.mean(r[-5:])) for r in runs]
        spread = f" ± {np.std(last5):.3f}" if len(runs) > 1 else ""
        lines.append(f"| {name} | {np.mean(last):.3f} | {np.mean(last5):.3f}{spread} | {len(runs)} |")
        if len(runs[0]) < 2:
            continue  # the last round only: no curve
        ax.plot(range(1, len(runs[0]) + 1), np.mean(np.array([r for r in runs if len(r) == len(runs[0])]), axis=0), label=name)
    ax.set_xlabel("round")
    ax.set_ylabel("target test accuracy")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    args.out.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.out / "target_accuracy.png", dpi=120)
    (args.out / "target_table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
