"""FedProx and FedProx + fine-tuning (Li et al., MLSys 2020) in the Flower layer, against hand
replays of Eq. 2's local objective: two clients of unequal sizes, a non-default mu, full-batch
unshuffled loaders so each step can be replayed exactly."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Context, RecordDict
from flwr.common import parameters_to_ndarrays
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fakes import FakeProxy, fit_res
from fakes import assert_arrays_close as close
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.clients import FedAvgClient, FedProxClient, FedProxFinetuneClient
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.errors import ConfigError
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.strategies import FedProx
from flwr_pfl.training import OptimizerConfig, evaluate, get_arrays, set_arrays, train

CPU = torch.device("cpu")
LR, MU, EPOCHS = 0.4, 0.7, 4
SIZES = (12, 30)


def make_model(seed: int = 0) -> EncoderHeadModel:
    torch.manual_seed(seed)
    return EncoderHeadModel(nn.Sequential(nn.Linear(5, 4), nn.Tanh()), 4, 3)


def make_data(n: int, seed: int) -> LocalData:
    g = torch.Generator().manual_seed(200 + seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 5, generator=g) + y[:, None].float() * (1 + seed)
    d = torch.zeros(n, dtype=torch.long)
    test = TensorDataset(x[: n // 2] + 0.3, y[: n // 2], d[: n // 2])
    return LocalData(DataLoader(TensorDataset(x, y, d), batch_size=n, shuffle=False), DataLoader(test, batch_size=4))


def context(pid: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})


def train_config() -> TrainConfig:
    return TrainConfig(local_epochs=EPOCHS, batch_size=64, optimizer=OptimizerConfig("sgd", LR), device="cpu")


def hand_replay(start: list[np.ndarray], data: LocalData, mu: float) -> list[np.ndarray]:
    """EPOCHS full-batch SGD steps on F_k(w) + (mu/2)||w - w^t||^2 from w^t = ``start``, the
    proximal gradient mu (w - w^t) written out here (Eq. 2), F_k's gradient by autograd."""
    model = make_model(seed=7)
    set_arrays(model, start, "all")
    anchor = [p.detach().clone() for p in model.parameters()]
    x, y, d = data.train.dataset.tensors
    for _ in range(EPOCHS):
        params = list(model.parameters())
        grads = torch.autograd.grad(F.cross_entropy(model(x, d), y), params)
        with torch.no_grad():
            for p, g, a in zip(params, grads, anchor):
                p -= LR * (g + mu * (p - a))
    return get_arrays(model, "all")


def distance(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(np.sqrt(sum(((x - y) ** 2).sum() for x, y in zip(a, b))))


def test_fedprox_clients_minimise_eq2_and_the_server_takes_their_example_weighted_mean():
    global_model = [a * 0.8 for a in get_arrays(make_model(), "all")]
    replies, expected = [], []
    for pid, n in enumerate(SIZES):
        data = make_data(n, pid)
        client = FedProxClient(context(pid), make_model(seed=3), data, train_config(), mu=MU)
        arrays, num_examples, metrics = client.fit([a.copy() for a in global_model], {"server-round": 1})
        assert num_examples == n and metrics["partition_id"] == pid
        reference = hand_replay(global_model, data, MU)
        close(arrays, reference, atol=1e-5)
        # the proximal pull: closer to w^t than FedAvg's update from the same start, which is
        # the same replay with mu = 0
        fedavg = FedAvgClient(context(pid), make_model(seed=3), data, train_config())
        plain, _, _ = fedavg.fit([a.copy() for a in global_model], {"server-round": 1})
        close(plain, hand_replay(global_model, data, 0.0), atol=1e-5)
        assert distance(arrays, global_model) < distance(plain, global_model) - 1e-3
        replies.append((FakeProxy(str(pid)), fit_res(arrays, num_examples, pid)))
        expected.append(reference)
    strategy = FedProx(num_clients=2, initial_arrays=global_model)
    out = parameters_to_ndarrays(strategy.aggregate_fit(1, replies, [])[0])
    w = np.array(SIZES, float) / sum(SIZES)
    close(out, [w[0] * a + w[1] * b for a, b in zip(*expected)], atol=1e-5)


def test_mu_zero_is_fedavg_step_for_step():
    data = make_data(SIZES[1], 1)
    start = get_arrays(make_model(), "all")
    prox_client = FedProxClient(context(1), make_model(seed=3), data, train_config(), mu=0.0)
    prox, _, _ = prox_client.fit(start, {"server-round": 1})
    plain, _, _ = FedAvgClient(context(1), make_model(seed=3), data, train_config()).fit(start, {"server-round": 1})
    close(prox, plain, atol=0)


def test_fedprox_ft_trains_with_the_proximal_term_and_finetunes_without_it_before_evaluating():
    data = make_data(SIZES[1], 1)
    start = [a * 1.1 for a in get_arrays(make_model(), "all")]
    client = FedProxFinetuneClient(context(1), make_model(seed=3), data, train_config(), mu=MU, finetune_epochs=3)
    arrays, _, _ = client.fit([a.copy() for a in start], {"server-round": 1})
    close(arrays, hand_replay(start, data, MU), atol=1e-5)
    global_model = make_model(seed=9)
    set_arrays(global_model, start, "all")
    tuned = copy.deepcopy(global_model)
    train(tuned, data.train, optimizer=OptimizerConfig("sgd", LR), device=CPU, epochs=3)  # plain F_k, no term
    expected, expected_global = evaluate(tuned, data.test, device=CPU), evaluate(global_model, data.test, device=CPU)
    assert abs(expected.loss - expected_global.loss) > 1e-3
    loss, n, metrics = client.evaluate([a.copy() for a in start], {"server-round": 1})
    assert n == len(data.test.dataset)
    assert loss == pytest.approx(expected.loss, rel=1e-5)
    assert metrics["global_loss"] == pytest.approx(expected_global.loss, rel=1e-5)
    close(get_arrays(client.model, "all"), start, atol=0)  # the global model is restored


def test_the_run_config_keys_reach_the_clients():
    for name, raw, kwargs in (
        ("fedprox", {"fedprox.mu": 0.25}, {"mu": 0.25}),
        ("fedprox-ft", {"fedprox-ft.mu": 0.5, "fedprox-ft.epochs": 3}, {"mu": 0.5, "finetune_epochs": 3}),
    ):
        experiment = parse_experiment({"algorithm": name, **raw})
        assert ALGORITHMS[name].client_kwargs(experiment.options) == kwargs
    assert ALGORITHMS["fedprox"].options().mu == 0.01
    with pytest.raises(ConfigError, match="fedprox.mu"):
        parse_experiment({"algorithm": "fedprox", "fedprox.mu": -1.0})
    with pytest.raises(ConfigError, match="fedprox-ft.epochs"):
        parse_experiment({"algorithm": "fedprox-ft", "fedprox-ft.epochs": -1})
