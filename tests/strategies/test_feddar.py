"""FedDAR end to end through the real Strategy and NumPyClient, in one process (no Ray)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import numpy as np
import pytest
import torch

from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.clients.base import LocalData
from flwr_pfl.clients.feddar import FedDARClient
from flwr_pfl.data.registry import DatasetPool, register_dataset
from flwr_pfl.data.types import ArraySplit
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.feddar import FedDAR

SYNTHETIC = {
    "dataset": "feddar-synthetic",
    "partitioner": "domain-mixture",
    "domain-alpha": 0.4,
    "samples-per-client": 40,
    "test-fraction": 0.5,
    "model": "linear",
    "feature-dim": 2,
    "batch-size": 20,  # full batch: 20 training samples per client
    "learning-rate": 0.2,
    "momentum": 0.0,
    "local-epochs": 5,
    "feddar.head-solver": "lstsq",
    "feddar.rep-epochs": 5,
}


def run(tmp_path, name, num_clients=8, **overrides):
    cfg = {"num-clients": num_clients, "output-dir": str(tmp_path), "run-name": name} | overrides
    grid = run_inprocess(server_app, client_app, num_clients, cfg)
    rows = json.loads((tmp_path / name / "metrics.json").read_text())
    return grid, rows


def phase(rows, name):
    return [r for r in rows if r["phase"] == name]


@pytest.fixture(scope="module")
def blobs3() -> str:
    """4 Gaussian classes in 10 dimensions, 3 domains; each domain permutes which centre a class
    uses, so one shared head cannot fit all domains (domain heads are needed)."""

    def build(config) -> DatasetPool:
        g = torch.Generator().manual_seed(7)
        centers = 3.0 * torch.randn(4, 10, generator=g)
        n = 1800
        y = torch.arange(n) % 4
        d = (torch.arange(n) // 4) % 3
        perms = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0], [3, 2, 1, 0]])
        x = centers[perms[d, y]] + torch.randn(n, 10, generator=g)
        return DatasetPool(x=x, y=y, domain=d, num_classes=4, num_domains=3)

    register_dataset("feddar-test-blobs3", build, replace=True)
    return "feddar-test-blobs3"


BLOBS = {"partitioner": "domain-mixture", "domain-alpha": 1.0, "samples-per-client": 150, "test-fraction": 0.3,
         "model": "linear", "feature-dim": 6, "learning-rate": 0.1, "batch-size": 32,
         "feddar.head-epochs": 2, "feddar.rep-epochs": 1}


# ------------------------------------------------------------------------------------ learning
def test_sa_error_falls_and_ends_below_fedavg(tmp_path):
    """16 clients with mixed domains (domain-alpha 2.0), 30 rounds. With 8 clients, the paper's
    alpha 0.4 and 20 rounds the ratios below held for seed 0 only (5 of seeds 0-7 failed, one SA
    run diverged). Measured over seeds 0-7 with this configuration: first/last SA error 18.9 ..
    1.4e5, mean of the first 5 / last 5 rounds 8.5 .. 4.4e4, FedAvg / SA final error 21 .. 2.5e5
    (the minimum is seed 5 each time)."""
    cfg = {"num-server-rounds": 30, **SYNTHETIC, "domain-alpha": 2.0}
    _, sa = run(tmp_path, "sa", num_clients=16, algorithm="feddar-sa", **cfg)
    _, avg = run(tmp_path, "avg", num_clients=16, algorithm="fedavg", **cfg)
    sa_mse = [r["loss_wmean"] for r in phase(sa, "evaluate")]
    avg_mse = [r["loss_wmean"] for r in phase(avg, "evaluate")]
    assert [r["round"] for r in phase(sa, "evaluate")] == list(range(1, 31))
    assert sa_mse[-1] < sa_mse[0] / 5  # the error falls over the rounds
    assert np.mean(sa_mse[-5:]) < np.mean(sa_mse[:5]) / 5
    assert sa_mse[-1] < avg_mse[-1] / 5  # and ends well below FedAvg's (one model for 5 domains)
    last = phase(sa, "evaluate")[-1]
    assert "loss_domain_max" in last and "loss_domain_mean" in last  # per-domain figures


def test_noise_free_test_targets_take_sa_below_the_noise_floor(tmp_path):
    """The preset's layout (20 clients, 20 training + 20 test samples each), 40 rounds. The
    training is the same with and without ``noise-free-test``; only the test targets differ. With
    noisy test targets the test MSE cannot fall below about sigma^2 = 1e-6 (the mean of eps^2 over
    the 400 test samples); on noise-free ones SA's error goes on falling (seed 0: 1.15e-6 with
    noise, 2.4e-7 without; seeds 1 and 2 have not converged by round 40, 6.7e-4 and 1.5e-5, and
    the two differ by about sigma^2 there too)."""
    cfg = {"num-server-rounds": 40, **SYNTHETIC, "algorithm": "feddar-sa"}
    _, noisy = run(tmp_path, "noisy", num_clients=20, **cfg)
    _, clean = run(tmp_path, "clean", num_clients=20, **cfg, **{"noise-free-test": True})
    assert phase(clean, "fit") == phase(noisy, "fit") and phase(clean, "head") == phase(noisy, "head")
    noisy_mse, clean_mse = phase(noisy, "evaluate")[-1]["loss_wmean"], phase(clean, "evaluate")[-1]["loss_wmean"]
    assert 0.9e-6 < noisy_mse < 1.3e-6 and clean_mse < 0.4e-6
    config = json.loads((tmp_path / "clean" / "config.json").read_text())
    assert config["noise-free-test"] is True and config["dataset"] == "feddar-synthetic"


def test_multiclass_sa_stays_finite_and_trains(tmp_path, blobs3):
    _, rows = run(tmp_path, "sa", num_clients=4, algorithm="feddar-sa", dataset=blobs3, **{"num-server-rounds": 6, **BLOBS})
    evals = phase(rows, "evaluate")
    assert all(math.isfinite(r["loss_wmean"]) for r in evals)
    # Over seeds 0-7: accuracy after round 1 is 0.93 .. 1.0 (1.0 for four seeds, so it cannot rise
    # further), after round 6 1.0 for every seed; the loss falls 5.8x .. 17x from round 1 to 6.
    assert evals[-1]["accuracy_wmean"] > 0.8 and evals[-1]["accuracy_wmean"] >= evals[0]["accuracy_wmean"]
    assert evals[-1]["loss_wmean"] < evals[0]["loss_wmean"] / 2
    for key in ("acc_d0", "acc_d1", "acc_d2", "acc_domain_min", "acc_domain_mean", "accuracy_mean"):
        assert key in evals[-1]  # per domain, min and mean over domains, client average
    heads = phase(rows, "head")
    # the softmax Hessian is singular by construction: the damped solve reports lambda > 0
    assert all(r["sa_lambda_dom0"] > 0 for r in heads)
    assert all(r["num_failures"] == 0 for r in heads)


# ------------------------------------------------------------------------------------ wire
class _SpyClient(FedDARClient):
    """Records every fit it answers (round, phase, partition, shapes in and out)."""

    log: list = []
    fault: str = ""

    def fit(self, parameters, config):
        arrays, n, metrics = super().fit(parameters, config)
        phase = config["feddar-phase"]
        if phase == "head" and self.partition_id == 0:
            if self.fault == "nan":
                arrays[2] = np.full_like(arrays[2], np.nan)
            elif self.fault == "counts":
                arrays[1] = arrays[1] + 1.0
        type(self).log.append((int(config["server-round"]), phase, self.partition_id,
                               [a.shape for a in parameters], [a.shape for a in arrays]))
        return arrays, n, metrics


def spy(monkeypatch, algorithm="feddar-sa", fault=""):
    client = type("Spy", (_SpyClient,), {"log": [], "fault": fault})
    monkeypatch.setitem(ALGORITHMS, algorithm, dataclasses.replace(ALGORITHMS[algorithm], client=client))
    return client


def test_two_exchanges_per_round_use_the_same_clients_and_the_wire_layout(tmp_path, monkeypatch):
    client = spy(monkeypatch)
    run(tmp_path, "wire", num_clients=6, algorithm="feddar-sa", **{"num-server-rounds": 3, "fraction-fit": 0.5, **SYNTHETIC})
    m, p, d, k = 5, 2, 20, 2  # 5 domains, heads of 1 x 2 (no bias), encoder B^T (2, 20)
    for rnd in (1, 2, 3):
        head = {e[2] for e in client.log if e[0] == rnd and e[1] == "head"}
        rep = {e[2] for e in client.log if e[0] == rnd and e[1] == "rep"}
        assert len(head) == 3 and head == rep
    for _, phase_, _, sent, got in client.log:
        if phase_ == "head":
            assert sent == [(k, d)] + [(1, k)] * m
            assert got == [(m, p), (m,), (m, p, p)]
        else:
            assert sent == [(k, d)] + [(1, k)] * m + [(m,)]  # + u
            assert got == [(k, d)]  # the encoder only


def test_wa_sends_no_hessians(tmp_path, monkeypatch):
    client = spy(monkeypatch, "feddar-wa")
    _, rows = run(tmp_path, "wa", num_clients=4, algorithm="feddar-wa", **{"num-server-rounds": 2, **SYNTHETIC})
    assert {tuple(e[4]) for e in client.log if e[1] == "head"} == {((5, 2), (5,))}
    assert all(math.isfinite(r["loss_wmean"]) for r in phase(rows, "evaluate"))


@pytest.mark.parametrize("fault", ["nan", "counts"])
def test_bad_head_reply_is_rejected_and_that_client_skips_the_rep_phase(tmp_path, monkeypatch, fault):
    client = spy(monkeypatch, fault=fault)
    _, rows = run(tmp_path, "bad", num_clients=4, algorithm="feddar-sa", **{"num-server-rounds": 2, **SYNTHETIC})
    assert [r["num_rejected"] for r in phase(rows, "head")] == [1.0, 1.0]
    assert [r["num_clients"] for r in phase(rows, "fit")] == [3.0, 3.0]
    assert not any(e[2] == 0 and e[1] == "rep" for e in client.log)
    assert all(math.isfinite(r["loss_wmean"]) for r in phase(rows, "evaluate"))


# ------------------------------------------------------------------------------------ bad input
class _BadLabelClient(FedDARClient):
    """Partition 0 holds a sample whose domain label is M (outside [0, M))."""

    def __init__(self, context, model, data, *args, **kwargs):
        if int(context.node_config["partition-id"]) == 0:
            x, y, dom = data.train.dataset.tensors
            dom = dom.clone()
            dom[0] = data.num_domains
            split = ArraySplit(x, y, dom)
            data = dataclasses.replace(data, train=split.loader(data.train.batch_size, shuffle=True))
        super().__init__(context, model, data, *args, **kwargs)


def test_domain_label_outside_range_fails_that_client_only(tmp_path, monkeypatch):
    spec = dataclasses.replace(ALGORITHMS["feddar-sa"], client=_BadLabelClient)
    monkeypatch.setitem(ALGORITHMS, "feddar-sa", spec)
    _, rows = run(tmp_path, "label", num_clients=4, algorithm="feddar-sa", **{"num-server-rounds": 2, **SYNTHETIC})
    assert [r["num_failures"] for r in phase(rows, "head")] == [1.0, 1.0]
    assert [r["num_clients"] for r in phase(rows, "fit")] == [3.0, 3.0]
    assert all(math.isfinite(r["loss_wmean"]) for r in phase(rows, "evaluate"))


def test_domain_label_outside_range_names_the_client(blobs3):
    from flwr.app import Context, RecordDict

    from flwr_pfl.models import build_model

    x = torch.randn(6, 10)
    split = ArraySplit(x, torch.zeros(6, dtype=torch.long), torch.tensor([0, 1, 2, 3, 0, 1]))
    data = LocalData(train=split.loader(6, shuffle=False), test=split.loader(6, shuffle=False), num_domains=3)
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 5, "num-partitions": 6}, state=RecordDict(), run_config={})
    client = FedDARClient(ctx, build_model("linear", (10,), 4, num_heads=3, feature_dim=2), data)
    with pytest.raises(ValueError, match=r"partition 5: domain labels must lie in \[0, 3\)"):
        client.domain_counts()


@pytest.fixture(scope="module")
def blobs_missing_domain() -> str:
    """Like blobs3 but domain 2 has no sample anywhere (declared, never observed)."""

    def build(config) -> DatasetPool:
        g = torch.Generator().manual_seed(3)
        n = 800
        y = torch.arange(n) % 4
        d = (torch.arange(n) // 4) % 2
        x = 3.0 * torch.randn(4, 10, generator=g)[y] + torch.randn(n, 10, generator=g)
        return DatasetPool(x=x, y=y, domain=d, num_classes=4, num_domains=3)

    register_dataset("feddar-test-missing", build, replace=True)
    return "feddar-test-missing"


def test_domains_absent_from_clients_are_skipped_and_an_unseen_domain_keeps_its_head(tmp_path, monkeypatch, blobs_missing_domain, caplog):
    client = spy(monkeypatch)
    overrides = {**BLOBS, "partitioner": "domain-mixture", "domain-alpha": 0.1, "samples-per-client": 100}
    with caplog.at_level(logging.INFO, logger="flwr"):
        grid, rows = run(tmp_path, "missing", num_clients=4, algorithm="feddar-sa", dataset=blobs_missing_domain,
                         **{"num-server-rounds": 3, **overrides})
    # an absent domain is said as such, once per round, and is no reason to warn about head size
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "have no samples" in m] == [
        f"round {r}: domain(s) 2 have no samples among this round's clients; their heads are kept (u_m = 0)"
        for r in (1, 2, 3)
    ]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "FedDAR-SA" in r.getMessage()]
    assert not [m for m in messages if "ill-posed" in m]
    heads = phase(rows, "head")
    assert all(r["u_dom2"] == 0.0 and r["count_dom2"] == 0.0 for r in heads)  # u_m = 0 for an unseen domain
    assert all(r["updated_dom2"] == 0.0 and r["head_drift_dom2"] == 0.0 for r in heads)
    assert all(r["updated_dom0"] == 1.0 for r in heads)
    evals = phase(rows, "evaluate")
    # seeds 0-7: final accuracy 0.983..1.000
    assert all(math.isfinite(r["loss_wmean"]) for r in evals) and evals[-1]["accuracy_wmean"] > 0.5


def _sa_strategy(feature_dim: int, num_outputs: int = 1, bias: bool = False) -> FedDAR:
    strategy = FedDAR(num_clients=2, aggregation="sa")
    strategy.head_info = {"num_outputs": num_outputs, "feature_dim": feature_dim, "head_bias": bias}
    return strategy


def _flwr_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_small_heads_with_enough_samples_give_no_size_warning(caplog):
    with caplog.at_level(logging.INFO, logger="flwr"):
        _sa_strategy(feature_dim=2).report_head_conditions(1, np.array([40.0, 3.0]))  # P = 2
    assert _flwr_warnings(caplog) == []


def test_large_sa_heads_are_warned_about_once(caplog):
    strategy = _sa_strategy(feature_dim=64, num_outputs=10, bias=True)  # P = 650, the paper's unstable size
    with caplog.at_level(logging.INFO, logger="flwr"):
        for r in (1, 2):
            strategy.report_head_conditions(r, np.array([5000.0, 5000.0]))
    assert len(_flwr_warnings(caplog)) == 1 and "P = 650 parameters" in _flwr_warnings(caplog)[0]


def test_a_domain_with_fewer_samples_than_head_inputs_is_named(caplog):
    strategy = _sa_strategy(feature_dim=6, bias=True)  # 7 inputs
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.report_head_conditions(3, np.array([50.0, 4.0, 0.0]))
    (warning,) = _flwr_warnings(caplog)
    assert warning.startswith("round 3: FedDAR-SA: domain 1 has 4 sample(s) this round, fewer than the 7 inputs")
    assert "singular" in warning and "large" not in warning


@pytest.mark.parametrize("solver", ["exact", "pinv", "damped"])
def test_singular_hessian_is_handled_by_the_configured_solver(tmp_path, blobs3, solver):
    _, rows = run(tmp_path, solver, num_clients=3, algorithm="feddar-sa", dataset=blobs3,
                  **{"num-server-rounds": 2, **BLOBS, "feddar.sa-solver": solver})
    heads = phase(rows, "head")
    # softmax heads: sum of Hessians singular; exact refuses (heads kept, run goes on), the others solve
    assert [r["head_update_skipped"] for r in heads] == ([1.0, 1.0] if solver == "exact" else [0.0, 0.0])
    assert all(math.isfinite(r["loss_wmean"]) for r in phase(rows, "evaluate"))


def test_fallback_to_wa_on_ill_conditioning(tmp_path, blobs3):
    _, rows = run(tmp_path, "fb", num_clients=3, algorithm="feddar-sa", dataset=blobs3,
                  **{"num-server-rounds": 1, **BLOBS, "feddar.sa-fallback-to-wa": True})
    assert phase(rows, "head")[0]["sa_fallback_dom0"] == 1.0


# ------------------------------------------------------------------------------------ baselines
@pytest.mark.parametrize("algorithm", ["separate-fedavg", "fedavg-rw", "fedavg-mh", "feddar-wa"])
def test_baselines_train_with_domain_metrics(tmp_path, blobs3, algorithm):
    _, rows = run(tmp_path, algorithm, num_clients=3, algorithm=algorithm, dataset=blobs3, **{"num-server-rounds": 3, **BLOBS})
    last = phase(rows, "evaluate")[-1]
    assert "acc_domain_min" in last and "acc_domain_mean" in last and math.isfinite(last["loss_wmean"])
    if algorithm != "fedavg-rw":  # one shared head cannot fit the permuted domains; the others can
        # seeds 0-7: separate-fedavg 0.600..1.000, fedavg-mh 0.853..1.000, feddar-wa 1.000
        assert last["acc_domain_min"] > 0.3


def test_warmup_rounds_come_first_and_count_in_the_total(tmp_path, monkeypatch):
    client = spy(monkeypatch)
    run(tmp_path, "warm", num_clients=3, algorithm="feddar-sa",
        **{"num-server-rounds": 3, **SYNTHETIC, "feddar.warmup-rounds": 2})
    assert [(e[0], e[1]) for e in client.log if e[2] == 0] == [(1, "warmup"), (2, "warmup"), (3, "head"), (3, "rep")]


def test_options_are_validated_and_shared_by_the_variants():
    with pytest.raises(ConfigError, match="feddar.sa-solver"):
        parse_experiment({"algorithm": "feddar-sa", "feddar.sa-solver": "inverse"})
    with pytest.raises(ConfigError, match="feddar.head-epochs"):
        parse_experiment({"algorithm": "feddar", "feddar.head-epochs": -1})
    e = parse_experiment({"algorithm": "feddar-wa", "feddar.head-epochs": 3, "feddar.aggregation": "sa"})
    kwargs = e.algorithm.strategy_kwargs(e.options)
    assert kwargs["head_epochs"] == 3 and kwargs["aggregation"] == "wa"  # the named variant wins
    assert e.to_dict()["feddar.head-epochs"] == 3
    with pytest.raises(ConfigError, match="feddar.sa-trust-radius"):
        parse_experiment({"algorithm": "feddar-sa", "feddar.sa-trust-radius": -1.0})
    e = parse_experiment({"algorithm": "feddar-sa", "feddar.sa-trust-radius": 2.5})
    assert e.algorithm.strategy_kwargs(e.options)["sa_options"].trust_radius == 2.5
    default = parse_experiment({"algorithm": "feddar-sa"})
    assert default.algorithm.strategy_kwargs(default.options)["sa_options"].trust_radius == 1.0


# ------------------------------------------------------------------------------------ binary AUC
def test_binary_auc_matches_pair_counting():
    from flwr_pfl.core.feddar import binary_auc

    rng = np.random.default_rng(0)
    s, y = rng.integers(0, 5, 60).astype(float), rng.integers(0, 2, 60)
    pos, neg = s[y == 1], s[y == 0]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert binary_auc(s, y) == pytest.approx(pairs)
    assert math.isnan(binary_auc(s, np.ones(60)))


def test_binary_task_reports_client_and_domain_auc(tmp_path):
    def build(config) -> DatasetPool:
        g = torch.Generator().manual_seed(11)
        n = 900
        d = torch.arange(n) % 3
        y = (torch.arange(n) // 3) % 2
        w = torch.randn(3, 6, generator=g)
        x = torch.randn(n, 6, generator=g) + 1.5 * (2 * y[:, None] - 1) * w[d]
        return DatasetPool(x=x, y=y, domain=d, num_classes=2, num_domains=3)

    register_dataset("feddar-test-binary", build, replace=True)
    _, rows = run(tmp_path, "auc", num_clients=3, algorithm="feddar-sa", dataset="feddar-test-binary",
                  **{"num-server-rounds": 3, **BLOBS})
    last = phase(rows, "evaluate")[-1]
    # seeds 0-7: auc_mean 0.999..1.000
    assert last["auc_mean"] > 0.8 and "auc_dom0_mean" in last and "acc_domain_min" in last
