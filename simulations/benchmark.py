"""Benchmark: the cost of each algorithm's round against FedAvg's, and against a plain loop.

Runs a fixed workload (default: 20 clients, Fashion-MNIST with Dirichlet(0.3) label skew,
the small CNN, 3 rounds, 1 local epoch) for a list of algorithms, one after another in this
process, through the real strategies and clients on the in-process grid (no Ray, so the
figures are the algorithms' and Flower's own costs, not the simulation engine's). Then it
trains the same clients with a plain PyTorch loop (same data, model, optimizer and shared
train loop; no Flower, no messages): the floor.

For each algorithm it reports wall time per round, time in client code, time in server
aggregation, array bytes sent and received per round, and peak resident memory, each also as a
ratio against FedAvg's in the same benchmark run (these machines are shared and noisy, so only
ratios within one run are comparable). FedAvg's round time is also given as a ratio against the
floor. Each algorithm, and the floor, runs in a fresh process (after loading and partitioning
the data there), so its peak memory is its own, not what an algorithm measured before left.

    python simulations/benchmark.py --data-dir DIR [--algorithms fedavg fedrep ...] [--out docs/benchmark]
        [-c "fmtl.t1-rounds=1"]

Writes ``benchmark.json`` and ``benchmark.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import floor_rounds, fresh_run, machine, peak_memory_mb, portable, report, reset_peak_memory, run_child

from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.overrides import parse_overrides
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.data.federated import load_client_data

DEFAULT_ALGORITHMS = ["fedavg", "local", "finetune", "fedrep", "fedper"]


def workload(args: argparse.Namespace, algorithm: str) -> dict[str, Any]:
    return {
        "algorithm": algorithm,
        "dataset": args.dataset,
        "data-dir": str(args.data_dir),
        "partitioner": "dirichlet",
        "dirichlet-alpha": 0.3,
        "num-clients": args.clients,
        "num-server-rounds": args.rounds,
        "max-samples": args.samples,
        "model": args.model,
        "device": args.device,
        "output-dir": str(args.out / "runs"),
        "run-name": algorithm,
    } | args.overrides


def measure_algorithm(args: argparse.Namespace, algorithm: str) -> dict[str, float]:
    """Run one algorithm through Flower in-process and summarise its costs per round."""
    reset_peak_memory()
    start = time.perf_counter()
    grid = run_inprocess(server_app, client_app, args.clients, fresh_run(workload(args, algorithm)))
    wall = time.perf_counter() - start
    run = args.out / "runs" / algorithm
    rows = json.loads((run / "metrics.json").read_text())
    timings = json.loads((run / "timings.json").read_text())
    clients = [r.get("num_clients", 0.0) for r in rows if r["phase"] == "fit"]
    fits = [r for r in timings if r["phase"] == "fit"]
    evals = [r for r in rows if r["phase"] == "evaluate"]
    train_seconds = sum(r.get("train_seconds_mean", 0.0) * n for r, n in zip(fits, clients))
    return {
        "round_seconds": wall / args.rounds,
        "client_seconds": grid.client_seconds / args.rounds,
        "train_seconds": train_seconds / args.rounds,
        "aggregate_seconds": sum(r.get("aggregate_seconds", 0.0) for r in fits) / args.rounds,
        "bytes_sent": grid.bytes_sent / args.rounds,
        "bytes_received": grid.bytes_received / args.rounds,
        "peak_memory_mb": peak_memory_mb(),
        "final_accuracy": evals[-1].get("accuracy_wmean", float("nan")) if evals else float("nan"),
    }


def measure_floor(args: argparse.Namespace) -> dict[str, float]:
    """FedAvg's computation as a plain loop (:func:`bench_common.floor_rounds`), all rounds."""
    ends = floor_rounds(workload(args, "fedavg"), args.device)
    return {"round_seconds": (ends[-1][0] - ends[0][0]) / args.rounds, "peak_memory_mb": peak_memory_mb()}


COLUMNS = [
    ("round_seconds", "round (s)"),
    ("client_seconds", "client code (s)"),
    ("aggregate_seconds", "aggregation (s)"),
    ("bytes_sent", "sent (MB)"),
    ("bytes_received", "received (MB)"),
    ("peak_memory_mb", "peak RSS (MiB)"),
]


def table(results: dict[str, dict[str, float]], floor: dict[str, float]) -> str:
    """Markdown table: each figure with its ratio to FedAvg's in brackets."""
    base = results.get("fedavg", next(iter(results.values())))
    lines = [
        "| algorithm | " + " | ".join(label for _, label in COLUMNS) + " | final accuracy |",
        "|---|" + "---|" * (len(COLUMNS) + 1),
    ]
    for name, row in results.items():
        cells = []
        for key, _ in COLUMNS:
            value = row[key] / 1e6 if key.startswith("bytes") else row[key]
            ratio = row[key] / base[key] if base[key] else float("nan")
            cells.append(f"{value:.3g} (x{ratio:.2f})")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {row['final_accuracy']:.3f} |")
    lines.append(
        f"| plain PyTorch loop (floor) | {floor['round_seconds']:.3g} "
        f"(FedAvg is x{base['round_seconds'] / floor['round_seconds']:.2f} the floor) | | | | | "
        f"{floor['peak_memory_mb']:.3g} | |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmark"))
    parser.add_argument("--algorithms", nargs="+", default=DEFAULT_ALGORITHMS)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--model", default="cnn28")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=6000, help="pool size shared by the clients")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("-c", "--run-config", action="append", default=[],
                        help="further run-config overrides for every algorithm ('k=v' or a TOML file), e.g. algorithm options")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # measure one algorithm (or "floor") here
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.overrides = parse_overrides(args.run_config)
    args.out = args.out.resolve()
    args.data_dir = args.data_dir.resolve()
    if args.child:
        torch.set_num_threads(args.threads)
        logging.getLogger("flwr").setLevel(logging.WARNING)
        # Load and partition the data before timing anything: the run then finds it cached.
        experiment = parse_experiment(workload(args, "fedavg"))
        for pid in range(args.clients):
            load_client_data(experiment.data, pid, args.clients)
        report(measure_floor(args) if args.child == "floor" else measure_algorithm(args, args.child))
        return

    def fresh(name: str) -> dict[str, float]:
        # the entry script again (a wrapper such as fedgp_benchmark.py adds its variants there)
        result = run_child([str(Path(sys.argv[0]).resolve()), *argv, "--child", name], timeout=3600)
        if result.pop("status") != "ok":
            raise RuntimeError(f"{name} failed:\n{result.get('error', '')}")
        result.pop("wall_seconds")
        return result

    results = {name: fresh(name) for name in args.algorithms}
    floor = fresh("floor")
    summary = {
        "workload": {k: v for k, v in vars(args).items() if k not in ("out", "data_dir", "run_config", "child")},
        "machine": machine() | {"threads": args.threads, "device": args.device},
        "results": results,
        "ratios_vs_fedavg": {
            name: {k: (row[k] / results["fedavg"][k] if results.get("fedavg", {}).get(k) else None) for k, _ in COLUMNS}
            for name, row in results.items()
        },
        "floor": floor,
        "fedavg_round_vs_floor": results["fedavg"]["round_seconds"] / floor["round_seconds"] if "fedavg" in results else None,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "benchmark.json").write_text(json.dumps(portable(summary), indent=2))
    md = table(results, floor)
    (args.out / "benchmark.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
