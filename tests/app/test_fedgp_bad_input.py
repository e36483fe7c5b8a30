"""FedGP / FedDA on bad input: no target, two targets, a target without data, zero-norm updates,
bad replies and bad options. Each ends in a clear error or a defined, tested behaviour."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from torch.utils.data import TensorDataset

from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.inprocess import InProcessGrid, run_inprocess
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.app.results import RunFailed
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.clients import FedGPClient, LocalData
from flwr_pfl.errors import ConfigError
from flwr_pfl.models import build_model
from flwr_pfl.strategies import FedDA, FedGP
from flwr_pfl.training import TrainStats

N = 4


def cfg(tmp_path, dataset, algorithm="fedgp", name="run", **overrides):
    base = {
        "algorithm": algorithm, "dataset": dataset, "model": "mlp", "num-clients": N,
        "num-server-rounds": 3, "learning-rate": 0.1, "partitioner": "iid", "test-fraction": 0.25,
        "output-dir": str(tmp_path), "run-name": name, f"{algorithm}.warmup-rounds": 1,
        f"{algorithm}.target-batch-size": 8,
    }
    return base | {(k if "." in k else k.replace("_", "-")): v for k, v in overrides.items()}


def rows(tmp_path, name="run", phase="fit"):
    return [r for r in json.loads((tmp_path / name / "metrics.json").read_text()) if r["phase"] == phase]


def run_with_roles(tmp_path, dataset, roles: dict[int, str], **overrides):
    config = cfg(tmp_path, dataset, **overrides)
    grid = InProcessGrid(client_app, N, config)
    for node, context in grid.contexts.items():
        pid = int(context.node_config["partition-id"])
        if pid in roles:
            context.node_config["fedgp-role"] = roles[pid]
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config))
    return grid


def test_no_target_is_a_clear_error(tmp_path, blobs_dataset):
    with pytest.raises(ConfigError, match="none is the target"):
        run_with_roles(tmp_path, blobs_dataset, {3: "source"})


def test_two_targets_is_a_clear_error(tmp_path, blobs_dataset):
    with pytest.raises(ConfigError, match=r"2 clients claim the target role \(partitions \[1, 3\]\)"):
        run_with_roles(tmp_path, blobs_dataset, {1: "target"})


def test_node_config_can_choose_the_target(tmp_path, blobs_dataset):
    run_with_roles(tmp_path, blobs_dataset, {0: "target", 3: "source"})
    last = rows(tmp_path, phase="evaluate")[-1]
    clients = json.loads((tmp_path / "run" / "clients.json").read_text())
    target = [c for c in clients if c.get("is_target")]
    assert [c["partition_id"] for c in target] == [0]
    assert last["target_accuracy"] == pytest.approx(target[0]["accuracy"])


@pytest.mark.parametrize("strategy", [FedGP, FedDA])
def test_partial_participation_is_refused_when_the_strategy_is_built(strategy):
    with pytest.raises(ConfigError, match=r"fraction-fit=0.5 is not allowed .*needs the target.*allowed: fraction-fit=1.0"):
        strategy(num_clients=N, fraction_fit=0.5)


def test_partial_participation_stops_the_run_before_any_training(tmp_path, blobs_dataset):
    config = cfg(tmp_path, blobs_dataset, algorithm="fedda", **{"fraction-fit": 0.75})
    grid = InProcessGrid(client_app, N, config)
    with pytest.raises(ConfigError, match="fraction-fit=0.75 is not allowed for fedda"):
        server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config))
    # no client was sent or sent back any array (the only exchange: the federation's size,
    # which the app's node answers from its node config)
    assert grid.bytes_sent == 0 and grid.bytes_received == 0


def test_misspelt_target_role_stops_the_run_at_its_start_naming_the_node_and_the_allowed_roles(tmp_path, blobs_dataset):
    """The target node's role is misspelt: the run must not go on without it (target_missing in
    every round) but stop when the server asks the nodes for their settings, before any array
    is sent, naming the node and the allowed roles."""
    with pytest.raises(ConfigError, match=r"node 1003 \(partition 3\): node config fedgp-role='tagret' is not "
                       "allowed; use 'target' or 'source'"):
        run_with_roles(tmp_path, blobs_dataset, {3: "tagret"}, seed=1)
    assert not (tmp_path / "run").exists()


def test_more_target_samples_than_the_target_has_stops_the_run_naming_both_numbers(tmp_path, blobs_dataset):
    with pytest.raises(ConfigError, match="the target has never answered") as err:
        run_inprocess(server_app, client_app, N, cfg(tmp_path, blobs_dataset, seed=1, **{"fedgp.target-train-samples": 5000}))
    assert re.search(r"target-train-samples=5000 but the target \(partition 3\) has only \d+ training samples", str(err.value))


def test_the_server_s_target_answering_as_a_source_is_an_error(tmp_path, blobs_dataset):
    with pytest.raises(ConfigError, match=r"\(partition 2\) answered as a source but the server's target-partition=2"):
        run_with_roles(tmp_path, blobs_dataset, {2: "source"}, **{"fedgp.target-partition": 2})


def test_target_partition_outside_the_federation(tmp_path, blobs_dataset):
    with pytest.raises(ConfigError, match="target-partition=7 is outside the federation of num-clients=4"):
        run_inprocess(server_app, client_app, N, cfg(tmp_path, blobs_dataset, **{"fedgp.target-partition": 7}))


def _context(pid=3, num=N):
    return Context(run_id=1, node_id=1, node_config={"partition-id": pid, "num-partitions": num},
                   state=RecordDict(), run_config={})


def _data(n):
    ds = TensorDataset(torch.randn(n, 20), torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long))
    return LocalData(train=torch.utils.data.DataLoader(ds, batch_size=4), test=torch.utils.data.DataLoader(ds, batch_size=4))


def test_target_without_data_is_a_clear_error():
    model = build_model("mlp", (20,), 4)
    with pytest.raises(ConfigError, match="target-train-samples=50 but the target \\(partition 3\\) has only 10"):
        FedGPClient(_context(), model, _data(10), target_train_samples=50)
    # no training samples at all: the message every algorithm's client gives, target or source
    for pid in (3, 1):
        with pytest.raises(ConfigError, match=f"^partition {pid} has no training samples"):
            FedGPClient(_context(pid=pid), model, _data(0))


class _FailingTarget(FedGPClient):
    def fit(self, parameters, config):
        if self.is_target:
            raise RuntimeError("disk full")
        return super().fit(parameters, config)


def test_target_failing_every_round_leaves_the_global_model_unchanged(tmp_path, blobs_dataset, monkeypatch):
    """The target's fit fails every round: its error replies count as failures, the warm-up
    still averages the sources, and every FDA round keeps the global model (metric target_missing)."""
    monkeypatch.setitem(ALGORITHMS, "fedgp", dataclasses.replace(ALGORITHMS["fedgp"], client=_FailingTarget))
    run_inprocess(server_app, client_app, N, cfg(tmp_path, blobs_dataset))
    fits = rows(tmp_path)
    assert [r["num_failures"] for r in fits] == [1.0, 1.0, 1.0]
    assert [r.get("target_missing", 0.0) for r in fits] == [0.0, 1.0, 1.0]


class _FrozenTarget(FedGPClient):
    """The target takes 4 optimizer steps that change nothing: zero-norm target updates."""

    def train_groups(self, groups, epochs, **kwargs):
        if not self.is_target:
            return super().train_groups(groups, epochs, **kwargs)
        after = kwargs.get("after_step")
        for step in range(1, 5):
            if after is not None:
                after(self.model, step)
        return TrainStats(loss=0.0, num_examples=len(self.data.train.dataset), steps=4, seconds=0.0)


@pytest.mark.parametrize("auto", [False, True])
def test_zero_norm_target_update_keeps_the_aggregated_tensors(tmp_path, blobs_dataset, monkeypatch, auto):
    """FedGP with a zero target update: every cosine is 0, every source is filtered, and the
    update is (1 - beta) * 0 = 0 (auto: sigma^2 = 0 gives beta = 0). Defined, finite, unchanged."""
    monkeypatch.setitem(ALGORITHMS, "fedgp", dataclasses.replace(ALGORITHMS["fedgp"], client=_FrozenTarget))
    extra = {"fedgp.auto-weight": auto}
    run_inprocess(server_app, client_app, N, cfg(tmp_path, blobs_dataset, name="warm", num_server_rounds=1, **extra))
    run_inprocess(server_app, client_app, N, cfg(tmp_path, blobs_dataset, name="full", **extra))
    fda = [r for r in rows(tmp_path, "full") if r["fda_round"] > 0]
    assert all(r["filtered_frac_mean"] == 1.0 and r["update_norm_target"] == 0.0 for r in fda)
    if auto:
        assert all(r["beta_mean"] == 0.0 and r["sigma2"] == 0.0 for r in fda)
    a, b = np.load(tmp_path / "warm" / "checkpoint.npz"), np.load(tmp_path / "full" / "checkpoint.npz")
    for key in (k for k in a.files if k.startswith("global_")):
        np.testing.assert_allclose(a[key], b[key], rtol=0, atol=1e-8)  # float32 round-off at most


class _BadClient(FedGPClient):
    fault = "source-nan"

    def fit(self, parameters, config):
        arrays, n, metrics = super().fit(parameters, config)
        if self.fault == "source-nan" and self.partition_id == 0:
            arrays[0] = np.full_like(arrays[0], np.nan)
        if self.fault == "target-matrix" and self.is_target and len(arrays) > metrics["n_model_arrays"]:
            arrays[-1] = arrays[-1][:, :-1]  # one column short
        if self.fault == "source-no-steps" and self.partition_id == 0:
            metrics["num_steps"] = 0
        return arrays, n, metrics


@pytest.mark.parametrize("fault", ["source-nan", "target-matrix", "source-no-steps"])
def test_bad_replies_are_rejected_and_the_round_goes_on(tmp_path, blobs_dataset, monkeypatch, fault):
    client = type("Bad", (_BadClient,), {"fault": fault})
    monkeypatch.setitem(ALGORITHMS, "fedgp", dataclasses.replace(ALGORITHMS["fedgp"], client=client))
    run_inprocess(server_app, client_app, N, cfg(tmp_path, blobs_dataset, **{"fedgp.auto-weight": True}))
    fits = rows(tmp_path)
    fda = [r for r in fits if r["fda_round"] > 0]
    assert all(r["num_rejected"] == 1.0 for r in fda)
    if fault == "target-matrix":
        assert all(r["target_missing"] == 1.0 for r in fda)
    else:
        assert all(r["num_sources"] == 2.0 and 0.0 <= r["beta_mean"] <= 1.0 for r in fda)
    last = rows(tmp_path, phase="evaluate")[-1]
    assert np.isfinite(last["target_loss"])


class _AggregatingTargetFails(FedGPClient):
    """Under the target placement the target fails in its aggregating half-rounds only."""

    def fit(self, parameters, config):
        if self.is_target and config.get("fedgp.stage") == "target":
            raise RuntimeError("out of memory while aggregating")
        return super().fit(parameters, config)


def test_target_placement_target_failure_keeps_the_global_model(tmp_path, blobs_dataset, monkeypatch):
    """Target placement, W = 1, 2 FDA rounds (5 server rounds): the sources' half-rounds go
    through, the target's fail; each failure is counted and the global model stays as after
    the warm-up; the sources kept for a failed half-round are not reused."""
    monkeypatch.setitem(ALGORITHMS, "fedgp", dataclasses.replace(ALGORITHMS["fedgp"], client=_AggregatingTargetFails))
    extra = {"fedgp.placement": "target"}
    run_inprocess(server_app, client_app, N, cfg(tmp_path, blobs_dataset, name="warm", num_server_rounds=1, **extra))
    # the target's failed half-rounds trained nothing: the run ends as failed, its results written
    with pytest.raises(RunFailed, match=r"rounds 3, 5 \(of 5\) trained nothing.*out of memory while aggregating"):
        run_inprocess(server_app, client_app, N, cfg(tmp_path, blobs_dataset, name="full", num_server_rounds=5, **extra))
    fits = rows(tmp_path, "full")
    assert [r["num_failures"] for r in fits] == [0.0, 0.0, 1.0, 0.0, 1.0]
    assert [fits[i]["num_sources"] for i in (0, 1, 3)] == [3.0, 3.0, 3.0]
    a, b = np.load(tmp_path / "warm" / "checkpoint.npz"), np.load(tmp_path / "full" / "checkpoint.npz")
    for key in (k for k in a.files if k.startswith("global_")):
        np.testing.assert_allclose(a[key], b[key], rtol=1e-6, atol=1e-8)  # float32 round-off at most


def test_target_placement_payload_mismatch_is_an_error():
    """The target refuses a payload that does not hold one model per described source."""
    from flwr_pfl.clients.fedgp import aggregate_as_target
    from flwr_pfl.core.fedgp import FDAConfig

    glob = [np.zeros((2, 3), np.float32), np.zeros(3, np.float32)]
    config = {"fedgp.sources": json.dumps([{"n": 10, "lr": 0.1, "steps": 2}] * 2)}
    with pytest.raises(ValueError, match="received 2 source arrays for 2 sources of 2 arrays each"):
        aggregate_as_target(glob, glob, glob, None, FDAConfig(), [False, False], config, {"lr": 0.1, "num_steps": 2})


def test_target_placement_without_options_is_an_error():
    from flwr_pfl.clients.fedgp import fda_config_from

    with pytest.raises(ValueError, match="no fedgp.cfg"):
        fda_config_from({"fedgp.stage": "target"})
    with pytest.raises(ValueError, match="placement must be one of"):
        fda_config_from({"fedgp.cfg.placement": "client"})


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("fedgp.beta", 1.5, "fedgp.beta"),
        ("fedgp.projection", "orthogonal", "fedgp.projection.*'cosine_scaled', 'exact'"),
        ("fedgp.preset", "paper", "fedgp.preset.*paper_reference_domainbed"),
        ("fedgp.max-step-updates", 1, "fedgp.max-step-updates"),
        ("fedgp.target-partition", -2, "fedgp.target-partition"),
        ("fedda.step-upload", "all", "fedda.step-upload.*matrix, summary"),
        ("fedda.estimator-alignment", "x", "fedda.estimator-alignment"),
        ("fedgp.placement", "client", "fedgp.placement.*'server', 'target'"),
        ("target-only.target-lr-ratio", 0.0, "target-only.target-lr-ratio"),
    ],
)
def test_bad_options_name_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message):
        parse_experiment({"algorithm": "fedgp", key: value})


def test_presets_and_overrides_reach_the_core():
    exp = parse_experiment({"algorithm": "fedgp", "fedgp.preset": "paper_reference_noniid", "fedgp.auto-weight": True})
    core = exp.options.fda_config()
    assert core.fedgp_beta_form.value == "delta_thresh" and core.lr_decay_after_warmup == 0.1
    exp = parse_experiment({"algorithm": "fedgp", "fedgp.preset": "paper_definitions", "fedgp.warmup-rounds": 0})
    assert exp.options.fda_config().projection.value == "exact" and exp.options.fda_config().warmup_rounds == 0
    with pytest.raises(ConfigError, match="FedDA-only"):
        FedGP(num_clients=2, step_upload="summary")
    with pytest.raises(ConfigError, match="rule='fedda'"):
        FedDA(num_clients=2, config=exp.options.fda_config())
