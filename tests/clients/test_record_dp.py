"""Record-level DP in the clients: every covered algorithm trains with DP-SGD and reports the
epsilon it has spent over the run; the others, BatchNorm models and a delta not below 1/n are
refused before training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from torch import nn

from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.app.results import read_status
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.clients import APFLClient, FedAMPClient, FedAvgClient, FedGPClient, TrainConfig
from flwr_pfl.core.fedamp import ALPHA_KEY, LAM_KEY
from flwr_pfl.errors import ConfigError
from flwr_pfl.models import EncoderHeadModel
from flwr_pfl.training import OptimizerConfig, get_arrays
from flwr_pfl.training.dpsgd import RecordLevelDP, StepAccount

from fakes import split_loaders

#: the algorithms whose clients use their data only through the shared train loop's steps
COVERED = {"fedavg", "local", "finetune", "fedrep", "fedper", "fedprox", "fedprox-ft", "lg-fedavg", "fedbabu", "ditto",
           "knn-per", "pfedhn", "fedamp", "fedgp", "fedda", "target-only", "source-only"}


def data(n: int = 30):
    g = torch.Generator().manual_seed(n)
    y = torch.arange(n + 20) % 3
    x = torch.randn(3, 6, generator=g)[y] + 0.3 * torch.randn(n + 20, 6, generator=g)
    return split_loaders(x, y, torch.zeros(n + 20, dtype=torch.long), n, 10)


def client(cls=FedAvgClient, n: int = 30, model: nn.Module | None = None, delta: float = 1e-3, **kwargs):
    torch.manual_seed(0)
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 2, "num-partitions": 3}, state=RecordDict(),
                      run_config={})
    config = TrainConfig(batch_size=8, optimizer=OptimizerConfig("sgd", learning_rate=0.1), local_epochs=1,
                         record_dp=RecordLevelDP(1.0, 0.5, delta=delta, noise_seed=4))
    net = model or EncoderHeadModel(nn.Sequential(nn.Linear(6, 8), nn.Tanh()), 8, 3)
    return cls(context, net, data(n), config, **kwargs)


def test_the_epsilon_reported_is_that_of_every_step_the_client_took_over_the_run():
    c = client()
    arrays = get_arrays(c.model)
    epsilons = []
    for server_round in (1, 2, 3):
        _, _, metrics = c.fit(arrays, {"server-round": server_round})
        assert metrics["dp_record_steps"] == 4.0  # ceil(30 / 8) Poisson batches per epoch
        epsilons.append(metrics["dp_record_epsilon"])
        assert metrics["dp_record_delta"] == 1e-3
    expected = StepAccount()
    expected.add(8 / 30, 1.0, 12)
    assert epsilons[0] < epsilons[1] < epsilons[2] == pytest.approx(expected.epsilon(1e-3))


def test_dp_sgd_changes_what_the_client_sends():
    plain_config = TrainConfig(batch_size=8, optimizer=OptimizerConfig("sgd", learning_rate=0.1))
    private = client()
    plain = FedAvgClient(private.context, EncoderHeadModel(nn.Sequential(nn.Linear(6, 8), nn.Tanh()), 8, 3), data(),
                         plain_config)
    arrays = get_arrays(private.model)
    sent_private, _, _ = private.fit(arrays, {"server-round": 1})
    sent_plain, _, metrics = plain.fit(arrays, {"server-round": 1})
    assert "dp_record_epsilon" not in metrics
    assert any(not np.allclose(a, b) for a, b in zip(sent_private, sent_plain))


def test_fedamp_takes_its_proximal_steps_with_dp_sgd_and_still_sends_its_mask():
    """FedAMP's fit (Eq. 6 from u_i) runs through DP-SGD: the steps and epsilon of a plain client,
    a different upload than without DP, and the parameter mask after w_i."""
    config = {"server-round": 1, LAM_KEY: 1.0, ALPHA_KEY: 0.5}
    private = client(FedAMPClient)
    arrays = get_arrays(private.model)
    sent, _, metrics = private.fit(arrays, config)
    assert metrics["dp_record_steps"] == 4.0 and metrics["dp_record_delta"] == 1e-3
    expected = StepAccount()
    expected.add(8 / 30, 1.0, 4)
    assert metrics["dp_record_epsilon"] == pytest.approx(expected.epsilon(1e-3))
    np.testing.assert_array_equal(sent[-1], private.parameter_mask())
    torch.manual_seed(0)
    plain = FedAMPClient(private.context, EncoderHeadModel(nn.Sequential(nn.Linear(6, 8), nn.Tanh()), 8, 3), data(),
                         TrainConfig(batch_size=8, optimizer=OptimizerConfig("sgd", learning_rate=0.1)))
    sent_plain, _, plain_metrics = plain.fit(arrays, config)
    assert "dp_record_epsilon" not in plain_metrics
    assert any(not np.allclose(a, b) for a, b in zip(sent[:-1], sent_plain[:-1]))


def test_the_fedgp_target_takes_dp_sgd_steps_at_its_own_batch_size_over_its_own_samples():
    """The target trains on its 20 target samples in batches of 16: 2 Poisson batches per epoch at
    rate 16 / 20, not the source's 8 / 30."""
    target = client(FedGPClient, target_train_samples=20, target_batch_size=16)
    assert target.is_target
    _, _, metrics = target.fit(get_arrays(target.model), {"server-round": 1})
    assert metrics["dp_record_steps"] == 2.0
    expected = StepAccount()
    expected.add(16 / 20, 1.0, 2)
    assert metrics["dp_record_epsilon"] == pytest.approx(expected.epsilon(1e-3))
    _, _, again = target.fit(get_arrays(target.model), {"server-round": 2})
    expected.add(16 / 20, 1.0, 2)
    assert again["dp_record_epsilon"] == pytest.approx(expected.epsilon(1e-3))  # accounted over the run


def test_a_delta_not_below_one_over_n_is_refused():
    with pytest.raises(ConfigError, match=r"partition 2: dp-record-delta=0.05 is not below 1/n = 0.0333 for its 30"):
        client(delta=0.05)


def test_a_batchnorm_model_and_an_uncovered_algorithm_are_refused_by_the_client():
    with pytest.raises(ConfigError, match="partition 2: record-level DP .* BatchNorm-like modules"):
        client(model=EncoderHeadModel(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8)), 8, 3))
    with pytest.raises(ConfigError, match="partition 2: record-level DP .* cannot be used: its personal model and mixing"):
        client(APFLClient)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_is_covered_or_refused_before_training(algorithm):
    keys = {"algorithm": algorithm, "model": "mlp", "dp-record-noise-multiplier": 1.0}
    if algorithm in COVERED:
        assert parse_experiment(keys).train_config.record_dp is not None
    else:
        with pytest.raises(ConfigError, match=rf"{algorithm}: record-level DP \(dp-record-noise-multiplier\) cannot be used: .+"):
            parse_experiment(keys)


def test_batchnorm_models_and_keys_without_noise_are_refused_before_training():
    with pytest.raises(ConfigError, match="model='resnet18' has BatchNorm"):
        parse_experiment({"model": "resnet18", "dp-record-noise-multiplier": 1.0})
    with pytest.raises(ConfigError, match="dp-record-clip-norm=2.0 set with dp-record-noise-multiplier=0"):
        parse_experiment({"dp-record-clip-norm": 2.0})
    with pytest.raises(ConfigError, match="dp-noise-seed=3 set without differential privacy"):
        parse_experiment({"dp-noise-seed": 3})


def test_a_run_records_each_clients_epsilon(tmp_path, blobs_dataset):
    config = {"dataset": blobs_dataset, "model": "mlp", "num-clients": 3, "num-server-rounds": 2, "learning-rate": 0.1,
              "partitioner": "iid", "test-fraction": 0.25, "output-dir": str(tmp_path), "run-name": "run",
              "algorithm": "fedrep", "dp-record-noise-multiplier": 1.0, "dp-record-delta": 1e-4}
    run_inprocess(server_app, client_app, 3, config)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    fit = [r for r in rows if r.get("phase") == "fit"]
    assert 0 < fit[0]["dp_record_epsilon_max"] < fit[1]["dp_record_epsilon_max"]
    per_client = json.loads((tmp_path / "run" / "clients.json").read_text())
    assert sorted(c["partition_id"] for c in per_client) == [0, 1, 2]
    assert max(c["dp_record_epsilon"] for c in per_client) == pytest.approx(fit[1]["dp_record_epsilon_max"])
    assert all("accuracy" in c and c["dp_record_delta"] == 1e-4 for c in per_client)
    assert read_status(tmp_path / "run")["status"] == "completed"
