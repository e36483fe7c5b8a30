"""Experiment tracking: a run's rounds, per-client figures, resolved config and final plots sent
to TensorBoard, MLflow or Weights & Biases, and a progress line with an ETA, all fed by the one results writer
(:class:`~flwr_pfl.app.results.ResultsWriter` calls the trackers where it records; nothing is
recorded twice).

Run key ``tracking``: a comma-separated list of ``tensorboard`` (event files under
``<run>/tensorboard``, read by ``tensorboard --logdir``), ``mlflow`` (a run in the MLflow
tracking store of ``MLFLOW_TRACKING_URI``, by default a local SQLite store ``<run>/mlflow.db``)
and ``wandb`` (a Weights & Biases run under ``<run>/wandb``, wandb >= 0.19.10: offline, for ``wandb sync``, unless
W&B is set to go online by ``WANDB_MODE`` or an ``WANDB_API_KEY``; project ``WANDB_PROJECT``,
default ``flwr_pfl``), "" for none. Each backend is an extra (``pip install "flwr_pfl[tracking]"``); asking for one
that is not installed is refused before training, naming the extra.

What each backend receives:

* the resolved configuration (TensorBoard: text ``config``; MLflow: parameters; W&B: the run's
  config);
* every aggregated metric of every round, as scalars ``<phase>/<metric>`` at step = round
  (wall-clock figures, those with ``seconds`` in their name, under ``timing/<phase>/...``);
* the per-client values of the round's numeric metrics (TensorBoard: a histogram
  ``clients/<phase>/<metric>``, W&B the same as a histogram; MLflow:
  ``clients.<phase>.<metric>.p<partition>``), so that the
  spread over clients, which personalized FL is about, is visible beside the mean;
* the final plots (``learning_curves.png``, ``domains.png``) as images / artifacts, and the
  run's status.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from flwr_pfl.errors import ConfigError

LOGGER = logging.getLogger("flwr")

#: tracking backends -> (the module it needs, the extra that installs it)
BACKENDS = {"tensorboard": ("tensorboard", "tracking"), "mlflow": ("mlflow", "tracking"), "wandb": ("wandb", "tracking")}


def parse_tracking(value: str, check_installed: bool = True) -> tuple[str, ...]:
    """The backends of a ``tracking`` value, checked (ConfigError: unknown, or, with
    ``check_installed``, not installed here: the ServerApp checks that on its host before
    training; a SuperNode never needs them)."""
    names = tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ConfigError(f"tracking={value!r}: unknown backend(s) {', '.join(unknown)}; allowed: "
                          f"{', '.join(BACKENDS)} (comma-separated), or \"\" for none")
    for name in names if check_installed else ():
        module, extra = BACKENDS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"tracking={name!r} needs the package {module!r}, which is not installed: "
                              f"pip install \"flwr_pfl[{extra}]\"")
    return names


class Tracker(Protocol):
    """What the results writer tells a tracking backend."""

    def log_config(self, config: Mapping[str, Any]) -> None: ...

    def log_round(self, server_round: int, phase: str, metrics: Mapping[str, float],
                  clients: Mapping[int, Mapping[str, Any]]) -> None: ...

    def log_images(self, paths: Sequence[Path]) -> None: ...

    def close(self, status: str) -> None: ...


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _tag(phase: str, key: str) -> str:
    return f"timing/{phase}/{key}" if "seconds" in key.split("_") else f"{phase}/{key}"


def _per_client(clients: Mapping[int, Mapping[str, Any]]) -> dict[str, dict[int, float]]:
    """metric -> partition -> value, for the numeric metrics clients report (ids excluded)."""
    out: dict[str, dict[int, float]] = {}
    for pid, values in clients.items():
        for key, value in values.items():
            if key != "partition_id" and _numeric(value):
                out.setdefault(key, {})[pid] = float(value)
    return out


class TensorBoardTracker:
    """Event files under ``<run>/tensorboard`` (``torch.utils.tensorboard``)."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log_config(self, config: Mapping[str, Any]) -> None:
        text = "\n".join(f"    {k} = {json.dumps(v)}" for k, v in sorted(config.items()))
        self.writer.add_text("config", text, 0)

    def log_round(self, server_round: int, phase: str, metrics: Mapping[str, float],
                  clients: Mapping[int, Mapping[str, Any]]) -> None:
        for key, value in metrics.items():
            if _numeric(value):
                self.writer.add_scalar(_tag(phase, key), float(value), server_round)
        import numpy as np

        for key, values in _per_client(clients).items():
            self.writer.add_histogram(f"clients/{phase}/{key}", np.array(list(values.values())), server_round)
        self.writer.flush()

    def log_images(self, paths: Sequence[Path]) -> None:
        from matplotlib.image import imread

        for path in paths:
            image = imread(path)  # H x W x C floats in [0, 1]
            self.writer.add_image(f"plots/{path.stem}", image[..., :3], 0, dataformats="HWC")

    def close(self, status: str) -> None:
        self.writer.add_text("status", status, 0)
        self.writer.close()


class MLflowTracker:
    """One MLflow run in the store of ``MLFLOW_TRACKING_URI``; without one, a local SQLite store
    ``<run>/mlflow.db`` with the artifacts under ``<run>/mlartifacts`` (MLflow 3 keeps its
    file store in maintenance mode and refuses it by default)."""

    EXPERIMENT = "flwr_pfl"

    def __init__(self, run_dir: Path, run_name: str) -> None:
        import mlflow

        self.mlflow = mlflow
        run_dir = Path(run_dir).resolve()
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
        client = mlflow.MlflowClient()
        experiment = client.get_experiment_by_name(self.EXPERIMENT)
        experiment_id = (experiment.experiment_id if experiment is not None else
                         client.create_experiment(self.EXPERIMENT, artifact_location=(run_dir / "mlartifacts").as_uri()))
        self.run = mlflow.start_run(experiment_id=experiment_id, run_name=run_name)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.mlflow.log_params({k: json.dumps(v) if not isinstance(v, str) else v for k, v in config.items()})

    def log_round(self, server_round: int, phase: str, metrics: Mapping[str, float],
                  clients: Mapping[int, Mapping[str, Any]]) -> None:
        values = {_tag(phase, k).replace("/", "."): float(v) for k, v in metrics.items() if _numeric(v)}
        for key, per in _per_client(clients).items():
            values |= {f"clients.{phase}.{key}.p{pid}": v for pid, v in per.items()}
        self.mlflow.log_metrics(values, step=server_round)

    def log_images(self, paths: Sequence[Path]) -> None:
        for path in paths:
            self.mlflow.log_artifact(str(path), artifact_path="plots")

    def close(self, status: str) -> None:
        self.mlflow.set_tag("status", status)
        self.mlflow.end_run(status="FINISHED" if status == "completed" else "FAILED")


class WandbTracker:
    """One Weights & Biases run, its files under ``<run>/wandb``.

    Offline unless W&B is set to go online: ``WANDB_MODE`` decides when set, else an API key in
    ``WANDB_API_KEY`` means online and its absence offline, so a run on a host without a network
    or an account records everything and never waits for a login prompt; ``wandb sync
    <run>/wandb/offline-run-*`` uploads it later. W&B's capture of the process's console is off
    (the ServerApp's log stays Flower's), and each run is a new W&B run (``compare`` runs many
    in one process)."""

    def __init__(self, run_dir: Path, run_name: str) -> None:
        import wandb

        self.wandb = wandb
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "flwr_pfl"), name=run_name,
                              dir=str(Path(run_dir).resolve()), mode=mode, reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True))
        LOGGER.info("W&B run %s (%s) under %s", run_name, mode, Path(run_dir) / "wandb")

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log_round(self, server_round: int, phase: str, metrics: Mapping[str, float],
                  clients: Mapping[int, Mapping[str, Any]]) -> None:
        values: dict[str, Any] = {_tag(phase, k): float(v) for k, v in metrics.items() if _numeric(v)}
        for key, per in _per_client(clients).items():
            values[f"clients/{phase}/{key}"] = self.wandb.Histogram(list(per.values()))
        self.run.log(values, step=server_round)

    def log_images(self, paths: Sequence[Path]) -> None:
        if paths:
            self.run.log({f"plots/{path.stem}": self.wandb.Image(str(path)) for path in paths})

    def close(self, status: str) -> None:
        self.run.summary["status"] = status
        self.run.finish(exit_code=0 if status == "completed" else 1)


def build_trackers(names: Sequence[str], run_dir: Path, run_name: str) -> list[Tracker]:
    """The trackers of ``names`` (from :func:`parse_tracking`) for one run."""
    build = {"tensorboard": lambda: TensorBoardTracker(run_dir), "mlflow": lambda: MLflowTracker(run_dir, run_name),
             "wandb": lambda: WandbTracker(run_dir, run_name)}
    return [build[name]() for name in names]


class Progress:
    """A log line per round: where the run is, its headline metric, the time per round and the
    time left (from the mean duration of the rounds this process ran)."""

    def __init__(self, total_rounds: int, first_round: int = 1) -> None:
        self.total = total_rounds
        self.first = first_round
        self.started = time.perf_counter()

    def line(self, server_round: int, metrics: Mapping[str, Any]) -> str:
        done = server_round - self.first + 1
        per_round = (time.perf_counter() - self.started) / max(done, 1)
        left = max(self.total - server_round, 0) * per_round
        headline = next((f"{k} {metrics[k]:.4f}" for k in ("accuracy_wmean", "mse_wmean", "loss_wmean")
                         if _numeric(metrics.get(k))), "no evaluation this round")
        return (f"round {server_round}/{self.total}: {headline}; {per_round:.1f} s/round, "
                f"ETA {_duration(left)}")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"
