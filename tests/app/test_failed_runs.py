"""A run that trained nothing does not look like a success: its results record status failed,
its summary's first line says why and quotes the clients' errors, the ServerApp raises (so the
engines, the launcher and ``compare`` report a failure), and ``fail-on-no-training = false``
keeps it completed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flwr_pfl.app import compare as compare_module
from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.results import (
    CHANCE_MARGIN,
    EXPLODED_LOSS,
    RunFailed,
    divergence,
    judge_run,
    lost_training_replies,
    read_status,
    rounds_without_training,
)
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.clients import FedAvgClient
from flwr_pfl.errors import ConfigError, DivergedError

REPO_ROOT = Path(__file__).resolve().parents[2]


def config(tmp_path: Path, dataset: str, **overrides) -> dict:
    """The tiny preset's shape on the in-process test dataset: 3 clients, an MLP, iid."""
    base = {
        "dataset": dataset, "model": "mlp", "num-clients": 3, "num-server-rounds": 3, "learning-rate": 0.1,
        "partitioner": "iid", "test-fraction": 0.25, "output-dir": str(tmp_path), "run-name": "run",
    }
    return base | overrides


@pytest.fixture
def broken_from_round_2(monkeypatch) -> None:
    """Every client's fit raises from round 2 on (evaluation still works)."""
    real_fit = FedAvgClient.fit

    def fit(self, parameters, cfg):
        if int(cfg["server-round"]) >= 2:
            raise RuntimeError("disk full on this node")
        return real_fit(self, parameters, cfg)

    monkeypatch.setattr(FedAvgClient, "fit", fit)


# ------------------------------------------------------------------------------ the judgement
def fit_row(server_round: int, accepted: int, failures: int, **extra) -> dict:
    return {"round": server_round, "phase": "fit", "num_failures": float(failures), "participants": float(accepted),
            **({"num_clients": float(accepted)} if accepted else {}), **extra}


def eval_row(server_round: int, accuracy: float | None = None, loss: float | None = 0.5) -> dict:
    row = {"round": server_round, "phase": "evaluate", "num_failures": 0.0, "num_clients": 3.0, "loss_wmean": loss}
    return row | ({"accuracy_wmean": accuracy} if accuracy is not None else {})


def test_rounds_without_training_are_those_that_lost_every_reply():
    rows = [
        fit_row(1, 3, 0), eval_row(1),
        fit_row(2, 0, 3), eval_row(2),                       # every reply failed
        fit_row(3, 2, 1),                                    # one failed, two accepted: trained
        fit_row(4, 0, 0),                                    # nobody sampled: nothing lost
        {"round": 5, "phase": "head", "num_failures": 3.0},  # FedDAR's head phase lost all; no fit row
        {"round": 6, "phase": "head", "num_failures": 0.0, "num_clients": 3.0}, fit_row(6, 0, 3),  # head trained
        fit_row(7, 0, 0, num_dropped=2.0),                   # no reply in time
        {"round": 8, "phase": "evaluate", "num_failures": 3.0},  # evaluation alone does not train
    ]
    assert rounds_without_training(rows) == [2, 5, 7]
    assert rounds_without_training([fit_row(1, 3, 0), eval_row(1)]) == []


def test_a_run_that_lost_most_training_replies_is_flagged_though_every_round_trained():
    rows = [fit_row(r, accepted=1, failures=0, num_dropped=3.0) for r in (1, 2)] + [eval_row(2, 0.8)]
    assert rounds_without_training(rows) == []
    assert lost_training_replies(rows) == lost_training_replies(rows, 0.25)
    assert lost_training_replies(rows).startswith("6 of 8 training replies (75 %) were lost")
    healthy = [fit_row(r, accepted=3, failures=0, num_dropped=1.0 if r == 1 else 0.0) for r in (1, 2)] + [eval_row(2, 0.8)]
    assert lost_training_replies(healthy) is None  # 1 of 7 (14 %)
    assert lost_training_replies([eval_row(1, 0.8)]) is None


def test_divergence_needs_a_blown_up_loss_and_final_metrics_at_chance():
    chance = 1 / 10
    at_chance = chance + CHANCE_MARGIN           # not above chance by the margin
    above = chance + CHANCE_MARGIN + 0.01
    exploded = fit_row(1, 3, 0, train_loss_wmean=EXPLODED_LOSS * 10)
    nonfinite = fit_row(1, 3, 0, train_loss_wmean=None)  # a non-finite value is written as null
    some_nonfinite = fit_row(1, 3, 0, train_loss_wmean=0.4, train_loss_n_nonfinite=1.0)
    for evidence in (exploded, nonfinite, some_nonfinite):
        why = divergence([evidence, eval_row(1, accuracy=at_chance)], num_classes=10)
        assert why is not None and "training diverged (round 1, fit" in why and "not above chance 0.1000" in why
        assert divergence([evidence, eval_row(1, accuracy=above)], num_classes=10) is None  # it learned
    # at chance without a blow-up: a weak run, not a diverged one
    assert divergence([fit_row(1, 3, 0, train_loss_wmean=2.3), eval_row(1, accuracy=0.1)], num_classes=10) is None
    # recovered: the last evaluation counts
    rows = [exploded, eval_row(1, accuracy=0.1), fit_row(2, 3, 0, train_loss_wmean=0.3), eval_row(2, accuracy=0.8)]
    assert divergence(rows, num_classes=10) is None
    # classes unknown (or no accuracy): the final loss decides
    assert divergence([exploded, eval_row(1, accuracy=0.1, loss=0.9)], num_classes=None) is None
    assert "final weighted loss is 2e+07" in divergence([exploded, eval_row(1, loss=2e7)], num_classes=None)
    assert "final weighted loss is non-finite" in divergence([exploded, eval_row(1, loss=None)], num_classes=10)
    assert "no evaluation counted" in divergence([exploded], num_classes=10)
    # timings are not losses
    assert divergence([fit_row(1, 3, 0, loss_seconds=1e9), eval_row(1, accuracy=0.1)], num_classes=10) is None


def test_the_verdict_of_the_feddar_sa_default_run():
    """The rows FedDAR-SA recorded on the default experiment (3 rounds): a train loss of 2.7e28 in
    round 1, its head phase lost every reply in rounds 2 and 3 (so no fit row), accuracy 0.093."""
    rows = [
        {"round": 1, "phase": "head", "num_failures": 0.0, "num_clients": 10.0, "head_loss_wmean": 1.25},
        fit_row(1, 9, 1, train_loss_wmean=2.742e28), eval_row(1, accuracy=0.0934, loss=4.6e27),
        {"round": 2, "phase": "head", "num_failures": 10.0}, eval_row(2, accuracy=0.0934, loss=4.6e27),
        {"round": 3, "phase": "head", "num_failures": 10.0}, eval_row(3, accuracy=0.0934, loss=4.6e27),
    ]
    verdict = judge_run(rows, num_classes=10)
    assert verdict.rounds_without_training == (2, 3) and verdict.trained_nothing
    assert "train_loss_wmean = 2.742e+28" in verdict.divergence and "0.0934" in verdict.divergence


# ------------------------------------------------------------------------------ whole runs
def test_every_client_failing_from_round_2_fails_the_run(tmp_path, blobs_dataset, broken_from_round_2):
    cfg = config(tmp_path, blobs_dataset)
    with pytest.raises(RunFailed, match="rounds 2-3 \\(of 3\\) trained nothing"):
        run_inprocess(server_app, client_app, 3, cfg)
    out = tmp_path / "run"
    first = (out / "summary.txt").read_text().splitlines()[0]
    assert first.startswith("FAILED: rounds 2-3 (of 3) trained nothing")
    assert "the clients' errors (round 3, fit): 3 of 3 failed: RuntimeError: disk full on this node" in first
    status = read_status(out)
    assert status["status"] == "failed" and status["rounds_without_training"] == [2, 3] and status["stopped"] is None
    # the results are all there, as for any run
    for name in ("metrics.json", "metrics.csv", "clients.json", "learning_curves.png", "checkpoint.npz"):
        assert (out / name).exists(), name


def test_the_option_keeps_such_a_run_completed(tmp_path, blobs_dataset, broken_from_round_2):
    run_inprocess(server_app, client_app, 3, config(tmp_path, blobs_dataset, **{"fail-on-no-training": False}))
    out = tmp_path / "run"
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("flwr_pfl run: fedavg on test-blobs")  # as before the option existed
    assert summary[-2].startswith("warning: rounds 2-3 (of 3) trained nothing") and "fail-on-no-training = false" in summary[-2]
    assert summary[-1].startswith("warning: 6 of 9 training replies (67 %) were lost")
    assert read_status(out)["status"] == "completed"
    assert read_status(out)["lost_training_replies"] == summary[-1][len("warning: "):]


def test_a_healthy_run_completes(tmp_path, blobs_dataset):
    run_inprocess(server_app, client_app, 3, config(tmp_path, blobs_dataset))
    status = read_status(tmp_path / "run")
    assert status == {"status": "completed", "problems": [], "stopped": None, "rounds_without_training": [],
                      "divergence": None, "fail_on_no_training": True, "lost_training_replies": None}
    assert (tmp_path / "run" / "summary.txt").read_text().startswith("flwr_pfl run: fedavg on test-blobs")


def test_a_run_stopped_by_an_error_records_status_failed(tmp_path, blobs_dataset, monkeypatch):
    from flwr_pfl.strategies.base import PFLStrategy

    real = PFLStrategy.aggregate_fit

    def crash(self, server_round, results, failures):
        if server_round == 2:
            raise ValueError("the server ran out of memory")
        return real(self, server_round, results, failures)

    monkeypatch.setattr(PFLStrategy, "aggregate_fit", crash)
    with pytest.raises(ValueError):
        run_inprocess(server_app, client_app, 3, config(tmp_path, blobs_dataset))
    status = read_status(tmp_path / "run")
    assert status["status"] == "failed" and "out of memory" in status["stopped"]
    assert (tmp_path / "run" / "summary.txt").read_text().startswith(
        "FAILED: the run stopped after 1 round(s) on an error: ValueError: the server ran out of memory")


def test_a_blown_up_aggregate_ends_the_run_failed_and_is_never_sent(tmp_path, blobs_dataset, monkeypatch):
    """Every client sends 1e30s from round 2 on: no reply stands out (the screen compares replies
    with each other), but the aggregate's norm jumps a billionfold, so the run ends with
    DivergedError, recorded as failed, and the checkpoint keeps round 1's model."""
    real_fit = FedAvgClient.fit

    def fit(self, parameters, cfg):
        arrays, n, metrics = real_fit(self, parameters, cfg)
        return ([a * 1e30 for a in arrays] if int(cfg["server-round"]) >= 2 else arrays), n, metrics

    monkeypatch.setattr(FedAvgClient, "fit", fit)
    with pytest.raises(DivergedError, match="round 2: the aggregate of the accepted replies has norm"):
        run_inprocess(server_app, client_app, 3, config(tmp_path, blobs_dataset))
    status = read_status(tmp_path / "run")
    assert status["status"] == "failed" and "DivergedError" in status["stopped"]
    checkpoint = np.load(tmp_path / "run" / "checkpoint.npz")
    assert int(checkpoint["rounds_done"]) == 1
    assert max(float(np.abs(checkpoint[k]).max()) for k in checkpoint.files if k.startswith("global_")) < 1e3


def test_the_key_is_a_boolean(tmp_path):
    assert parse_experiment({}).run.fail_on_no_training is True
    with pytest.raises(ConfigError, match="fail-on-no-training='no' must be a boolean"):
        parse_experiment({"fail-on-no-training": "no"})


# ------------------------------------------------------------------------------ compare
def test_compare_reports_the_failed_run_and_exits_non_zero(tmp_path, blobs_dataset, broken_from_round_2):
    """The comparison goes on past a failed run, writes its files naming it, and exits 1."""
    base = config(tmp_path, blobs_dataset)
    del base["output-dir"], base["run-name"]
    compare_module.compare(base, ["fedavg", "local"], [0], tmp_path / "cmp")
    saved = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    # FedAvgClient.fit is patched; local's client trains on its own (its fit is not FedAvgClient.fit)
    assert list(saved["failed"]) == ["fedavg-s0"] and "trained nothing" in saved["failed"]["fedavg-s0"]
    assert "FAILED runs (1" in (tmp_path / "cmp" / "comparison.md").read_text()
    with pytest.raises(SystemExit) as stop:
        compare_module.main(["-c", _overrides(base), "--algorithms", "fedavg", "--out", str(tmp_path / "cmp2")])
    assert stop.value.code != 0 and "FAILED: 1 run(s) trained nothing" in str(stop.value.code)
    # with the option the same comparison exits 0
    compare_module.main(["-c", _overrides(base | {"fail-on-no-training": False}), "--algorithms", "fedavg",
                         "--out", str(tmp_path / "cmp3")])
    assert json.loads((tmp_path / "cmp3" / "comparison.json").read_text())["failed"] == {}


def _overrides(cfg: dict) -> str:
    return " ".join(f"{k}='{v}'" if isinstance(v, str) else f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                    for k, v in cfg.items())


def test_compare_reuses_a_failed_run_as_failed(tmp_path, blobs_dataset, broken_from_round_2, monkeypatch):
    base = config(tmp_path, blobs_dataset)
    del base["output-dir"], base["run-name"]
    compare_module.compare(base, ["fedavg"], [0], tmp_path, reuse=True)
    import flwr_pfl.app.inprocess as inprocess

    monkeypatch.setattr(inprocess, "run_inprocess", lambda *a, **k: pytest.fail("a finished run ran again"))
    compare_module.compare(base, ["fedavg"], [0], tmp_path, reuse=True)
    assert list(json.loads((tmp_path / "comparison.json").read_text())["failed"]) == ["fedavg-s0"]


# ------------------------------------------------------------------------------ flwr run
@pytest.mark.slow
def test_the_launcher_exits_non_zero_for_a_run_that_trained_nothing(tmp_path, data_dir):
    """Through the real `flwr run .`: a learning rate that makes every client's loss non-finite
    (each client then raises) in every round; `flwr run` exits 0, the launcher must not."""
    overrides = (f"dataset='fashion-mnist' data-dir='{data_dir}' max-samples=300 model='mlp' num-clients=2 "
                 f"num-server-rounds=2 output-dir='{tmp_path}' run-name='run' learning-rate=1e30")
    result = subprocess.run(
        [sys.executable, "-m", "flwr_pfl.app.launch", "--flwr-home", str(tmp_path / "flwr-home"), "--port", "39491",
         "-c", overrides],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "finished:failed" in result.stdout
    assert read_status(tmp_path / "run")["status"] == "failed"
    assert (tmp_path / "run" / "summary.txt").read_text().startswith("FAILED: ")
