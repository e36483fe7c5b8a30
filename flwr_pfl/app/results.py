"""Every run's results as files in one directory (DESIGN principle 9).

Written as the run goes, at a cost per round that does not grow with the rounds done (so a
crash keeps what was done, and a long run does not slow down): ``config.json`` (the resolved
configuration), ``metrics.jsonl`` (one JSON line per round and phase, every aggregated metric,
appended), ``timings.jsonl`` (the same rows' wall-clock figures: every metric with ``seconds``
in its name), ``clients.json`` and ``clients.csv`` (each client's latest evaluation, and with
record-level DP the epsilon it has spent so far; one row per client) and ``checkpoint.npz`` (the server's state every ``checkpoint-interval`` rounds and
after the last, to resume; :mod:`flwr_pfl.app.checkpoint`). Timings are kept apart so that the
metrics are bit-identical across reruns of the same config and seed.

At the end (also when the run stops on an error): ``metrics.json``, ``metrics.csv``,
``timings.json`` and ``timings.csv`` (the appended rows as one JSON list and one CSV table),
then ``learning_curves.png`` (and ``domains.png`` where samples carry domains) and a one-screen
summary in ``summary.txt`` and on stdout.

A resumed run continues the same files: the rows up to the checkpoint's round are kept, rows a
killed run appended after its last checkpoint are dropped (those rounds run again).

A run that trained nothing must not look like a success. At the end the recorded rows are
judged (:func:`judge_run`): a round in which clients were asked to train and no reply was
accepted (:func:`rounds_without_training`), or a training that diverged and left the final
metrics at chance (:func:`divergence`), makes the run FAILED. ``summary.json`` records the
status (``completed`` or ``failed``) and why; the summary's first line says what happened and
quotes the clients' errors; the ServerApp then raises :class:`RunFailed`, so that ``flwr run``
reports ``finished:failed`` and the launcher and ``compare`` exit non-zero. The run key
``fail-on-no-training = false`` keeps such a run ``completed`` (the summary ends with a warning).
A run that trained in every round but lost more than a quarter of the training replies it asked
for (:func:`lost_training_replies`) stays completed with a warning in its summary and in
``summary.json``: its results stand for part of the federation only.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr_pfl.app.checkpoint import Checkpoint, remove_stale_temporaries, write_checkpoint
from flwr_pfl.app.tracking import Progress, Tracker
from flwr_pfl.app.traffic import merge as merge_traffic
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.base import EVALUATION_PHASES, accepted_replies, lost_replies
from flwr_pfl.strategies.validation import describe_failures

Scalar = bool | bytes | float | int | str

#: a client's fit metrics kept in ``clients.json`` beside its latest evaluation: the privacy it
#: has spent (record-level DP), which differs from client to client
CLIENT_PRIVACY_KEYS = ("dp_record_epsilon", "dp_record_delta", "dp_record_steps")
METRICS_LOG = "metrics.jsonl"
TIMINGS_LOG = "timings.jsonl"
#: the run's status and why, written with ``summary.txt`` at the end (:meth:`ResultsWriter.finish`)
STATUS_FILE = "summary.json"
#: the bytes each round sent and received, per node and message kind (:mod:`flwr_pfl.app.traffic`)
TRAFFIC_FILE = "traffic.json"
#: files whose presence means a directory already holds a run's results
RESULT_FILES = ("config.json", METRICS_LOG, "metrics.json", "checkpoint.npz", "summary.txt", STATUS_FILE)

#: the values of ``status`` in ``summary.json``
COMPLETED, FAILED = "completed", "failed"
#: a final weighted accuracy at most this far above chance (1 / classes) counts as at chance
CHANCE_MARGIN = 0.05
#: a loss above this has exploded (a cross-entropy at chance is ln(classes), 2.3 for 10 classes)
EXPLODED_LOSS = 1e6


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
        fail_on_no_training: whether a run that trained nothing (:func:`judge_run`) ends with
            status ``failed`` (run key ``fail-on-no-training``); False records it as
            ``completed`` with a warning.
        num_classes: the classes of the task, for the chance level of :func:`divergence`
            (None: unknown, or not a classification).
        checkpoint_key: signs every checkpoint (:func:`~flwr_pfl.app.checkpoint.write_checkpoint`).
        progress: logs a line with the round, its headline metric and an ETA as each round ends.
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
        fail_on_no_training: bool = True,
        num_classes: int | None = None,
        checkpoint_key: bytes | None = None,
        progress: Progress | None = None,
    ) -> None:
        if checkpoint_interval < 1:
            raise ValueError(f"checkpoint_interval must be >= 1, got {checkpoint_interval}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.state_fn = state_fn
        self.checkpoint_interval = checkpoint_interval
        self.checkpoint_key = checkpoint_key
        self.last_round = last_round
        self.rows: list[dict[str, Any]] = []
        self.timings: list[dict[str, Any]] = []
        self.clients: dict[int, dict[str, Any]] = {}
        self.failures: dict[str, tuple[int, str]] = {}  # phase -> (round, description)
        # (round, phase) -> description, for phases in which no reply was accepted (quoted when
        # the run is judged to have trained nothing)
        self.unanswered: dict[tuple[int, str], str] = {}
        self.fail_on_no_training = fail_on_no_training
        self.num_classes = num_classes
        self.status: str | None = None  # set by finish(): COMPLETED or FAILED
        self.verdict: Verdict | None = None
        elapsed = 0.0
        if resume_from is None:
            for name in (METRICS_LOG, TIMINGS_LOG):
                (self.directory / name).write_text("")
        else:
            elapsed = self._restore(resume_from)
        self.started = time.perf_counter() - elapsed
        _write_atomic(self.directory / "config.json", json.dumps(config, indent=2, sort_keys=True))
        self.progress = progress
        #: experiment-tracking backends (:meth:`track`)
        self.trackers: list[Tracker] = []
        #: this process's traffic rows (:mod:`flwr_pfl.app.traffic`), written as ``traffic.json`` by
        #: :meth:`finish` after those of the rounds a resumed run kept
        self.traffic_fn: Callable[[], list[dict[str, Any]]] | None = None
        self.resumed_rounds = resume_from.rounds_done if resume_from is not None else 0

    def track(self, trackers: Sequence[Tracker]) -> None:
        """Send the config, then every row recorded from now on with its per-client values, and
        at the end the plots and the status, to ``trackers`` (:mod:`flwr_pfl.app.tracking`).
        Attached once the run is set up, so that a run refused before training opens none."""
        self.trackers = list(trackers)
        for tracker in self.trackers:
            tracker.log_config(self.config)

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
        for tracker in self.trackers:
            tracker.log_round(server_round, phase, values, clients)
        if phase == "fit":
            spent = {pid: {k: values[k] for k in CLIENT_PRIVACY_KEYS if k in values} for pid, values in clients.items()}
            for pid, keys in spent.items():
                if keys:
                    self.clients[pid] = {"partition_id": pid, **self.clients.get(pid, {}), **_plain(keys)}
            if any(spent.values()):
                self._write_clients()
        if phase == "evaluate":
            for pid, values in clients.items():
                kept = {k: v for k, v in self.clients.get(pid, {}).items() if k in CLIENT_PRIVACY_KEYS}
                self.clients[pid] = {"partition_id": pid, "round": server_round, **_plain(values), **kept}
            self._write_clients()

    def record_failures(self, server_round: int, phase: str, failures: Sequence[Any], asked: int) -> None:
        """Remember the latest failures of a phase, and those of a training phase that
        accepted no reply, for the summary (``asked``: clients sent an instruction). Called
        after the phase's row is recorded."""
        if failures:
            text = f"{len(failures)} of {asked} failed: {describe_failures(failures)}"
            self.failures[phase] = (server_round, text)
            rows = []  # this round's rows of the phase: at the end (a scan that does not grow with the rounds)
            for row in reversed(self.rows):
                if row["round"] != server_round:
                    break
                if row["phase"] == phase:
                    rows.append(row)
            if phase not in EVALUATION_PHASES and not any(accepted_replies(r) for r in rows):
                self.unanswered[(server_round, phase)] = text

    def end_round(self, server_round: int) -> None:
        """Called once a round (fit and evaluation) is over: write the checkpoint when due."""
        if self.progress is not None:
            latest = next((r for r in reversed(self.rows) if r["round"] == server_round and r["phase"] == "evaluate"), {})
            logging.getLogger("flwr").info("%s", self.progress.line(server_round, latest))
        due = server_round % self.checkpoint_interval == 0 or server_round == self.last_round
        if self.state_fn is not None and due:
            for name in (METRICS_LOG, TIMINGS_LOG):  # the rows a checkpoint counts reach the disk first
                _sync(self.directory / name)
            write_checkpoint(self.directory, server_round, self.config, self.position(), self.state_fn(),
                             key=self.checkpoint_key)

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
        """Export the rows, write the plots, judge the run (:func:`judge_run`), write
        ``summary.json`` and return (and print) the one-screen summary, whose first line says
        why a failed run failed; ``stopped``: the error that ended the run early."""
        self.export()
        rows = self.evaluation_rows()
        if rows:
            self._plot(rows)
        self.verdict = verdict = judge_run(self.rows, self.num_classes)
        problems = self._problems(verdict)
        if stopped is not None:
            done = max((r["round"] for r in self.rows), default=0)
            problems.insert(0, f"the run stopped after {done} round(s) on an error: {stopped}")
        failed = stopped is not None or (verdict.trained_nothing and self.fail_on_no_training)
        self.status = FAILED if failed else COMPLETED
        summary = self.summary()
        if failed:
            summary = f"FAILED: {'; '.join(problems)}\n{summary}"
        elif problems:
            summary += (f"\nwarning: {'; '.join(problems)} (fail-on-no-training = false: the run counts as "
                        "completed)")
        lost = lost_training_replies(self.rows)
        if lost is not None:
            summary += f"\nwarning: {lost}"
        self._write_traffic()  # its own file: a resume's second start-up differs, the summary must not
        status = {
            "status": self.status,
            "problems": problems,
            "stopped": stopped,
            "rounds_without_training": list(verdict.rounds_without_training),
            "divergence": verdict.divergence,
            "fail_on_no_training": self.fail_on_no_training,
            "lost_training_replies": lost,
        }
        _write_atomic(self.directory / STATUS_FILE, json.dumps(status, indent=1))
        _write_atomic(self.directory / "summary.txt", summary + "\n")
        self.close_trackers()
        print(summary, flush=True)
        return summary

    def _write_traffic(self) -> None:
        """Write ``traffic.json`` (the rows a resumed run kept, of its rounds done, then this
        process's; each process's start-up exchanges add up in round 0), when there is a source."""
        if self.traffic_fn is None:
            return
        rows = self.traffic_fn()
        path = self.directory / TRAFFIC_FILE
        if self.resumed_rounds and path.exists():
            kept = [r for r in json.loads(path.read_text()) if r["round"] <= self.resumed_rounds]
            rows = merge_traffic(kept, [r for r in rows if r["round"] == 0 or r["round"] > self.resumed_rounds])
        _write_atomic(path, json.dumps(rows, indent=1))

    def _plot(self, rows: list[dict[str, Any]]) -> None:
        """``learning_curves.png`` (and ``domains.png``); skipped with a warning where matplotlib
        is not installed (a lean server install: the numbers are all in the other files)."""
        try:
            from flwr_pfl.app.plots import plot_domains, plot_learning_curves
        except ModuleNotFoundError as err:
            logging.getLogger("flwr").warning("no plots for this run: %s", err)
            return
        plot_learning_curves(rows, self.directory / "learning_curves.png", title=self._title())
        if any(k.startswith("acc_d") for k in rows[-1]):
            plot_domains(rows, self.directory / "domains.png", title=self._title())

    def close_trackers(self) -> None:
        """Send the plots and the status to the trackers and close them; a tracker that fails
        here is logged, not raised: the run's own results are written already."""
        plots = [p for p in (self.directory / "learning_curves.png", self.directory / "domains.png") if p.exists()]
        for tracker in self.trackers:
            try:
                tracker.log_images(plots)
                tracker.close(self.status or "interrupted")
            except Exception as err:  # noqa: BLE001 - a tracking backend must not lose the run
                logging.getLogger("flwr").warning("experiment tracking: %s failed at the end of the run: %r",
                                                  type(tracker).__name__, err)
        self.trackers = []

    def _problems(self, verdict: Verdict) -> list[str]:
        """The verdict's findings in words, quoting the clients' errors recorded for the rounds
        that trained nothing (else the latest recorded ones)."""
        problems = []
        untrained = verdict.rounds_without_training
        if untrained:
            last = max((r["round"] for r in self.rows), default=0)
            text = (f"{rounds_text(untrained)} (of {last}) trained nothing: every client asked to train failed or "
                    "was rejected")
            quoted = [(k, v) for k, v in self.unanswered.items() if k[0] in untrained]
            if quoted:
                (server_round, phase), errors = max(quoted)
                text += f"; the clients' errors (round {server_round}, {phase}): {errors}"
            elif "fit" in self.failures:
                server_round, errors = self.failures["fit"]
                text += f"; the latest clients' errors (round {server_round}, fit): {errors}"
            else:
                text += "; the clients' errors are in the log"
            problems.append(text)
        if verdict.divergence:
            problems.append(verdict.divergence)
        return problems

    def raise_if_failed(self) -> None:
        """:class:`RunFailed` with the summary's reason when :meth:`finish` judged the run failed."""
        if self.status == FAILED:
            summary = (self.directory / "summary.txt").read_text()
            raise RunFailed(f"{summary.splitlines()[0]} (results: {self.directory})")

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


class RunFailed(RuntimeError):
    """A run that went to its end but trained nothing (:func:`judge_run`); raised by the
    ServerApp after its results are written, so that the engines report the run as failed."""


@dataclass(frozen=True)
class Verdict:
    """What the recorded rows say of a run: the rounds that trained nothing
    (:func:`rounds_without_training`) and a divergence that left the final metrics at chance
    (:func:`divergence`, None when there is none)."""

    rounds_without_training: tuple[int, ...] = ()
    divergence: str | None = None

    @property
    def trained_nothing(self) -> bool:
        """Whether the run should count as failed."""
        return bool(self.rounds_without_training) or self.divergence is not None


def judge_run(rows: Sequence[Mapping[str, Any]], num_classes: int | None = None) -> Verdict:
    """Judge a run from its metric rows (as ``metrics.json`` holds them)."""
    return Verdict(tuple(rounds_without_training(rows)), divergence(rows, num_classes))


def rounds_without_training(rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """The rounds in which clients were asked to train and no reply was accepted.

    A round's training phases are its rows other than :data:`EVALUATION_PHASES` (fit, and an
    algorithm's own exchanges such as FedDAR's head phase). A round counts when at least one of
    them lost a reply (``num_failures`` or ``num_dropped`` > 0: an error, a rejected reply, no
    reply in time) and none of them accepted one. A round that sampled nobody (pFedFDA's
    Bernoulli participation) or trained without the clients is not counted.
    """
    lost: dict[int, float] = {}
    accepted: dict[int, int] = {}
    for row in rows:
        if row["phase"] in EVALUATION_PHASES:
            continue
        server_round = int(row["round"])
        lost[server_round] = lost.get(server_round, 0.0) + lost_replies(row)
        accepted[server_round] = accepted.get(server_round, 0) + accepted_replies(row)
    return sorted(r for r in lost if lost[r] > 0 and accepted[r] == 0)


#: a run in which more than this share of the clients asked to train were dropped (an error, a
#: rejected reply, no reply in time) is flagged in its summary, even where every round trained
LOST_REPLIES_WARNING = 0.25


def lost_training_replies(rows: Sequence[Mapping[str, Any]], threshold: float = LOST_REPLIES_WARNING) -> str | None:
    """A warning in words when more than ``threshold`` of the training replies the run asked for
    were lost (``num_dropped`` over ``participants + num_dropped`` of its training rows), else
    None. A run whose rounds each kept a few replies trained, but on a fraction of the clients it
    says it trained: the summary must not read like a healthy run's."""
    asked = lost = 0.0
    for row in rows:
        if row["phase"] in EVALUATION_PHASES:
            continue
        dropped = float(row.get("num_dropped") or 0)
        asked += float(row.get("participants") or 0) + dropped
        lost += dropped
    if asked == 0 or lost / asked <= threshold:
        return None
    return (f"{int(lost)} of {int(asked)} training replies ({100 * lost / asked:.0f} %) were lost (an error, a rejected "
            "reply or no reply in time; see dropped_ids in metrics.jsonl and the log): the results stand for part of "
            "the federation only")


def divergence(rows: Sequence[Mapping[str, Any]], num_classes: int | None = None, margin: float = CHANCE_MARGIN) -> str | None:
    """Why the training diverged and left the final metrics at chance, or None.

    Diverged: a recorded loss (any metric with ``loss`` among the words of its name: training,
    evaluation, head-phase losses and their statistics) was non-finite (written as null, or
    counted in ``<loss>_n_nonfinite``) or above :data:`EXPLODED_LOSS`. At chance: the last
    evaluation's weighted accuracy is at most ``1 / num_classes + margin``; where that cannot
    be judged (no accuracy, ``num_classes`` unknown), its weighted loss is itself non-finite or
    exploded, or no evaluation counted at all. A run that diverged and recovered is not
    reported.
    """
    evidence = _loss_blowup(rows)
    if evidence is None:
        return None
    evaluations = [r for r in rows if r["phase"] == "evaluate" and r.get("num_clients")]
    if not evaluations:
        return f"training diverged ({evidence}) and no evaluation counted"
    final = evaluations[-1]
    accuracy = final.get("accuracy_wmean")
    if num_classes and isinstance(accuracy, (int, float)):
        chance = 1.0 / num_classes
        if accuracy > chance + margin:
            return None
        return (f"training diverged ({evidence}) and the final weighted accuracy {accuracy:.4f} (round "
                f"{final['round']}) is not above chance {chance:.4f} + {margin}")
    loss = final.get("loss_wmean")
    if isinstance(loss, (int, float)) and loss <= EXPLODED_LOSS:
        return None
    shown = "non-finite" if loss is None else f"{loss:.4g}"
    return f"training diverged ({evidence}) and the final weighted loss is {shown} (round {final['round']})"


def _loss_blowup(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """The first recorded loss that is non-finite or exploded, in words, or None."""
    for row in rows:
        for key, value in row.items():
            words = key.split("_")
            if "loss" not in words or is_timing(key):
                continue
            where = f"round {row['round']}, {row['phase']}"
            if key.endswith("_n_nonfinite"):
                if value:
                    return f"{where}: {int(value)} client(s) with a non-finite {key[: -len('_n_nonfinite')]}"
            elif value is None:
                return f"{where}: {key} non-finite"
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and value > EXPLODED_LOSS:
                return f"{where}: {key} = {value:.4g}"
    return None


def rounds_text(rounds: Sequence[int]) -> str:
    """``round 3`` or ``rounds 2-4, 7``: consecutive rounds as ranges."""
    spans: list[list[int]] = []
    for r in rounds:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"round{'s' if len(rounds) > 1 else ''} {text}"


def read_status(directory: Path) -> dict[str, Any] | None:
    """A run directory's ``summary.json`` (its status and why), or None when it has none (a
    run still going, killed, or written before the file existed)."""
    try:
        status = json.loads((Path(directory) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None


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
