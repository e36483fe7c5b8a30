"""FedAvg+FMTL end to end through the real FedFMTL Strategy and FedFMTLClient, in one process.

* The linear problem of the spec (Sec. 7), one full-batch step per round in float64, reaches the
  core closed form (eq. 7 with eq. 12 weights) and matches the core's FedAvg-GD round by round.
* The registered app: the schedule, the weights logged per round, and bad input (a client
  holding no task, a task held by no sampled client, a head map that does not fit, bad replies).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.client import ClientApp
from flwr.server import ServerConfig
from flwr.server.compat import start_grid
from flwr.serverapp import ServerApp
from torch.utils.data import DataLoader, TensorDataset

from flwr_pfl.app.client_app import app as registry_client_app
from flwr_pfl.app.inprocess import InProcessGrid, run_inprocess
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.app.results import RunFailed
from flwr_pfl.app.server_app import app as registry_server_app
from flwr_pfl.clients import FedFMTLClient, LocalData, TrainConfig
from flwr_pfl.core.fmtl import (
    FMTLWeightingOptions,
    HeadAggregationWeights,
    HeadMap,
    aggregate_parameters,
    augmented_targets,
    eq12_weight_matrix,
    head_weight_matrix,
    linear_closed_form,
    linear_heads_gd,
)
from flwr_pfl.data.synthetic.fmtl import LinearFMTLConfig, client_statistics, make_linear_fmtl
from flwr_pfl.errors import ConfigError
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.models.encoders import LinearEncoder
from flwr_pfl.strategies import FedFMTL
from flwr_pfl.training import OptimizerConfig, get_arrays

from fakes import FakeProxy, fit_res

# ------------------------------------------------------------------------------------------------
# The linear problem: closed form through Flower
# ------------------------------------------------------------------------------------------------

LR = 0.5
PROBLEM = LinearFMTLConfig(num_clients=6, num_tasks=3, tasks_per_client=1, dim=3, samples_per_task=15, tau=0.5)


def _linear_model(k: int, m: int) -> EncoderHeadModel:
    """phi = identity (the theory's known representation), M one-output heads w_c, no bias."""
    model = EncoderHeadModel(LinearEncoder(k, k), k, 1, num_heads=m, head_bias=False).double()
    with torch.no_grad():
        model.encoder.linear.weight.copy_(torch.eye(k, dtype=torch.float64))
        for head in model.heads:
            head.weight.zero_()
    return model


def _run_linear(prob, rounds: int, weighting: FMTLWeightingOptions | None = None) -> FedFMTL:
    k, m = prob.true_heads.shape[1], prob.num_tasks
    n_clients = len(prob.features)

    def client_fn(context: Context):
        pid = int(context.node_config["partition-id"])
        x = torch.from_numpy(prob.features[pid])
        y = torch.from_numpy(prob.targets[pid])
        d = torch.from_numpy(prob.task_ids[pid]).long()
        loader = DataLoader(TensorDataset(x, y, d), batch_size=len(x), shuffle=False)  # full batch
        data = LocalData(train=loader, test=loader, num_domains=m, task="regression")
        config = TrainConfig(local_epochs=1, batch_size=len(x), optimizer=OptimizerConfig("sgd", LR), device="cpu")
        return FedFMTLClient(context, _linear_model(k, m), data, config, head_loss="mse").to_client()

    strategy = FedFMTL(
        num_clients=n_clients, fraction_evaluate=0.0, t1_rounds=0, head_layout="per-head",
        weighting=weighting, initial_arrays=get_arrays(_linear_model(k, m)),
    )
    server = ServerApp()

    @server.main()
    def _main(grid, context):
        start_grid(grid=grid, strategy=strategy, config=ServerConfig(num_rounds=rounds))

    run_inprocess(server, ClientApp(client_fn=client_fn), n_clients, {})
    return strategy


def _core_fedavg_gd(prob, rounds: int) -> np.ndarray:
    """The same rounds with the core functions only: linear_heads_gd + aggregate_parameters."""
    m, k = prob.true_heads.shape
    beta = eq12_weight_matrix(prob.membership)
    head_map = HeadMap.stacked_linear(m, 0)
    heads = np.zeros((m, k))
    for _ in range(rounds):
        uploads = []
        for z, y, t in zip(prob.features, prob.targets, prob.task_ids):
            yt, om = augmented_targets(torch.from_numpy(y), torch.from_numpy(t), m)
            uploads.append([linear_heads_gd(torch.from_numpy(heads), torch.from_numpy(z), yt, om, lr=LR).numpy()])
        heads = aggregate_parameters(uploads, head_map, HeadAggregationWeights.from_beta(beta))[0]
    return heads


def _heads(strategy: FedFMTL) -> np.ndarray:
    return np.concatenate([a for a in strategy.global_arrays[1:]])  # (M, k)


def test_linear_run_matches_core_closed_form_and_core_gd() -> None:
    prob = make_linear_fmtl(PROBLEM, 0)
    strategy = _run_linear(prob, rounds=120)
    closed = linear_closed_form(client_statistics(prob), eq12_weight_matrix(prob.membership))
    heads = _heads(strategy)
    assert strategy.global_arrays[0].dtype == np.float64
    np.testing.assert_array_equal(strategy.global_arrays[0], np.eye(3))  # body frozen (t1 = 0)
    assert np.abs(heads - closed).max() < 1e-8
    # round by round it is the core's FedAvg-GD (only the order of float sums differs)
    short = _run_linear(prob, rounds=5)
    assert np.abs(_heads(short) - _core_fedavg_gd(prob, 5)).max() < 1e-12
    # the weights logged per round are eq. (12) over the participants (full participation here)
    beta = eq12_weight_matrix(prob.membership)
    for entry in strategy.weight_history:
        assert entry["scheme"] == "fmtl_eq12" and entry["participation"] == "round_local"
        np.testing.assert_allclose(np.array(entry["beta"]), beta[entry["participants"]], atol=1e-15)
    assert sorted({1 / 4, 1 / 8}) == sorted(set(np.round(beta.ravel(), 12)))  # holders 1/(2h), others 1/(2(N-h))


def test_linear_run_with_eq10_weights_uses_client_statistics() -> None:
    prob = make_linear_fmtl(PROBLEM, 1)
    strategy = _run_linear(prob, rounds=2, weighting=FMTLWeightingOptions(scheme="fmtl_eq10"))
    assert len(strategy.statistics) == 6  # sent once, in the first phase-2 round
    entry = strategy.weight_history[-1]
    order = entry["participants"]  # the solver's restarts depend on the row order
    stats = [strategy.statistics[f"p{i}"] for i in order]
    expected = head_weight_matrix(prob.membership[order], "fmtl_eq10",
                                  num_examples=[len(prob.task_ids[i]) for i in order], statistics=stats)
    np.testing.assert_allclose(np.array(entry["beta"]), expected, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# The registered app on a small classification problem (4 classes, one class per client)
# ------------------------------------------------------------------------------------------------


class _RecordingFMTL(FedFMTL):
    """Keeps the global arrays after every fit aggregation and the last instance."""

    last: _RecordingFMTL | None = None

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.history: list[list[np.ndarray]] = []
        type(self).last = self

    def aggregate_fit(self, server_round, results, failures):
        out = super().aggregate_fit(server_round, results, failures)
        self.history.append([a.copy() for a in self.global_arrays])
        return out


def _config(tmp_path, dataset, **overrides):
    base = {
        "algorithm": "fmtl", "dataset": dataset, "model": "mlp", "num-clients": 6, "num-server-rounds": 4,
        "learning-rate": 0.1, "partitioner": "pathological", "classes-per-client": 1, "test-fraction": 0.25,
        "fraction-fit": 0.5, "output-dir": str(tmp_path), "run-name": "run", "fmtl.t1-rounds": 2,
    }
    return base | overrides


def _rows(tmp_path, phase="fit"):
    return [r for r in json.loads((tmp_path / "run" / "metrics.json").read_text()) if r["phase"] == phase]


@pytest.fixture
def recording(monkeypatch):
    monkeypatch.setitem(ALGORITHMS, "fmtl", dataclasses.replace(ALGORITHMS["fmtl"], strategy=_RecordingFMTL))
    return _RecordingFMTL


def test_schedule_weights_and_heads_no_participant_holds(tmp_path, blobs_dataset, recording) -> None:
    grid = run_inprocess(registry_server_app, registry_client_app, 6, _config(tmp_path, blobs_dataset))
    strategy = recording.last
    fits = _rows(tmp_path)
    assert [r["fmtl_phase"] for r in fits] == [1.0, 1.0, 2.0, 2.0]
    assert all("holders_min" in r and "heads_skipped" in r and "holders_weight_mean" in r for r in fits[2:])
    assert [e["round"] for e in strategy.weight_history] == [3, 4]
    # phase 2: the body (every array but the stacked head's weight and bias) is frozen
    for before, after in zip(strategy.history[1], strategy.history[3]):
        if before.shape[0] != 4:
            np.testing.assert_array_equal(before, after)
    # a task held by no sampled client keeps its head (policy 'keep'), and is reported
    for entry, (before, after) in zip(strategy.weight_history, zip(strategy.history[1:3], strategy.history[2:4])):
        holders = np.array(entry["holders"])
        assert entry["skipped"] == np.flatnonzero(holders == 0).tolist()
        for c in entry["skipped"]:
            np.testing.assert_array_equal(after[-2][c], before[-2][c])
            assert after[-1][c] == before[-1][c]
        beta = np.array(entry["beta"])
        held = holders > 0
        np.testing.assert_allclose(beta[:, held].sum(0), 1.0)
    assert sum(r["heads_skipped"] for r in fits[2:]) > 0  # 3 of 6 one-class clients: some class is missing
    # run seeds 0-7 by hand (this config with "seed": s): final accuracy_wmean 0.752 (seed 5) ..
    # 1.000, heads skipped over the two phase-2 rounds 2-4
    assert _rows(tmp_path, "evaluate")[-1]["accuracy_wmean"] > 0.6
    assert strategy.registry and all(c.sum() > 0 for c in strategy.registry.values())
    # clients keep only what their data gives (task counts) in context.state
    assert all("fmtl-counts" in ctx.state for ctx in grid.contexts.values() if ctx.state)


def test_head_only_upload_is_smaller(tmp_path, blobs_dataset) -> None:
    received = {}
    for upload in ("full", "head_only"):
        grid = run_inprocess(registry_server_app, registry_client_app, 6,
                             _config(tmp_path, blobs_dataset, **{"fmtl.upload": upload, "fmtl.t1-rounds": 0, "num-server-rounds": 1,
                                                                 "run-name": upload}))
        received[upload] = grid.bytes_received
    # both include one full model for the initial parameters; then 3 replies of the whole model vs the head
    assert 0 < received["head_only"] < 0.3 * received["full"]


def test_empty_holder_error_policy_stops_with_the_tasks_named(tmp_path, blobs_dataset) -> None:
    with pytest.raises(ValueError, match="no participant holds task"):
        run_inprocess(registry_server_app, registry_client_app, 6,
                      _config(tmp_path, blobs_dataset, **{"fmtl.empty-holder": "error", "fmtl.t1-rounds": 0}))


def test_population_policy_runs_on_the_registry(tmp_path, blobs_dataset, recording) -> None:
    run_inprocess(registry_server_app, registry_client_app, 6,
                  _config(tmp_path, blobs_dataset, **{"fmtl.participation": "population_renorm"}))
    entry = recording.last.weight_history[-1]
    assert entry["participation"] == "population_renorm"
    assert len(recording.last.registry) >= 3


def test_client_holding_no_task_is_rejected_in_phase_2(tmp_path, blobs_dataset) -> None:
    # every phase-2 reply is rejected, so rounds 3-4 train nothing and the run ends failed
    with pytest.raises(RunFailed, match="rounds 3-4 \\(of 4\\) trained nothing"):
        run_inprocess(registry_server_app, registry_client_app, 6,
                      _config(tmp_path, blobs_dataset, **{"fmtl.min-count": 100000}))
    fits = _rows(tmp_path)
    assert [r["num_rejected"] for r in fits] == [0.0, 0.0, 3.0, 3.0]  # phase 1 is plain FedAvg
    # and the reason is named
    strategy = FedFMTL(num_clients=4, t1_rounds=0, min_count=5, initial_arrays=[np.zeros((2, 3)), np.zeros((4, 2)), np.zeros(4)])
    proxy = FakeProxy("7")
    res = fit_res([np.zeros((4, 2)), np.zeros(4), np.array([1, 2, 0, 1])], 4, 3)
    with pytest.raises(Exception, match="hold.*no task"):
        strategy.check_reply(1, proxy, res)


def test_head_map_that_does_not_fit_the_model_stops_the_run(tmp_path, blobs_dataset, monkeypatch) -> None:
    with pytest.raises(ValueError, match="per-head"):
        run_inprocess(registry_server_app, registry_client_app, 6,
                      _config(tmp_path, blobs_dataset, **{"fmtl.head-layout": "per-head"}))
    bad = type("BadMap", (FedFMTL,), {"__init__": lambda self, **kw: FedFMTL.__init__(self, head_map=HeadMap.stacked_linear(4, 99, 100), **kw)})
    monkeypatch.setitem(ALGORITHMS, "fmtl", dataclasses.replace(ALGORITHMS["fmtl"], strategy=bad))
    with pytest.raises(ValueError, match="HeadMap: task 0 names array 99"):
        run_inprocess(registry_server_app, registry_client_app, 6, _config(tmp_path, blobs_dataset, **{"run-name": "bad-map"}))


class _BadFMTLClient(FedFMTLClient):
    fault = "nan"

    def fit(self, parameters, config):
        arrays, n, metrics = super().fit(parameters, config)
        if self.partition_id in (0, 1):  # one class each: both are sampled or neither; fault only once
            if self.partition_id == 1 and self.fault != "nan":
                return arrays, n, metrics
            if self.fault == "nan":
                arrays[0] = np.full_like(arrays[0], np.nan)
            elif self.fault == "counts":
                arrays[-1] = arrays[-1] + 1
            elif self.fault == "float_counts":
                arrays[-1] = arrays[-1].astype(np.float64)
            elif self.fault == "stats":
                metrics["n_stats_arrays"] = 3
        return arrays, n, metrics


@pytest.mark.parametrize("fault", ["nan", "counts", "float_counts", "stats"])
def test_bad_replies_are_rejected_and_the_round_goes_on(tmp_path, blobs_dataset, monkeypatch, fault) -> None:
    client = type("Bad", (_BadFMTLClient,), {"fault": fault})
    monkeypatch.setitem(ALGORITHMS, "fmtl", dataclasses.replace(ALGORITHMS["fmtl"], client=client))
    run_inprocess(registry_server_app, registry_client_app, 6,
                  _config(tmp_path, blobs_dataset, **{"fraction-fit": 1.0, "fmtl.t1-rounds": 1, "num-server-rounds": 2}))
    fits = _rows(tmp_path)
    expected = 2.0 if fault == "nan" else 1.0
    assert [r["num_rejected"] for r in fits] == [expected, expected]
    assert all(r["num_clients"] == 6.0 - expected for r in fits)
    assert np.isfinite(_rows(tmp_path, "evaluate")[-1]["loss_wmean"])


def test_options_are_validated_at_the_edge(tmp_path, blobs_dataset) -> None:
    from flwr_pfl.app.config import parse_experiment

    with pytest.raises(ConfigError, match=r"fmtl\.head-weighting='eq99'.*fmtl_eq12"):
        parse_experiment({"fmtl.head-weighting": "eq99"})
    with pytest.raises(ConfigError, match=r"fmtl\.participation"):
        parse_experiment({"fmtl.participation": "all"})
    with pytest.raises(ConfigError, match=r"fmtl\.head-loss='ce'"):
        parse_experiment({"fmtl.augmentation": "original"})
    with pytest.raises(ConfigError, match=r"fmtl\.t1-rounds"):
        parse_experiment({"fmtl.t1-rounds": -2})
    options = parse_experiment({"algorithm": "fmtl"}).options
    assert (options.t1_rounds, options.head_weighting, options.participation, options.empty_holder) == (
        -1, "fmtl_eq12", "round_local", "keep")  # -1: half of num-server-rounds


def test_warns_when_eq12_meets_original_datasets() -> None:
    import logging

    from flwr.common.logger import FLOWER_LOGGER

    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    FLOWER_LOGGER.addHandler(handler)
    try:
        FedFMTL(num_clients=2, augmentation="original")
    finally:
        FLOWER_LOGGER.removeHandler(handler)
    assert any("augmentation 'original'" in r for r in records)
