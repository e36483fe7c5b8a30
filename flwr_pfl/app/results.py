"""Every run's results as files in one directory (DESIGN principle 9).

Written as the run goes, at a cost per round that does not grow with the rounds done (so a
crash keeps what was done, and a long run does not slow down): ``config.json`` (the resolved
configuration), ``metrics.jsonl`` (one JSON line per round and phase, every aggregated metric,
appended), ``timings.jsonl`` (the same rows' wall-clock figures: every metric with ``seconds``
in its name), ``clients.json`` and ``clients.csv`` (each client's latest evaluation; one row per
client) and ``checkpoint.npz`` (the server's state every ``checkpoint-interval`` rounds and
after the last, to resume; :mod:`flwr_pfl.app.checkpoint`). Timings are kept apart so that the
metrics are bit-identical across reruns of the same config and seed.

At the end (also when the run stops on an error): ``metrics.json``, ``metrics.csv``,
``timings.json`` and ``timings.csv`` (the appended rows as one JSON list and one CSV table),
then ``learning_curves.png`` (and ``domains.png`` where samples carry domains) and a one-screen
summary in ``summary.txt`` and on stdout.

A resumed run continues the same files: the rows up to the checkpoint's round are kept, rows a
killed run appended after its last checkpoint are dropped (those rounds run again).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flwr_pfl.app.checkpoint import Checkpoint, remove_stale_temporaries, write_checkpoint
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.validation import describe_failures

Scalar = bool | bytes | float | int | str

METRICS_LOG = "metrics.jsonl"
TIMINGS_LOG = "timings.jsonl"
#: files whose presence means a directory already holds a run's results
RESULT_FILES = ("config.json", METRICS_LOG, "metrics.json", "checkpoint.npz", "summary.txt")


class ResultsWriter:
    """Collects per-round metrics and per-client results and writes them under ``directory``.

    Args:
        directory: the run's output directory (created).
        config: the resolved configuration (written at once, and into every checkpoint).
        state_fn: returns the server state to checkpoint (a strategy's ``state_dict``); None
            writes no checkpoint.
        checkpoint_interval: write a checkpoint after every this many rounds (counted from the
            run's first round) ...
        last_round: ... and after this round (the run's last; 0 = unknown).
        resume_from: a checkpoint of this directory to continue from: its rows are kept, later
            ones dropped.
    """

    def __init__(
        self,
        directory: Path,
        config: dict[str, Any],
        state_fn: Callable[[], dict[str, Any]] | None = None,
        *,
        checkpoint_interval: int = 1,
        last_round: int = 0,
        resume_from: Checkpoint | None = None,
    ) -> None:
        if checkpoint_interval < 1:
            raise ValueError(f"checkpoint_interval must be >= 1, got {checkpoint_interval}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.state_fn = state_fn
        self.checkpoint_interval = checkpoint_interval
        self.last_round = last_round
        self.rows: list[dict[str, Any]] = []
        self.timings: list[dict[str, Any]] = []
        self.clients: dict[int, dict[str, Any]] = {}
        self.failures: dict[str, tuple[int, str]] = {}  # phase -> (round, description)
        elapsed = 0.0
        if resume_from is None:
            for name in (METRICS_LOG, TIMINGS_LOG):
                (self.directory / name).write_text("")
        else:
            elapsed = self._restore(resume_from)
        self.started = time.perf_counter() - elapsed
        _write_atomic(self.directory / "config.json", json.dumps(config, indent=2, sort_keys=True))

    # ------------------------------------------------------------------ resume
    def _restore(self, checkpoint: Checkpoint) -> float:
        """Keep the rows and per-client results the checkpoint counted; returns the elapsed
        seconds of the run it continues."""
        position = checkpoint.results
        remove_stale_temporaries(self.directory)
        self.rows = _read_rows(self.directory / METRICS_LOG, int(position["metric_rows"]))
        self.timings = _read_rows(self.directory / TIMINGS_LOG, int(position["timing_rows"]))
        for name, rows in ((METRICS_LOG, self.rows), (TIMINGS_LOG, self.timings)):
            _write_atomic(self.directory / name, "".join(_line(r) for r in rows))
        self.clients = {int(row["partition_id"]): row for row in position["clients"]}
        self._write_clients()  # as of the checkpoint, not of rounds a killed run did after it
        return float(position.get("elapsed_seconds", 0.0))

    def position(self) -> dict[str, Any]:
        """What a checkpoint records of the results: how many rows precede it, each client's
        latest evaluation and the run's elapsed time."""
        return {
            "metric_rows": len(self.rows),
            "timing_rows": len(self.timings),
            "clients": [self.clients[k] for k in sorted(self.clients)],
            "elapsed_seconds": time.perf_counter() - self.started,
        }

    # ------------------------------------------------------------------ during the run
    # The strategy calls this after every aggregation (see PFLStrategy.on_round).
    def on_round(self, server_round: int, phase: str, metrics: dict[str, float], clients: dict[int, dict[str, Scalar]]) -> None:
        elapsed = time.perf_counter() - self.started
        key = {"round": server_round, "phase": phase}
        values = _plain(metrics)
        row = key | {k: v for k, v in values.items() if not is_timing(k)}
        timing = key | {"elapsed_seconds": elapsed} | {k: v for k, v in values.items() if is_timing(k)}
        self.rows.append(row)
        self.timings.append(timing)
        _append(self.directory / METRICS_LOG, row)
        _append(self.directory / TIMINGS_LOG, timing)
        if phase == "evaluate":
            for pid, values in clients.items():
                self.clients[pid] = {"partition_id": pid, "round": server_round, **_plain(values)}
            self._write_clients()

    def record_failures(self, server_round: int, phase: str, failures: Sequence[Any], asked: int) -> None:
        """Remember the latest failures of a phase, for the summary (``asked``: clients sent
        an instruction)."""
        if failures:
            self.failures[phase] = (server_round, f"{len(failures)} of {asked} failed: {describe_failures(failures)}")

    def end_round(self, server_round: int) -> None:
        """Called once a round (fit and evaluation) is over: write the checkpoint when due."""
        due = server_round % self.checkpoint_interval == 0 or server_round == self.last_round
        if self.state_fn is not None and due:
            for name in (METRICS_LOG, TIMINGS_LOG):  # the rows a checkpoint counts reach the disk first
                _sync(self.directory / name)
            write_checkpoint(self.directory, server_round, self.config, self.position(), self.state_fn())

    def _write_clients(self) -> None:
        rows = [self.clients[k] for k in sorted(self.clients)]
        _write_atomic(self.directory / "clients.json", json.dumps(rows, indent=1))
        _write_atomic(self.directory / "clients.csv", _csv_text(rows))

    # ------------------------------------------------------------------ end of run
    def export(self) -> None:
        """Write the collected rows as ``metrics.json``/``.csv`` and ``timings.json``/``.csv``."""
        for name, rows in (("metrics", self.rows), ("timings", self.timings)):
            _write_atomic(self.directory / f"{name}.json", json.dumps(rows, indent=1))
            _write_atomic(self.directory / f"{name}.csv", _csv_text(rows))

    def evaluation_rows(self) -> list[dict[str, Any]]:
        """The rows of evaluation rounds in which at least one client's evaluation counted."""
        return [r for r in self.rows if r["phase"] == "evaluate" and r.get("num_clients")]

    def finish(self, stopped: str | None = None) -> str:
        """Export the rows, write the plots and return (and print) the one-screen summary;
        ``stopped``: the error that ended the run early, named in the summary."""
        from flwr_pfl.app.plots import plot_domains, plot_learning_curves

        self.export()
        rows = self.evaluation_rows()
        if rows:
            plot_learning_curves(rows, self.directory / "learning_curves.png", title=self._title())
            if any(k.startswith("acc_d") for k in rows[-1]):
                plot_domains(rows, self.directory / "domains.png", title=self._title())
        summary = self.summary()
        if stopped is not None:
            done = max((r["round"] for r in self.rows), default=0)
            summary += f"\nthe run stopped after {done} round(s) on an error: {stopped}"
        _write_atomic(self.directory / "summary.txt", summary + "\n")
        print(summary, flush=True)
        return summary

    def _title(self) -> str:
        return f"{self.config.get('algorithm')} on {self.config.get('dataset')}"

    def summary(self) -> str:
        rows = self.evaluation_rows()
        lines = [f"flwr_pfl run: {self._title()}", f"results: {self.directory}"]
        if not rows:
            return "\n".join(lines + [self._why_no_evaluation()])
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

    def _why_no_evaluation(self) -> str:
        """The summary's line when no evaluation counted: what the rounds did instead."""
        rounds = sorted({r["round"] for r in self.rows})
        if not rounds:
            return "no evaluation round completed: no round ran"
        evaluated = [r for r in self.rows if r["phase"] == "evaluate"]
        if not evaluated:
            line = (f"no evaluation round completed: rounds {rounds[0]}-{rounds[-1]} ran without evaluation "
                    "(fraction-evaluate = 0, or the algorithm evaluates later)")
        else:
            line = (f"no evaluation round completed: in each of the {len(evaluated)} evaluation rounds every "
                    "client's evaluation failed or was rejected")
        for phase in ("fit", "evaluate"):
            if phase in self.failures:
                server_round, text = self.failures[phase]
                line += f"\n{phase} failures (round {server_round}): {text}"
        return line


def is_timing(key: str) -> bool:
    """Whether a metric is a wall-clock figure (``train_seconds``, ``aggregate_seconds_mean``...)."""
    return "seconds" in key.split("_")


def has_results(directory: Path) -> bool:
    """Whether ``directory`` already holds a run's results (see ``RESULT_FILES``)."""
    return any((Path(directory) / name).exists() for name in RESULT_FILES)


def refuse_existing(directory: Path) -> None:
    """ConfigError when ``directory`` already holds a run, so that it is not overwritten."""
    if has_results(directory):
        raise ConfigError(
            f"run-name={directory.name!r}: {directory} already holds a run's results; set resume=true to "
            "continue it, choose another run-name, or remove that directory"
        )


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


def _line(row: dict[str, Any]) -> str:
    return json.dumps(row) + "\n"


def _append(path: Path, row: dict[str, Any]) -> None:
    """One JSON line at the end of ``path``, flushed to the OS (survives the process)."""
    with path.open("a") as f:
        f.write(_line(row))


def _sync(path: Path) -> None:
    """Flush ``path``'s data to the disk (fsync)."""
    with path.open("ab") as f:
        os.fsync(f.fileno())


def _read_rows(path: Path, count: int) -> list[dict[str, Any]]:
    """The first ``count`` rows of a JSON-lines file (a killed run may have left more, or a
    cut last line)."""
    rows: list[dict[str, Any]] = []
    if count:
        try:
            with path.open() as f:
                for line in f:
                    if len(rows) == count:
                        break
                    rows.append(json.loads(line))
        except (OSError, ValueError) as err:
            raise ConfigError(f"cannot resume: {path} cannot be read ({err}); its first {count} rows are needed") from None
    if len(rows) < count:
        raise ConfigError(f"cannot resume: {path} has {len(rows)} rows, the checkpoint counts {count}")
    return rows


def _csv_text(rows: list[dict[str, Any]]) -> str:
    columns: list[str] = []
    seen: set[str] = set()
    for row in rows:
        for k in row:
            if k not in seen:
                seen.add(k)
                columns.append(k)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\r\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory, so that a
    reader (or a kill) never sees a half-written file."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with temp.open("w", newline="") as f:
            f.write(text)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
