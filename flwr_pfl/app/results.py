"""Every run's results as files in one directory (DESIGN principle 9).

Written as the run goes (so a crash keeps what was done): ``config.json`` (the resolved
configuration), ``metrics.json`` and ``metrics.csv`` (one row per round and phase, every
aggregated metric), ``timings.json`` and ``timings.csv`` (the same rows' wall-clock figures:
every metric with ``seconds`` in its name), ``clients.json`` and ``clients.csv`` (each client's
latest evaluation) and ``checkpoint.npz`` (the server's state, to resume). Timings are kept
apart so that ``metrics.json`` is bit-identical across reruns of the same config and seed.
At the end: ``learning_curves.png`` (and ``domains.png`` where samples carry domains) and a
one-screen summary on stdout.
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

Scalar = bool | bytes | float | int | str


class ResultsWriter:
    """Collects per-round metrics and per-client results and writes them under ``directory``.

    Args:
        directory: the run's output directory (created).
        config: the resolved configuration (written at once).
        state_fn: returns the server state to checkpoint after every evaluation round
            (``{"global_arrays": [...], "arrays": {name: array}, ...}``; the optional ``arrays``
            are stored as ``state_<name>``); None writes no checkpoint.
    """

    def __init__(
        self,
        directory: Path,
        config: dict[str, Any],
        state_fn: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.state_fn = state_fn
        self.rows: list[dict[str, Any]] = []
        self.timings: list[dict[str, Any]] = []
        self.started = time.perf_counter()
        self.clients: dict[int, dict[str, Any]] = {}
        (self.directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))

    # The strategy calls this after every aggregation (see PFLStrategy.on_round).
    def on_round(self, server_round: int, phase: str, metrics: dict[str, float], clients: dict[int, dict[str, Scalar]]) -> None:
        elapsed = time.perf_counter() - self.started
        key = {"round": server_round, "phase": phase}
        values = _plain(metrics)
        self.rows.append(key | {k: v for k, v in values.items() if not is_timing(k)})
        self.timings.append(key | {"elapsed_seconds": elapsed} | {k: v for k, v in values.items() if is_timing(k)})
        if phase == "evaluate":
            for pid, values in clients.items():
                self.clients[pid] = {"partition_id": pid, "round": server_round, **_plain(values)}
            self._write_clients()
            if self.state_fn is not None:
                self._write_checkpoint(server_round)
        self._write_metrics()

    def _write_metrics(self) -> None:
        for name, rows in (("metrics", self.rows), ("timings", self.timings)):
            (self.directory / f"{name}.json").write_text(json.dumps(rows, indent=1))
            _write_csv(self.directory / f"{name}.csv", rows)

    def _write_clients(self) -> None:
        rows = [self.clients[k] for k in sorted(self.clients)]
        (self.directory / "clients.json").write_text(json.dumps(rows, indent=1))
        _write_csv(self.directory / "clients.csv", rows)

    def _write_checkpoint(self, server_round: int) -> None:
        state = self.state_fn()  # type: ignore[misc]
        arrays = {f"global_{i}": a for i, a in enumerate(state.get("global_arrays", []))}
        # further named arrays of the strategy's state (e.g. per-client buffers) as state_<name>
        arrays |= {f"state_{k}": np.asarray(v) for k, v in state.get("arrays", {}).items()}
        np.savez(self.directory / "checkpoint.npz", rounds_done=np.array(server_round), **arrays)

    # ------------------------------------------------------------------ end of run
    def evaluation_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["phase"] == "evaluate"]

    def finish(self) -> str:
        """Write the plots and return (and print) the one-screen summary."""
        from flwr_pfl.app.plots import plot_domains, plot_learning_curves

        rows = self.evaluation_rows()
        if rows:
            plot_learning_curves(rows, self.directory / "learning_curves.png", title=self._title())
            if any(k.startswith("acc_d") for k in rows[-1]):
                plot_domains(rows, self.directory / "domains.png", title=self._title())
        summary = self.summary()
        (self.directory / "summary.txt").write_text(summary + "\n")
        print(summary, flush=True)
        return summary

    def _title(self) -> str:
        return f"{self.config.get('algorithm')} on {self.config.get('dataset')}"

    def summary(self) -> str:
        rows = self.evaluation_rows()
        lines = [f"flwr_pfl run: {self._title()}", f"results: {self.directory}"]
        if not rows:
            return "\n".join(lines + ["no evaluation round completed"])
        last = rows[-1]
        lines.append(f"rounds evaluated: {len(rows)} (last: round {last['round']}, {int(last.get('num_clients', 0))} clients)")
        for key, label in (("accuracy", "accuracy"), ("loss", "loss"), ("global_accuracy", "global-model accuracy")):
            if f"{key}_wmean" in last:
                lines.append(
                    f"{label:>22}: weighted mean {last[f'{key}_wmean']:.4f} | mean {last[f'{key}_mean']:.4f} "
                    f"| min {last[f'{key}_min']:.4f} | max {last[f'{key}_max']:.4f}"
                )
        if "acc_domain_min" in last:
            lines.append(f"{'per-domain accuracy':>22}: min {last['acc_domain_min']:.4f} | mean {last['acc_domain_mean']:.4f}")
        if "accuracy_wmean" in last:
            best = max(rows, key=lambda r: r.get("accuracy_wmean", -math.inf))
            lines.append(f"{'best round':>22}: {best['round']} (weighted mean accuracy {best['accuracy_wmean']:.4f})")
        return "\n".join(lines)


def is_timing(key: str) -> bool:
    """Whether a metric is a wall-clock figure (``train_seconds``, ``aggregate_seconds_mean``...)."""
    return "seconds" in key.split("_")


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe copies of metric values (bytes dropped, NaN kept as None)."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, bytes):
            continue
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        out[k] = v
    return out


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
