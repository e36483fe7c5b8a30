"""Traffic per algorithm on the default experiment: what a client downloads and uploads per round.

Runs every registered algorithm (or ``--algorithms``) on the app's default experiment
(``pyproject.toml``'s run config: Fashion-MNIST, the small CNN, 10 clients, all sampled) for
``--rounds`` rounds on the in-process engine, through the comparison tool's functions (with the
health sweep's per-algorithm extra config), and reads each run's ``traffic.json``
(:mod:`flwr_pfl.app.traffic`: the payload of every message, counted on the Grid). Per algorithm:
the mean bytes a client receives and sends per training round (``train`` messages, including an
algorithm's own training exchanges such as FedDAR's head phase), per evaluation, and the
start-up exchanges (round 0), with the upload as a ratio to FedAvg's. ``--secagg`` algorithms also
run with ``secure-aggregation = "secagg+"`` (its four stages are all ``train`` messages).

    python simulations/traffic_table.py --rounds 2
    python simulations/traffic_table.py --algorithms fedavg fedrep feddar-sa --rounds 2

Writes ``<out>/traffic.json`` and ``<out>/traffic.md`` (default ``docs/benchmark``) after every
algorithm; finished runs are reused.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Any

from flwr_pfl.app.appdir import default_run_config
from flwr_pfl.app.compare import run_configs, run_one
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.registry import ALGORITHMS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from health_sweep import extra_config  # noqa: E402 - the sweep's per-algorithm settings, one copy

REPO_ROOT = Path(__file__).resolve().parents[1]


def per_client_round(rows: list[dict[str, Any]], kind: str, field: str) -> float:
    """Mean of ``field`` over the (round >= 1, node) pairs that exchanged ``kind`` messages."""
    values = [r[field] for r in rows if r["kind"] == kind and r["round"] >= 1]
    return statistics.mean(values) if values else 0.0


def measure(base: dict[str, Any], algorithm: str, secagg: bool, out: Path) -> dict[str, Any]:
    extra, _ = extra_config(algorithm, base)
    if secagg:
        extra = {**extra, "secure-aggregation": "secagg+"}
    label = f"{algorithm} + SecAgg+" if secagg else algorithm
    config = run_configs({**base, **extra}, [algorithm], [0], out / "runs" / ("secagg" if secagg else "plain"))[algorithm][0]
    run_one(config, "inprocess", reuse=True)
    rows = json.loads((parse_experiment(config).output_path() / "traffic.json").read_text())
    return {
        "algorithm": label,
        "train_down": per_client_round(rows, "train", "bytes_sent"),
        "train_up": per_client_round(rows, "train", "bytes_received"),
        "evaluate_down": per_client_round(rows, "evaluate", "bytes_sent"),
        "startup": float(sum(r["bytes_sent"] + r["bytes_received"] for r in rows if r["round"] == 0)),
        "other": float(sum(r["bytes_sent"] + r["bytes_received"] for r in rows
                           if r["round"] >= 1 and r["kind"] not in ("train", "evaluate"))),
        "rounds": int(base["num-server-rounds"]),
    }


def table(cells: list[dict[str, Any]], rounds: int) -> str:
    fedavg = next((c["train_up"] for c in cells if c["algorithm"] == "fedavg"), None)
    lines = [
        "# Traffic per algorithm (default experiment)",
        "",
        f"Fashion-MNIST, the small CNN (`cnn28`), 10 clients all sampled, {rounds} rounds, seed 0, in-process. Mean "
        "payload per client and training round (arrays and byte strings of the messages, counted on the Grid; "
        "Flower's envelope adds a little), in kB (1000 bytes). *train*: every training exchange of the round "
        "(an algorithm's own phases included); *evaluate*: what an evaluation sends; *start-up*: the whole "
        "federation's round-0 exchanges (survey, initial arrays, setup); *other*: the algorithms' queries in "
        "the rounds, whole federation. Command: `python simulations/traffic_table.py --rounds " + str(rounds) + "`.",
        "",
        "| algorithm | train down (kB) | train up (kB) | up vs FedAvg | evaluate down (kB) | start-up (kB) | other (kB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        ratio = f"{c['train_up'] / fedavg:.2f}x" if fedavg else "-"
        lines.append(f"| {c['algorithm']} | {c['train_down'] / 1e3:.1f} | {c['train_up'] / 1e3:.1f} | {ratio} | "
                     f"{c['evaluate_down'] / 1e3:.1f} | {c['startup'] / 1e3:.1f} | {c['other'] / 1e3:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="+", default=None, help="default: every registered algorithm")
    parser.add_argument("--secagg", nargs="*", default=["fedavg", "fedrep"], help="also run these with SecAgg+")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "benchmark")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    base = {**default_run_config(), "num-server-rounds": args.rounds}
    algorithms = args.algorithms or sorted(ALGORITHMS)
    if "fedavg" in algorithms:  # the reference row first
        algorithms = ["fedavg", *(a for a in algorithms if a != "fedavg")]
    cells = []
    for algorithm in algorithms:
        for secagg in (False, True) if algorithm in args.secagg else (False,):
            cells.append(measure(base, algorithm, secagg, args.out / "traffic"))
            print(f"{cells[-1]['algorithm']}: down {cells[-1]['train_down'] / 1e3:.1f} kB, up {cells[-1]['train_up'] / 1e3:.1f} kB",
                  flush=True)
            (args.out / "traffic.json").write_text(json.dumps(cells, indent=1) + "\n")
            (args.out / "traffic.md").write_text(table(cells, args.rounds))


if __name__ == "__main__":
    main()
