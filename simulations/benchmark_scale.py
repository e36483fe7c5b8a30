"""Benchmark: round time, server time and peak memory from 10 to 5,000 registered clients, 10%
sampled, for FedAvg, pFedFDA, FEDORA and FedRep, in-process and under `flwr run`.

Workload (small, so that thousands of clients fit two CPU cores): MNIST, 20 samples per client
(a stratified subset of 20 K samples, at most the 70,000 of the dataset, split IID; 20% of each
client's samples are its test split), the small CNN with a 16-wide representation, 4 rounds,
1 local epoch, batch 32, CPU, one torch thread. ``fraction-fit`` and ``fraction-evaluate`` are
0.1 (pFedFDA: each client trains with probability 0.1, and ``pfedfda.full-last-round`` is off;
its last round still evaluates every client, as the paper does). Everything else is each
algorithm's default (FEDORA keeps its LOCAL shadow model; FedRep trains its head 5 epochs).

Every configuration (algorithm, K, engine) runs in a fresh process and is written to
``<out>/scale/<engine>-<algorithm>-<K>.json`` as soon as it finishes; a rerun skips the
configurations already there (``--force`` measures them again), so a long sweep can be stopped
and resumed. Reported per configuration:

* round: mean wall time of rounds 2 and 3 (in-process also its CPU time, steadier on a shared
  machine) (round 1 also starts workers, loads data, asks every
  client for its partition id and, for FEDORA, collects every client's subspace; round 4 is
  pFedFDA's full evaluation);
* first round and total wall time;
* server: the strategy's fit aggregation per round (rounds 2-3; FEDORA's propagation
  ``Theta_hat = M Theta`` is in it);
* peak memory: in-process, the process's peak RSS; under ``flwr run``, the largest summed RSS of
  all the run's processes (SuperLink, simulation process with the ServerApp, Ray and its actors)
  and the simulation process's own peak;
* server state: the bytes of every array in the run's final checkpoint (the global arrays and
  whatever the strategy keeps between rounds: cluster models, per-client models, an affinity
  matrix, a hypernetwork and its embeddings), the part of the server's memory that grows with K
  for the algorithms that keep per-client state;
* wire (in-process): the array bytes sent to and received from the clients, per round (the run's
  total over its 4 rounds, so round 1's setup exchanges are spread over them).

Each round and peak memory is also given as a ratio to FedAvg's at the same K and engine (in-process
rounds in CPU seconds). The markdown table also gives, per algorithm and engine, the exponent b of a least-squares fit
of log(time) = a + b log(K) over the measured K >= 100.

    python simulations/benchmark_scale.py --clients 10 100 1000 5000 \\
        --algorithms fedavg pfedfda fedora fedrep --engines inprocess flwr --out docs/benchmark

On a machine with a GPU, ``--device cuda --gpus 0.25 --tag -cuda`` measures the same on CUDA (a
quarter of the GPU per simulated client) into ``scale-cuda.*``.

Writes ``<out>/scale.json`` and ``<out>/scale.md`` from every configuration found.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench_common import (
    RoundClock, fmt, fresh_run, launch, loglog_slope, machine, markdown_table, mean, peak_memory_mb, portable, report, round_times,
    run_child,
)

ROUNDS = 4
STEADY = slice(1, 3)  # rounds 2 and 3


def workload(algorithm: str, clients: int, data_dir: str, out: Path, name: str, device: str = "cpu") -> dict[str, Any]:
    config = {
        "algorithm": algorithm, "dataset": "mnist", "data-dir": data_dir, "max-samples": min(20 * clients, 70_000),
        "partitioner": "iid", "test-fraction": 0.2, "model": "cnn28", "feature-dim": 16,
        "num-clients": clients, "num-server-rounds": ROUNDS, "fraction-fit": 0.1, "fraction-evaluate": 0.1,
        "device": device, "num-threads": 1, "output-dir": str(out), "run-name": name,
    }
    if algorithm == "pfedfda":
        config["pfedfda.full-last-round"] = False
    return config


def child_inprocess(config: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    from flwr_pfl.app.client_app import app as client_app
    from flwr_pfl.app.inprocess import run_inprocess
    from flwr_pfl.app.server_app import app as server_app

    clock = RoundClock()
    grid = run_inprocess(server_app, client_app, config["num-clients"], config)
    report({"peak_memory_mb": peak_memory_mb(), "round_cpu_seconds": clock.steady(last=STEADY.stop)[1],
            "sent_mb_per_round": grid.bytes_sent / ROUNDS / 2**20, "received_mb_per_round": grid.bytes_received / ROUNDS / 2**20})


def server_state_mb(run_dir: Path) -> float:
    """Bytes of every array in the run's final checkpoint (MiB); NaN without one."""
    import numpy as np

    from flwr_pfl.app.checkpoint import CHECKPOINT_NAME

    path = run_dir / CHECKPOINT_NAME
    if not path.exists():
        return float("nan")
    with np.load(path, allow_pickle=False) as saved:
        return sum(saved[name].nbytes for name in saved.files) / 2**20


def measure(args: argparse.Namespace, engine: str, algorithm: str, clients: int) -> dict[str, Any]:
    name = f"{engine}-{algorithm}-{clients}"
    config = fresh_run(workload(algorithm, clients, args.data_dir, args.out / "runs" / "scale", name, args.device))
    if engine == "inprocess":
        result = run_child([str(Path(__file__).resolve()), "--child", "--config", json.dumps(config)], args.timeout)
    else:
        # a Flower home of its own: the memory sampler finds this run's processes by it
        result = launch(config, args.out / "runs" / "flwr-home-scale" / name, args.port, args.timeout, ["--gpus", str(args.gpus)])
        result["peak_memory_mb"] = result.pop("peak_total_mb", float("nan"))
    if result["status"] == "ok":
        times = round_times(args.out / "runs" / "scale" / name)
        result |= {
            "round_seconds": mean(times["rounds"][STEADY]),
            "first_round_seconds": times["rounds"][0],
            "server_seconds": mean(times["aggregate"][STEADY]),
            "rounds_seconds": times["rounds"],
            "server_state_mb": server_state_mb(args.out / "runs" / "scale" / name),
        }
    return result | {"engine": engine, "algorithm": algorithm, "clients": clients, "config": config}


def load_results(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def steady_round(result: dict[str, Any]) -> float:
    """A configuration's round for comparisons: CPU seconds where measured (in-process; steadier
    on a shared machine), else wall seconds."""
    return result.get("round_cpu_seconds", result.get("round_seconds", float("nan")))


def versus(result: dict[str, Any], base: dict[str, Any] | None, key: Any) -> str:
    """``result``'s figure as a ratio to FedAvg's at the same K and engine ("" without one)."""
    if base is None or result["status"] != "ok" or base["status"] != "ok":
        return ""
    return fmt(key(result) / key(base), 2)


def table(results: list[dict[str, Any]]) -> str:
    rows = []
    order = {"fedavg": 0, "pfedfda": 1, "fedora": 2, "fedrep": 3}
    fedavg = {(r["engine"], r["clients"]): r for r in results if r["algorithm"] == "fedavg"}
    for r in sorted(results, key=lambda r: (order.get(r["algorithm"], 9), r["algorithm"], r["engine"], r["clients"])):
        ok = r["status"] == "ok"
        base = fedavg.get((r["engine"], r["clients"]))
        rows.append([
            r["algorithm"], r["engine"], r["clients"], max(1, r["clients"] // 10),
            fmt(r.get("round_seconds")) if ok else r["status"], fmt(r.get("round_cpu_seconds")) if ok else "",
            versus(r, base, steady_round),
            fmt(r.get("first_round_seconds")) if ok else "",
            fmt(r.get("wall_seconds")), fmt(r.get("server_seconds")) if ok else "",
            fmt(r.get("peak_memory_mb")) if ok else "", versus(r, base, lambda x: x["peak_memory_mb"]),
            fmt(r.get("server_peak_mb")) if ok else "",
            fmt(r.get("server_state_mb")) if ok else "",
            fmt(r.get("sent_mb_per_round")) if ok else "", fmt(r.get("received_mb_per_round")) if ok else "",
        ])
    text = markdown_table(
        ["algorithm", "engine", "K", "sampled", "round (s)", "round CPU (s)", "round vs FedAvg", "first round (s)",
         "total (s)", "server (s)", "peak memory (MiB)", "peak memory vs FedAvg", "ServerApp process peak (MiB)",
         "server state (MiB)", "sent per round (MiB)", "received per round (MiB)"], rows)
    text += ("\n\n\"vs FedAvg\": against FedAvg at the same K and engine, each measured in a fresh process "
             "(round: CPU seconds in-process, wall seconds under `flwr run`).")
    slopes = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        if r["status"] == "ok" and r["clients"] >= 100:
            groups.setdefault((r["algorithm"], r["engine"]), []).append(r)
    for (algorithm, engine), rs in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0])):
        ks = [r["clients"] for r in rs]
        slopes.append([algorithm, engine, ", ".join(str(k) for k in sorted(ks)),
                       fmt(loglog_slope(ks, [r["round_seconds"] for r in rs]), 2),
                       fmt(loglog_slope(ks, [r.get("round_cpu_seconds", float("nan")) for r in rs]), 2),
                       fmt(loglog_slope(ks, [r["server_seconds"] for r in rs]), 2),
                       fmt(loglog_slope(ks, [r["peak_memory_mb"] for r in rs]), 2),
                       fmt(loglog_slope(ks, [r.get("server_state_mb", float("nan")) for r in rs]), 2),
                       fmt(loglog_slope(ks, [r.get("sent_mb_per_round", float("nan")) for r in rs]), 2)])
    text += ("\n\nGrowth with K (exponent b of time ~ K^b, least squares on log-log over K >= 100; "
             "1 = linear):\n\n" + markdown_table(["algorithm", "engine", "K measured", "round", "round CPU", "server",
                                                   "peak memory", "server state", "sent per round"], slopes))
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", default="~/.cache/flwr_pfl/data")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmark"))
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000, 5000])
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "pfedfda", "fedora", "fedrep"])
    parser.add_argument("--engines", nargs="+", default=["inprocess", "flwr"], choices=("inprocess", "flwr"))
    parser.add_argument("--force", action="store_true", help="measure configurations already measured again")
    parser.add_argument("--table-only", action="store_true", help="only rebuild scale.md/scale.json")
    parser.add_argument("--device", default="cpu", help="the clients' device (cpu, cuda, auto)")
    parser.add_argument("--gpus", type=float, default=0.0, help="flwr run: fraction of a GPU per simulated client")
    parser.add_argument("--tag", default="", help="suffix of the result folder and files (e.g. cuda)")
    parser.add_argument("--port", type=int, default=39731)
    parser.add_argument("--timeout", type=float, default=1800.0, help="per configuration (recorded as a timeout)")
    args = parser.parse_args(argv)
    if args.child:
        child_inprocess(json.loads(args.config))
        return
    args.out = args.out.resolve()
    folder = args.out / f"scale{args.tag}"
    folder.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        for clients in args.clients:
            for algorithm in args.algorithms:
                for engine in args.engines:
                    path = folder / f"{engine}-{algorithm}-{clients}.json"
                    if path.exists() and not args.force:
                        continue
                    where = machine()  # before the run, so that its load average is the one the run started under
                    result = measure(args, engine, algorithm, clients) | {"machine": where}
                    path.write_text(json.dumps(portable(result), indent=1))
                    print(f"{engine} {algorithm} K={clients}: {result['status']} round {fmt(result.get('round_seconds'))} s, "
                          f"total {fmt(result.get('wall_seconds'))} s", flush=True)
    results = load_results(folder)
    (args.out / f"scale{args.tag}.json").write_text(json.dumps(portable(results), indent=1))
    text = table(results)
    (args.out / f"scale{args.tag}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
