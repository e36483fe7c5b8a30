"""What every client sets up per message (flwr_pfl.clients.base): the seed a round trains and
evaluates with, and the round's learning rate, both scoped to the message."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_pfl.clients import FedAvgClient, LocalData, TrainConfig
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.training import OptimizerConfig
from flwr_pfl.training.seed import client_seed

SEED, PARTITION = 11, 3


class SeedRecordingClient(FedAvgClient):
    """FedAvg's client that records the seed torch's generator was given, and the learning rate
    it trains with, in each fit and evaluation."""

    seen: list[tuple[str, int, float]]

    def local_update(self, config):
        self.seen.append(("fit", torch.initial_seed(), self.train_config.optimizer.learning_rate))
        return super().local_update(config)

    def local_evaluate(self, config):
        self.seen.append(("evaluate", torch.initial_seed(), self.train_config.optimizer.learning_rate))
        return super().local_evaluate(config)


def make_client(partition: int = PARTITION) -> SeedRecordingClient:
    torch.manual_seed(0)
    model = EncoderHeadModel(nn.Sequential(nn.Linear(5, 4), nn.Tanh()), 4, 3)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(21, 5, generator=g), torch.arange(21) % 3
    data = LocalData(DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True), DataLoader(TensorDataset(x, y), batch_size=8))
    context = Context(run_id=1, node_id=9, node_config={"partition-id": partition}, state=RecordDict(), run_config={})
    client = SeedRecordingClient(context, model, data, TrainConfig(batch_size=4, optimizer=OptimizerConfig("sgd", 0.1), device="cpu", seed=SEED))
    client.seen = []
    return client


def test_each_message_runs_with_the_seed_of_its_client_partition_and_round():
    client = make_client()
    start = client.get_parameters({})
    for server_round in (1, 2, 7):
        client.fit(start, {"server-round": server_round})
        client.evaluate(start, {"server-round": server_round})
    want = [(kind, client_seed(SEED, PARTITION, r), 0.1) for r in (1, 2, 7) for kind in ("fit", "evaluate")]
    assert client.seen == want
    assert len({seed for _, seed, _ in client.seen}) == 3  # the rounds' seeds differ
    other = make_client(PARTITION + 1)
    other.fit(start, {"server-round": 1})
    assert other.seen[0][1] == client_seed(SEED, PARTITION + 1, 1) != client.seen[0][1]


def test_the_rounds_seed_changes_the_shuffle_and_the_same_round_repeats_it():
    """Same arrays, same client state: round 1 twice gives the same bytes, whatever torch drew
    before; round 2 shuffles otherwise and gives other arrays."""
    start = make_client().get_parameters({})

    def fit(server_round: int, noise: int) -> tuple[list[np.ndarray], float]:
        torch.manual_seed(noise)
        arrays, _, metrics = make_client().fit(start, {"server-round": server_round})
        return arrays, metrics["train_loss"]

    (a, loss_a), (b, loss_b), (c, _) = fit(1, 0), fit(1, 99), fit(2, 0)
    assert loss_a == loss_b and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert any(not np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_the_rounds_learning_rate_holds_for_that_message_only():
    client = make_client()
    start = client.get_parameters({})
    client.fit(start, {"server-round": 1, "learning-rate": 0.025})
    client.evaluate(start, {"server-round": 1, "learning-rate": 0.5})
    client.fit(start, {"server-round": 2})
    assert [lr for _, _, lr in client.seen] == [0.025, 0.5, 0.1]
    assert client.train_config.optimizer.learning_rate == 0.1

    # the rate is the one the step used: a rate 4 times smaller moves the arrays 4 times less (one SGD step)
    def moved(lr: float) -> float:
        c = make_client()
        c.data = LocalData(DataLoader(c.data.train.dataset, batch_size=21), c.data.test)
        arrays, _, _ = c.fit(start, {"server-round": 1, "learning-rate": lr})
        return float(sum(np.abs(x - y).sum() for x, y in zip(arrays, start)))

    assert moved(0.025) == pytest.approx(moved(0.1) / 4, rel=1e-4)


def test_a_client_evaluates_its_model_in_eval_mode_when_it_was_left_in_train_mode():
    """A model with dropout: the evaluation a client replies is the eval-mode figure (no unit
    dropped), whatever the round's seed, and equal to evaluating the same weights by hand."""
    torch.manual_seed(0)
    model = EncoderHeadModel(nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.5), nn.Tanh()), 16, 3)
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(30, 5, generator=g), torch.arange(30) % 3
    data = LocalData(DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True), DataLoader(TensorDataset(x, y), batch_size=7))
    context = Context(run_id=1, node_id=9, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    client = FedAvgClient(context, model, data, TrainConfig(batch_size=8, optimizer=OptimizerConfig("sgd", 0.1), device="cpu"))
    trained, _, _ = client.fit(client.get_parameters({}), {"server-round": 1})
    client.model.train()  # as training may leave it
    losses = [client.evaluate(trained, {"server-round": r})[0] for r in (1, 2)]
    with torch.no_grad():
        want = nn.functional.cross_entropy(client.model.eval()(x), y).item()
    assert losses[0] == losses[1] == pytest.approx(want, rel=1e-6)
