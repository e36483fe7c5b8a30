"""Benchmark: FedAvg's round as the federation grows, against the plain-PyTorch floor, in-process
and under `flwr run`, and where a client's time goes.

Workload: FedAvg on a 6,000-sample stratified subset of Fashion-MNIST split IID over K clients,
the small CNN, every client trains (1 epoch, batch 32, SGD) and evaluates in every round, CPU,
one torch thread. For each K in ``--clients`` three engines run it, each in a fresh process:

* ``floor``: the same SGD steps and evaluations as a plain loop over the clients with one model
  (no Flower, no messages): set the global weights, train, read the weights back, average,
  evaluate every client;
* ``inprocess``: the real ServerApp and ClientApp on the in-process grid;
* ``flwr``: the real ``flwr run`` through the launcher (Ray simulation engine, K SuperNodes);
  ``--flwr-workers`` adds variants with ``server-workers`` set (0 = the app's default).

A round's time is the mean over rounds 2..R (round 1 also loads data, builds models and, under
``flwr run``, starts the Ray actors). The engines are interleaved and repeated (``--repeats``);
each keeps its fastest repeat, as the machines these run on are shared and noisy. The floor and
the in-process engine also report CPU seconds per round (less sensitive to other load).

``--breakdown K`` adds an instrumented in-process run that splits each client's CPU time into
training and evaluation (the floor's work), this project's client code, and Flower's message
handling, and the server's time into aggregation and the rest.

    python simulations/benchmark_overhead.py --clients 10 50 200 1000 --rounds 3 --repeats 2 \\
        --breakdown 1000 --out docs/benchmark

Writes ``<out>/overhead.json`` and ``<out>/overhead.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import (
    RoundClock, floor_rounds, fmt, fresh_run, launch, machine, markdown_table, mean, peak_memory_mb, portable, report, round_times,
    run_child,
)


def workload(clients: int, rounds: int, data_dir: str, out: Path, name: str) -> dict[str, Any]:
    return {
        "algorithm": "fedavg", "dataset": "fashion-mnist", "data-dir": data_dir, "max-samples": 6000,
        "partitioner": "iid", "model": "cnn28", "num-clients": clients, "num-server-rounds": rounds,
        "fraction-fit": 1.0, "fraction-evaluate": 1.0, "device": "cpu", "num-threads": 1,
        "output-dir": str(out), "run-name": name,
    }


# ------------------------------------------------------------------------------ children
def child_inprocess(config: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    from flwr_pfl.app.client_app import app as client_app
    from flwr_pfl.app.inprocess import run_inprocess
    from flwr_pfl.app.server_app import app as server_app

    clock = RoundClock()
    run_inprocess(server_app, client_app, config["num-clients"], config)
    wall, cpu = clock.steady()
    report({"round_seconds": wall, "round_cpu_seconds": cpu, "peak_memory_mb": peak_memory_mb()})


def child_floor(config: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    ends = floor_rounds(config, "cpu")
    rounds = list(zip(ends, ends[1:]))[1:]  # rounds 2..R, as for the engines
    report({"round_seconds": mean([b[0] - a[0] for a, b in rounds]),
            "round_cpu_seconds": mean([b[1] - a[1] for a, b in rounds]), "peak_memory_mb": peak_memory_mb()})


def child_breakdown(config: dict[str, Any]) -> None:
    """One in-process run with thread-CPU clocks around the pieces of a message."""
    import torch

    torch.set_num_threads(1)
    import flwr.compat.client.numpy_client as numpy_client

    from flwr_pfl.app import client_app as app_module
    from flwr_pfl.app import inprocess
    from flwr_pfl.app.server_app import app as server_app
    from flwr_pfl.clients import base as client_base
    from flwr_pfl.strategies import base as strategy_base

    totals: dict[str, float] = {}

    def clock(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                totals[label] = totals.get(label, 0.0) + time.thread_time() - start

        setattr(owner, name, timed)

    # a first round builds every client's data; the clocks start on the second run's rounds
    k = config["num-clients"]
    inprocess.run_inprocess(server_app, app_module.app, k, fresh_run(config | {"num-server-rounds": 1, "run-name": "warm-up"}))
    clock(inprocess.InProcessGrid, "_push", "client: all")
    clock(app_module, "build_client", "client: build (config, data, model from the cache)")
    clock(client_base, "train", "client: training (floor work)")
    clock(client_base, "evaluate", "client: evaluation (floor work)")
    clock(client_base.PFLClient, "fit", "client: fit and evaluate handlers")
    clock(client_base.PFLClient, "evaluate", "client: fit and evaluate handlers")
    clock(numpy_client, "parameters_to_ndarrays", "client: Flower's array decoding")
    clock(numpy_client, "ndarrays_to_parameters", "client: Flower's array encoding")
    clock(strategy_base.PFLStrategy, "aggregate_fit", "server: fit aggregation (decode, check, average)")
    rounds = config["num-server-rounds"]
    start = time.process_time()
    inprocess.run_inprocess(server_app, app_module.app, k, config)
    total = time.process_time() - start
    per = {label: seconds / rounds / k * 1e3 for label, seconds in totals.items()}
    handlers = per.pop("client: fit and evaluate handlers")
    training, evaluation = per["client: training (floor work)"], per["client: evaluation (floor work)"]
    client_all = per.pop("client: all")
    rows = {
        "client: training and evaluation (the floor's work)": training + evaluation,
        "client: build (config, data, model from the cache)": per["client: build (config, data, model from the cache)"],
        "client: rest of this project's handlers (load and read weights, seeding, metrics)": handlers - training - evaluation,
        "client: Flower's array decoding and encoding": per["client: Flower's array decoding"] + per["client: Flower's array encoding"],
    }
    rows["client: Flower's message handling (records, messages, the rest)"] = client_all - sum(rows.values())
    server = total / rounds / k * 1e3 - client_all
    aggregation = per["server: fit aggregation (decode, check, average)"]
    rows["server: fit aggregation (decode, check, average)"] = aggregation
    rows["server: Flower's legacy loop and the grid (records, messages, threads)"] = server - aggregation
    report({"ms_per_client_per_round": rows, "cpu_seconds_per_round": total / rounds})


# ------------------------------------------------------------------------------ parent
def measure(args: argparse.Namespace, engine: str, clients: int, repeat: int) -> dict[str, Any]:
    name = f"{engine}-{clients}-{repeat}"
    config = fresh_run(workload(clients, args.rounds, args.data_dir, args.out / "runs", name))
    if engine in ("floor", "inprocess", "breakdown"):
        return run_child([str(Path(__file__).resolve()), "--child", engine, "--config", json.dumps(config)], args.timeout)
    workers = int(engine.split("-w")[1]) if "-w" in engine else 0
    result = launch(config | ({"server-workers": workers} if workers else {}), args.out / "runs" / "flwr-home-overhead" / name,
                    args.port, args.timeout)
    if result["status"] == "ok":
        steady = round_times(args.out / "runs" / name)["rounds"][1:]
        result["round_seconds"] = mean(steady)
    return result


def summarize(results: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[str, dict[int, dict[str, float]]]:
    """Per engine and K: the fastest repeat's round time (and CPU), the largest peak memory."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for engine, by_k in results.items():
        for k, runs in by_k.items():
            ok = [r for r in runs if r.get("status") == "ok" and r.get("round_seconds") == r.get("round_seconds")]
            if not ok:
                continue
            best = min(ok, key=lambda r: r["round_seconds"])
            out.setdefault(engine, {})[k] = {
                "round_seconds": best["round_seconds"],
                "round_cpu_seconds": min((r.get("round_cpu_seconds", float("nan")) for r in ok), default=float("nan")),
                "peak_memory_mb": max(r.get("peak_memory_mb", r.get("peak_total_mb", float("nan"))) for r in ok),
                "repeats": len(ok),
            }
    return out


def tables(summary: dict[str, dict[int, dict[str, float]]], breakdown: dict[str, Any] | None, k_breakdown: int) -> str:
    engines = [e for e in summary if e not in ("floor", "inprocess")]
    header = ["K", "floor (s)", "in-process (s)", "in-process / floor", "CPU: in-process / floor"]
    header += [f"{e} (s)" for e in engines] + [f"{e} / in-process" for e in engines]
    rows = []
    for k in sorted({k for by_k in summary.values() for k in by_k}):
        floor, inproc = summary.get("floor", {}).get(k, {}), summary.get("inprocess", {}).get(k, {})
        f, i = floor.get("round_seconds", float("nan")), inproc.get("round_seconds", float("nan"))
        fc, ic = floor.get("round_cpu_seconds", float("nan")), inproc.get("round_cpu_seconds", float("nan"))
        row = [k, fmt(f), fmt(i), fmt(i / f), fmt(ic / fc)]
        others = [summary[e].get(k, {}).get("round_seconds", float("nan")) for e in engines]
        row += [fmt(v) for v in others] + [fmt(v / i) for v in others]
        rows.append(row)
    text = "Seconds per round (rounds 2..R, fastest repeat):\n\n" + markdown_table(header, rows)
    if breakdown and breakdown.get("status") == "ok":
        parts = breakdown["ms_per_client_per_round"]
        total = sum(parts.values())
        lines = [[label, fmt(ms), f"{100 * ms / total:.0f}%"] for label, ms in parts.items()]
        lines.append(["total", fmt(total), "100%"])
        text += (f"\n\nWhere a round's CPU time goes at K = {k_breakdown}, in-process (ms per client and round, "
                 "thread CPU time):\n\n" + markdown_table(["part", "ms", "share"], lines))
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=("floor", "inprocess", "breakdown"), help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", default="~/.cache/flwr_pfl/data")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmark"))
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50, 200, 1000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engines", nargs="+", default=["floor", "inprocess", "flwr"])
    parser.add_argument("--flwr-workers", type=int, nargs="*", default=[], help="also run flwr with these server-workers")
    parser.add_argument("--breakdown", type=int, default=0, help="K of the instrumented in-process run (0 = none)")
    parser.add_argument("--port", type=int, default=39631)
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    if args.child:
        {"floor": child_floor, "inprocess": child_inprocess, "breakdown": child_breakdown}[args.child](json.loads(args.config))
        return
    args.out = args.out.resolve()
    engines = args.engines + [f"flwr-w{w}" for w in args.flwr_workers]
    results: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for repeat in range(args.repeats):
        for k in args.clients:
            for engine in engines:
                result = measure(args, engine, k, repeat)
                results.setdefault(engine, {}).setdefault(k, []).append(result)
                print(f"repeat {repeat} K={k} {engine}: {result.get('status')} round {fmt(result.get('round_seconds', float('nan')))} s",
                      flush=True)
    breakdown = measure(args, "breakdown", args.breakdown, 0) if args.breakdown else None
    summary = summarize(results)
    report_data = {"workload": {k: v for k, v in workload(0, args.rounds, args.data_dir, Path(), "").items()
                                if k not in ("num-clients", "output-dir", "run-name")},
                   "machine": machine(), "clients": args.clients, "repeats": args.repeats,
                   "summary": {e: {str(k): v for k, v in by_k.items()} for e, by_k in summary.items()},
                   "breakdown": breakdown, "runs": {e: {str(k): v for k, v in by_k.items()} for e, by_k in results.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps(portable(report_data), indent=1))
    text = tables(summary, breakdown, args.breakdown)
    (args.out / "overhead.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
