"""Experiment tracking: what a run records reaches TensorBoard, MLflow and Weights & Biases as the
results writer recorded it (read back with each tool's own reader; W&B's offline transaction log
with its own protobuf records), bad or missing backends are refused before
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
    assert parse_tracking("wandb,mlflow") == ("wandb", "mlflow")
    with pytest.raises(ConfigError, match=r"tracking='visdom': unknown backend\(s\) visdom; allowed: tensorboard, mlflow, wandb"):
        parse_tracking("visdom")
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
              "tracking": "tensorboard,mlflow,wandb"}
    with pytest.MonkeyPatch.context() as env:
        env.delenv("WANDB_API_KEY", raising=False)  # no account here: W&B records offline
        env.delenv("WANDB_MODE", raising=False)
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


def wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (``run-<id>.wandb``): a 7-byte header, then LevelDB's
    log format (32 KiB blocks; each piece: checksum, little-endian length, type), each record a
    ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    block, header = 32768, 7
    records, pos, pending = [], 7, b""
    while pos + header <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if left < header or (length == 0 and kind == 0):  # the block's tail is padding
            pos += left
            continue
        pending += data[pos + header:pos + header + length]
        pos += header + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def items(update) -> dict[str, object]:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in update}


def test_wandb_offline_holds_the_config_every_round_the_clients_spread_the_plots_and_the_status(tracked_run):
    (log,) = (tracked_run / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(log)
    config: dict[str, object] = {}
    for record in records:
        if record.WhichOneof("record_type") == "config":
            config |= items(record.config.update)
    assert config["algorithm"] == "fedavg" and config["num-server-rounds"] == 2
    history = [items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    evaluate = [r for r in rows_of(tracked_run) if r["phase"] == "evaluate"]
    logged = {h["_step"]: h["evaluate/accuracy_wmean"] for h in history if "evaluate/accuracy_wmean" in h}
    assert logged == pytest.approx({r["round"]: r["accuracy_wmean"] for r in evaluate})
    fit = {h["_step"]: h["fit/train_loss_wmean"] for h in history if "fit/train_loss_wmean" in h}
    assert fit == pytest.approx({r["round"]: r["train_loss_wmean"] for r in rows_of(tracked_run) if r["phase"] == "fit"})
    last = next(h for h in reversed(history) if "clients/evaluate/accuracy/values" in h)
    clients = json.loads((tracked_run / "clients.json").read_text())
    assert last["_step"] == 2 and sum(last["clients/evaluate/accuracy/values"]) == len(clients) == 3
    bins = last["clients/evaluate/accuracy/bins"]
    assert bins[0] <= min(c["accuracy"] for c in clients) <= max(c["accuracy"] for c in clients) <= bins[-1]
    assert any(h.get("plots/learning_curves/_type") == "image-file" for h in history)
    summary: dict[str, object] = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            summary |= items(record.summary.update)
    assert summary["status"] == "completed"
    assert [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"] == [0]


@pytest.mark.parametrize("env,mode", [({}, "offline"), ({"WANDB_API_KEY": "k" * 40}, "online"),
                                      ({"WANDB_API_KEY": "k" * 40, "WANDB_MODE": "offline"}, "offline"),
                                      ({"WANDB_MODE": "disabled"}, "disabled")])
def test_wandb_goes_online_only_when_set_to(monkeypatch, tmp_path, env, mode):
    import wandb

    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    seen = {}
    monkeypatch.setattr(wandb, "init", lambda **kwargs: seen.update(kwargs))
    tracking.WandbTracker(tmp_path, "run-1")
    assert seen["mode"] == mode and seen["project"] == "flwr_pfl" and seen["name"] == "run-1"
    assert seen["dir"] == str(tmp_path.resolve()) and seen["reinit"] == "create_new"


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
