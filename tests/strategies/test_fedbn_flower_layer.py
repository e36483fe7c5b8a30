"""FedBN (Li et al., ICLR 2021) in the Flower layer: the normalisation layers, found by module type
whatever their names, never cross the wire and differ across clients; the rest is the
example-weighted mean of two clients of unequal sizes. Loaders are unshuffled so each client's
training can be replayed with :func:`flwr_pfl.training.train`."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.common import parameters_to_ndarrays
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fakes import FakeProxy, fit_res
from fakes import assert_arrays_close as close
from flwr_pfl.clients import FedBNClient
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.clients.fedbn import normalization_keys
from flwr_pfl.strategies import FedBN
from flwr_pfl.training import OptimizerConfig, evaluate, train

CPU = torch.device("cpu")
LR, EPOCHS = 0.2, 2
SIZES = (12, 30)


class NormNet(nn.Module):
    """A user's model whose normalisation layers have names that say nothing: ``scale``
    (BatchNorm1d) and ``mix`` (GroupNorm); ``lin``/``out`` are Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.scale = nn.BatchNorm1d(6)
        self.mix = nn.GroupNorm(2, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.scale(self.lin(x)))))


NORM_KEYS = ["scale.weight", "scale.bias", "scale.running_mean", "scale.running_var", "scale.num_batches_tracked",
             "mix.weight", "mix.bias"]
SHARED_KEYS = ["lin.weight", "lin.bias", "out.weight", "out.bias"]


def make_net(seed: int = 0) -> NormNet:
    torch.manual_seed(seed)
    return NormNet()


def make_data(n: int, seed: int) -> LocalData:
    g = torch.Generator().manual_seed(300 + seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 5, generator=g) * (1 + 2 * seed) + y[:, None].float() + 3 * seed  # feature shift
    d = torch.zeros(n, dtype=torch.long)
    test = TensorDataset(x[: n // 2] + 0.2, y[: n // 2], d[: n // 2])
    return LocalData(DataLoader(TensorDataset(x, y, d), batch_size=6, shuffle=False), DataLoader(test, batch_size=4))


def context(pid: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})


def train_config() -> TrainConfig:
    return TrainConfig(local_epochs=EPOCHS, batch_size=6, optimizer=OptimizerConfig("sgd", LR), device="cpu")


def state_arrays(net: nn.Module, keys: list[str]) -> list[np.ndarray]:
    state = net.state_dict()
    return [state[k].detach().numpy().copy() for k in keys]


def load(net: nn.Module, keys: list[str], arrays: list[np.ndarray]) -> None:
    state = net.state_dict()
    with torch.no_grad():
        for k, a in zip(keys, arrays):
            state[k].copy_(torch.as_tensor(a))


def test_normalisation_layers_are_found_by_module_type():
    assert normalization_keys(make_net()) == NORM_KEYS
    layer_norm = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2), nn.InstanceNorm1d(2, affine=True))
    assert normalization_keys(layer_norm) == ["1.weight", "1.bias", "2.weight", "2.bias"]
    assert normalization_keys(nn.Sequential(nn.Linear(2, 2))) == []


def test_fedbn_keeps_the_norm_layers_local_and_the_server_averages_the_rest_by_example_count():
    global_shared = [a * 0.9 for a in state_arrays(make_net(), SHARED_KEYS)]
    replies, references, contexts = [], [], []
    for pid, n in enumerate(SIZES):
        data, ctx = make_data(n, pid), context(pid)
        client = FedBNClient(ctx, make_net(seed=pid + 1), data, train_config())
        assert [k.removeprefix("module.") for k in client.wire_names()] == SHARED_KEYS
        assert client.user_wire_names() == SHARED_KEYS
        reference = copy.deepcopy(client.model)  # this client's own (initial) norm layers
        load(reference, client.wire_names(), global_shared)
        train(reference, data.train, optimizer=OptimizerConfig("sgd", LR), device=CPU, epochs=EPOCHS)
        arrays, num_examples, metrics = client.fit([a.copy() for a in global_shared], {"server-round": 1})
        assert num_examples == n and len(arrays) == len(SHARED_KEYS)
        close(arrays, state_arrays(reference, client.wire_names()), atol=1e-5)
        kept = ctx.state[FedBNClient.PERSONAL_KEY].to_numpy_ndarrays()
        close(kept, state_arrays(reference, client.local_keys), atol=1e-5)
        replies.append((FakeProxy(str(pid)), fit_res(arrays, num_examples, pid)))
        references.append(reference)
        contexts.append((ctx, data))
    # the two clients' norm layers differ (their own data, their own statistics)
    norms = [state_arrays(r, [f"module.{k}" for k in NORM_KEYS]) for r in references]
    assert all(not np.allclose(a, b) for a, b in zip(norms[0], norms[1]))
    strategy = FedBN(num_clients=2, initial_arrays=global_shared)
    out = parameters_to_ndarrays(strategy.aggregate_fit(1, replies, [])[0])
    w = np.array(SIZES, float) / sum(SIZES)
    sent = [parameters_to_ndarrays(res.parameters) for _, res in replies]
    close(out, [w[0] * a + w[1] * b for a, b in zip(*sent)], atol=1e-6)
    # next round: a new client object (as the engine builds) has its own norm layers back and
    # evaluates the new global rest with them
    for pid, ((ctx, data), reference) in enumerate(zip(contexts, references)):
        again = FedBNClient(ctx, make_net(seed=9), data, train_config())
        close(state_arrays(again.model, again.local_keys), state_arrays(reference, again.local_keys), atol=0)
        expected_model = copy.deepcopy(reference)
        load(expected_model, again.wire_names(), out)
        loss, n_test, _ = again.evaluate([a.copy() for a in out], {"server-round": 2})
        assert loss == pytest.approx(evaluate(expected_model, data.test, device=CPU).loss, rel=1e-5)
        assert n_test == len(data.test.dataset)


def test_a_model_without_normalisation_layers_is_fedavg_with_a_warning(caplog, monkeypatch):
    monkeypatch.setattr("flwr_pfl.clients.fedbn._WARNED", set())
    net = nn.Sequential(nn.Linear(5, 3))
    with caplog.at_level(logging.WARNING):
        client = FedBNClient(context(0), net, make_data(12, 0), train_config())
    assert "no normalisation layer" in caplog.text
    assert len(client.get_parameters({})) == len(net.state_dict())
