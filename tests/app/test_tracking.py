"""Experiment tracking: what a run records reaches TensorBoard and MLflow as the results writer
recorded it (read back with each tool's own reader), bad or missing backends are refused before
training, and the progress line gives the round and an ETA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flwr_pfl.app import tracking
from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.app.tracking import Progress, parse_tracking
from flwr_pfl.errors import ConfigError


def test_backends_are_parsed_and_checked():
    assert parse_tracking("") == ()
    assert parse_tracking(" tensorboard, mlflow ,tensorboard") == ("tensorboard", "mlflow")
    with pytest.raises(ConfigError, match=r"tracking='wandb': unknown backend\(s\) wandb; allowed: tensorboard, mlflow"):
        parse_tracking("wandb")
    with pytest.raises(ConfigError, match="unknown backend"):
        parse_experiment({"tracking": "tensorbored"})


def test_a_backend_that_is_not_installed_is_refused_naming_the_extra(monkeypatch):
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"tracking='mlflow' needs the package 'mlflow', .*flwr_pfl\[tracking\]"):
        parse_tracking("mlflow")
    assert parse_tracking("mlflow", check_installed=False) == ("mlflow",)  # the clients' hosts never need it


def test_the_progress_line_gives_the_round_the_metric_and_the_time_left(monkeypatch):
    clock = iter([100.0, 130.0])
    monkeypatch.setattr(tracking.time, "perf_counter", lambda: next(clock))
    progress = Progress(total_rounds=500, first_round=201)  # a resumed run: 200 rounds done before
    line = progress.line(203, {"accuracy_wmean": 0.71234, "loss_wmean": 0.9})
    assert line == "round 203/500: accuracy_wmean 0.7123; 10.0 s/round, ETA 49m30s"


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, blobs_dataset) -> Path:
    out = tmp_path_factory.mktemp("tracked")
    config = {"dataset": blobs_dataset, "model": "mlp", "num-clients": 3, "num-server-rounds": 2, "learning-rate": 0.1,
              "partitioner": "iid", "test-fraction": 0.25, "output-dir": str(out), "run-name": "run",
              "tracking": "tensorboard,mlflow"}
    run_inprocess(server_app, client_app, 3, config)
    return out / "run"


def rows_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_holds_every_recorded_metric_the_clients_spread_the_config_and_the_plots(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tracked_run / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0}).Reload()
    rows = rows_of(tracked_run)
    evaluate = [r for r in rows if r["phase"] == "evaluate"]
    scalars = {e.step: e.value for e in events.Scalars("evaluate/accuracy_wmean")}
    assert scalars == pytest.approx({r["round"]: r["accuracy_wmean"] for r in evaluate}, rel=1e-6)
    fit_loss = {e.step: e.value for e in events.Scalars("fit/train_loss_wmean")}
    assert fit_loss == pytest.approx({r["round"]: r["train_loss_wmean"] for r in rows if r["phase"] == "fit"}, rel=1e-6)
    assert any(tag.startswith("timing/fit/") for tag in events.Tags()["scalars"])
    histogram = events.Histograms("clients/evaluate/accuracy")[-1]
    clients = json.loads((tracked_run / "clients.json").read_text())
    assert histogram.step == 2 and histogram.histogram_value.num == len(clients) == 3
    assert histogram.histogram_value.min == pytest.approx(min(c["accuracy"] for c in clients))
    assert "plots/learning_curves" in events.Tags()["images"]
    assert "config/text_summary" in events.Tags()["tensors"]


def test_mlflow_holds_the_config_the_metrics_per_round_and_per_client_and_the_plots(tracked_run):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tracked_run / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("flwr_pfl")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["status"] == "completed"
    assert run.data.params["algorithm"] == "fedavg" and run.data.params["num-server-rounds"] == "2"
    history = client.get_metric_history(run.info.run_id, "evaluate.accuracy_wmean")
    evaluate = [r for r in rows_of(tracked_run) if r["phase"] == "evaluate"]
    assert {m.step: m.value for m in history} == pytest.approx({r["round"]: r["accuracy_wmean"] for r in evaluate})
    clients = json.loads((tracked_run / "clients.json").read_text())
    for c in clients:
        latest = client.get_metric_history(run.info.run_id, f"clients.evaluate.accuracy.p{c['partition_id']}")[-1]
        assert latest.step == 2 and latest.value == pytest.approx(c["accuracy"])
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "plots")]
    assert artifacts == ["plots/learning_curves.png"]


def test_a_run_refused_before_training_opens_no_tracker(tmp_path, blobs_dataset):
    config = {"dataset": blobs_dataset, "model": "mlp", "num-clients": 3, "num-server-rounds": 2,
              "output-dir": str(tmp_path), "run-name": "run", "tracking": "tensorboard", "algorithm": "fedora",
              "dp-noise-multiplier": 1.0}
    with pytest.raises(Exception, match="client-level DP"):
        run_inprocess(server_app, client_app, 3, config)
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_compare_tracks_every_run_with_its_own_event_files(tmp_path, blobs_dataset):
    from flwr_pfl.app import compare

    compare.main(["-c", f"dataset='{blobs_dataset}' model='mlp' num-clients=3 num-server-rounds=1 partitioner='iid'",
                  "--algorithms", "fedavg", "fedrep", "--out", str(tmp_path), "--tracking", "tensorboard"])
    for algorithm in ("fedavg", "fedrep"):
        assert list((tmp_path / "runs" / f"{algorithm}-s0" / "tensorboard").glob("events.out.tfevents.*"))
