"""What a run's results and checkpoints cost per round: the results files, and FEDORA's checkpoint.

Two measurements, each against the way it was done before, so that the change can be checked:

* **results files**: ``rounds`` rounds of one fit and one evaluation row each (``metrics``
  numbers per row), written by :class:`flwr_pfl.app.results.ResultsWriter` (rows appended to
  ``metrics.jsonl``, the JSON and CSV tables written once at the end) and by the former scheme,
  reproduced here (``metrics.json`` and ``.csv`` rewritten with every row after every row:
  quadratic in rounds). Reported: total seconds and the seconds of the last 10% of rounds.
* **FEDORA checkpoint**: a FEDORA server with ``K`` clients and a ``P``-value model after a few
  Eq. 6 updates, written by :func:`flwr_pfl.app.checkpoint.write_checkpoint` from
  ``FEDORA.state_dict`` (``Theta`` only; ``Theta_hat`` recomputed on load) and by the former
  layout, reproduced here (both ``K x P`` buffers in one ``np.savez``). Reported: file size,
  write seconds (temporary file, fsync, rename) and load seconds (read, rebuild, and for the new
  layout the recomputing GEMM), best of ``repeats``; and the server's Eq. 6 round for scale.

    python simulations/results_cost.py --rounds 500 --clients 20 --params 11500000 \\
        --out docs/benchmark/results

Writes ``<out>/results_cost.json`` and ``<out>/results_cost.md``.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench_common import best_of
from flwr_pfl.app.checkpoint import CHECKPOINT_NAME, read_checkpoint, write_checkpoint
from flwr_pfl.app.results import ResultsWriter
from flwr_pfl.core import fedora as core
from flwr_pfl.strategies.fedora import FEDORA
from flwr_pfl.strategies.validation import ClientReply


# ------------------------------------------------------------------------------ results files
def _rows(server_round: int, metrics: int) -> list[tuple[str, dict[str, float]]]:
    fit = {f"train_metric_{i}": 0.1 * i + server_round for i in range(metrics)}
    evaluate = {"num_clients": 20.0} | {f"eval_metric_{i}": 0.01 * i + server_round for i in range(metrics)}
    return [("fit", fit), ("evaluate", evaluate)]


def write_appended(directory: Path, rounds: int, metrics: int) -> list[float]:
    """Seconds per round of the results writer, then (last entry) its export at the end."""
    writer = ResultsWriter(directory, {"algorithm": "benchmark"})
    times = []
    for r in range(1, rounds + 1):
        start = time.perf_counter()
        for phase, values in _rows(r, metrics):
            writer.on_round(r, phase, values, {})
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    writer.export()
    return times + [time.perf_counter() - start]


def write_rewritten(directory: Path, rounds: int, metrics: int) -> list[float]:
    """Seconds per round of the former scheme: every row's JSON and CSV rewritten each time
    (nothing to export at the end: last entry 0)."""
    rows: list[dict[str, float]] = []
    times = []
    for r in range(1, rounds + 1):
        start = time.perf_counter()
        for phase, values in _rows(r, metrics):
            rows.append({"round": r, "phase": phase} | values)
            (directory / "metrics.json").write_text(json.dumps(rows, indent=1))
            columns: list[str] = []
            for row in rows:
                columns += [k for k in row if k not in columns]
            with (directory / "metrics.csv").open("w", newline="") as f:
                out = csv.DictWriter(f, fieldnames=columns)
                out.writeheader()
                out.writerows(rows)
        times.append(time.perf_counter() - start)
    return times + [0.0]


def results_cost(rounds: int, metrics: int) -> dict[str, float]:
    out: dict[str, float] = {"rounds": rounds, "metrics_per_row": metrics}
    for name, fn in (("appended", write_appended), ("rewritten", write_rewritten)):
        directory = Path(tempfile.mkdtemp(prefix=f"results-{name}-"))
        try:
            times = fn(directory, rounds, metrics)
        finally:
            shutil.rmtree(directory)
        times, end = times[:-1], times[-1]
        tail = times[-max(1, rounds // 10):]
        out[f"{name}_total_s"] = sum(times) + end
        out[f"{name}_at_end_s"] = end
        out[f"{name}_last10pct_per_round_ms"] = 1e3 * sum(tail) / len(tail)
        out[f"{name}_first10pct_per_round_ms"] = 1e3 * sum(times[: len(tail)]) / len(tail)
    return out


# ------------------------------------------------------------------------------ FEDORA checkpoint
def fedora_server(k: int, p: int, seed: int = 0) -> FEDORA:
    """A FEDORA server after setup and three Eq. 6 updates (every client uploading)."""
    rng = np.random.default_rng(seed)
    shapes = [(p // 10 - 1, 10), (10,)]
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    s = FEDORA(num_clients=k)
    s.global_arrays = init
    s.layout = core.ParameterLayout.from_arrays(init)
    s.graph = core.build_propagation_graph([np.linalg.qr(rng.standard_normal((64, 1)))[0] for _ in range(k)],
                                           s.config.graph, s.config.propagation)
    s.theta, s.theta_hat = core.init_server_buffers(s.layout.flatten(init), k)
    upload = [a + 0.01 for a in init]
    for rnd in range(3):
        s._sampled = set(range(k))
        s.aggregate_replies(rnd + 1, [ClientReply(f"c{i}", i, 10, upload, {}) for i in range(k)])
    return s


def _former_write(directory: Path, s: FEDORA) -> None:
    """The former checkpoint: both K x P buffers and the graph, one np.savez, not atomic."""
    g = s.graph
    arrays = {f"global_{i}": a for i, a in enumerate(s.global_arrays or [])}
    arrays |= {"state_fedora_theta": s.theta, "state_fedora_theta_hat": s.theta_hat,
               "state_fedora_similarity": g.similarity, "state_fedora_weights": g.weights,
               "state_fedora_transition": g.transition, "state_fedora_propagation": g.propagation,
               "state_fedora_present": g.present, "state_fedora_kappa": np.array(g.kappa)}
    np.savez(directory / CHECKPOINT_NAME, rounds_done=np.array(3), **arrays)


def _former_load(directory: Path) -> None:
    with np.load(directory / CHECKPOINT_NAME) as ckpt:
        for name in ckpt.files:
            np.ascontiguousarray(ckpt[name])


def checkpoint_cost(k: int, p: int, repeats: int) -> dict[str, float]:
    s = fedora_server(k, p)
    out: dict[str, float] = {"clients": k, "params": s.layout.size}
    out["fedora_round_s"] = best_of(lambda: core.server_update(s.theta, s.theta_hat, {}, s.graph, s.config.propagation), repeats)
    directory = Path(tempfile.mkdtemp(prefix="fedora-checkpoint-"))
    try:
        out["former_write_s"] = best_of(lambda: _former_write(directory, s), repeats)
        out["former_mb"] = (directory / CHECKPOINT_NAME).stat().st_size / 2**20
        out["former_load_s"] = best_of(lambda: _former_load(directory), repeats)
        (directory / CHECKPOINT_NAME).unlink()
        out["write_s"] = best_of(lambda: write_checkpoint(directory, 3, {}, {}, s.state_dict()), repeats)
        out["mb"] = (directory / CHECKPOINT_NAME).stat().st_size / 2**20

        def load() -> None:
            FEDORA(num_clients=k).load_state_dict(read_checkpoint(directory / CHECKPOINT_NAME).state, 3)

        out["load_s"] = best_of(load, repeats)
        restored = FEDORA(num_clients=k)
        restored.load_state_dict(read_checkpoint(directory / CHECKPOINT_NAME).state, 3)
        out["theta_hat_bit_identical"] = bool(np.array_equal(restored.theta_hat, s.theta_hat))
    finally:
        shutil.rmtree(directory)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--metrics", type=int, default=40, help="numbers per metrics row")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--params", type=int, default=11_500_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (FEDORA's GEMM runs in torch)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmark/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = results_cost(args.rounds, args.metrics)
    print(json.dumps(results))
    ckpt = checkpoint_cost(args.clients, args.params, args.repeats)
    print(json.dumps(ckpt))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results_cost.json").write_text(json.dumps({"results": results, "fedora_checkpoint": ckpt}, indent=1))
    lines = [
        f"Results files, {results['rounds']} rounds x 2 rows of {results['metrics_per_row']} numbers:",
        "",
        "| scheme | total (s) | per round, first 10% (ms) | per round, last 10% (ms) | at the end (s) |",
        "|---|---|---|---|---|",
    ]
    for name, label in (("rewritten", "former: JSON + CSV rewritten per row"), ("appended", "now: JSON lines appended, tables at the end")):
        lines.append(f"| {label} | {results[f'{name}_total_s']:.2f} | {results[f'{name}_first10pct_per_round_ms']:.2f} | "
                     f"{results[f'{name}_last10pct_per_round_ms']:.2f} | {results[f'{name}_at_end_s']:.2f} |")
    lines += [
        "",
        f"FEDORA checkpoint, K = {ckpt['clients']} clients, P = {ckpt['params']} values "
        f"(Eq. 6 server round for scale: {ckpt['fedora_round_s']:.2f} s; {args.threads} thread(s)):",
        "",
        "| layout | size (MB) | write (s) | load (s) |",
        "|---|---|---|---|",
        f"| former: Theta and Theta_hat, np.savez | {ckpt['former_mb']:.0f} | {ckpt['former_write_s']:.2f} | {ckpt['former_load_s']:.2f} |",
        f"| now: Theta, Theta_hat recomputed on load; atomic + fsync | {ckpt['mb']:.0f} | {ckpt['write_s']:.2f} | {ckpt['load_s']:.2f} |",
        "",
        f"Theta_hat after loading is bit-identical to the server's: {ckpt['theta_hat_bit_identical']}.",
    ]
    (args.out / "results_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
