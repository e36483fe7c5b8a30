"""Ditto (Li et al., ICML 2021, Alg. 1) in the Flower layer, against hand replays: two clients of
unequal sizes (12 and 30 samples), lambda = 0.7 and 3 personal epochs (not the defaults), a user's
model with BatchNorm, full-batch unshuffled loaders so that every step can be replayed, and two
rounds, each on fresh client objects built on the same contexts (as the engine builds them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Context, RecordDict
from flwr.common import parameters_to_ndarrays
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flwr_pfl.app.entries.ditto  # noqa: F401  (registers "ditto")
from fakes import BatchNormDropoutNet, FakeProxy, fit_res, handed_out_seconds
from fakes import assert_arrays_close as close
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.clients import FedAvgClient
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.clients.ditto import DittoClient
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.ditto import Ditto
from flwr_pfl.training import OptimizerConfig

LR, LAM, EPOCHS, PERSONAL_EPOCHS = 0.3, 0.7, 2, 3
SIZES = (12, 30)


class Net(nn.Module):
    """A user's model with BatchNorm (running statistics move in training) and no dropout, so
    that training can be replayed by hand: lin (5 -> 6), bn, tanh, out (6 -> 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.bn(self.lin(x))))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def make_data(n: int, seed: int) -> LocalData:
    g = torch.Generator().manual_seed(500 + seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 5, generator=g) * (1 + seed) + y[:, None].float() * (1 - 2 * seed)  # clients disagree
    test = TensorDataset(x[: n // 2] + 0.4, y[: n // 2])
    return LocalData(DataLoader(TensorDataset(x, y), batch_size=n, shuffle=False), DataLoader(test, batch_size=4))


def context(pid: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})


def train_config() -> TrainConfig:
    return TrainConfig(local_epochs=EPOCHS, batch_size=64, optimizer=OptimizerConfig("sgd", LR), device="cpu")


def client(ctx: Context, pid: int, seed: int = 3) -> DittoClient:
    """A fresh client object on ``ctx`` (its own initial weights: ``seed``)."""
    return DittoClient(ctx, make_net(seed), make_data(SIZES[pid], pid), train_config(),
                       lam=LAM, personal_epochs=PERSONAL_EPOCHS)


# ------------------------------------------------------------------------------ hand replays
def arrays_of(net: nn.Module) -> list[np.ndarray]:
    return [t.detach().numpy().copy() for t in net.state_dict().values()]


def net_from(arrays: list[np.ndarray]) -> Net:
    net = make_net(seed=11)
    net.load_state_dict({k: torch.as_tensor(a) for k, a in zip(net.state_dict(), arrays)})
    return net


def replay(start: list[np.ndarray], data: LocalData, steps: int, anchor: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """``steps`` full-batch SGD steps from ``start`` in train mode (BatchNorm's statistics move):
    on F_k alone, or with ``anchor`` = w^t on F_k(v) + (LAM/2)||v - w^t||^2, whose gradient
    grad F_k(v) + LAM (v - w^t) is written out here (Eq. 2; Alg. 1's personal update)."""
    net = net_from(start)
    centre = dict(net_from(anchor).named_parameters()) if anchor is not None else {}
    x, y = data.train.dataset.tensors
    net.train()
    for _ in range(steps):
        named = list(net.named_parameters())
        grads = torch.autograd.grad(F.cross_entropy(net(x), y), [p for _, p in named])
        with torch.no_grad():
            for (name, p), g in zip(named, grads):
                pull = LAM * (p - centre[name]) if centre else 0.0
                p -= LR * (g + pull)
    return arrays_of(net)


def split_figures(arrays: list[np.ndarray], data: LocalData) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of the model ``arrays`` on the test split, in eval mode."""
    net = net_from(arrays).eval()
    x, y = data.test.dataset.tensors
    with torch.no_grad():
        out = net(x)
    return float(F.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())


def personal_arrays(c: DittoClient) -> list[np.ndarray]:
    return [t.numpy() for t in c.personal_state().values()]


def weighted(replies: list[list[np.ndarray]]) -> list[np.ndarray]:
    w = np.array(SIZES, float) / sum(SIZES)
    return [w[0] * a.astype(np.float64) + w[1] * b.astype(np.float64) for a, b in zip(*replies)]


# ------------------------------------------------------------------------------ the tests
def test_two_rounds_replayed_by_hand_on_fresh_client_objects_and_the_server_mean():
    contexts = [context(0), context(1)]
    w1 = [a * 0.9 if a.dtype.kind == "f" else a for a in arrays_of(make_net())]
    strategy = Ditto(num_clients=2, initial_arrays=w1)
    globals_, personals, replies = [], [], []
    for pid, n in enumerate(SIZES):
        c = client(contexts[pid], pid)
        data = c.data
        arrays, num_examples, metrics = c.fit([a.copy() for a in w1], {"server-round": 1})
        assert num_examples == n and metrics["partition_id"] == pid
        assert set(metrics) >= {"train_loss", "personal_loss", "train_seconds"}
        globals_.append(replay(w1, data, EPOCHS))
        close(arrays, globals_[-1], atol=1e-5)  # the global update: F_k alone, from w^t
        # round 1: v_k starts at w^t, then PERSONAL_EPOCHS steps of Eq. 2 anchored at w^t
        personals.append(replay(w1, data, PERSONAL_EPOCHS, anchor=w1))
        close(personal_arrays(c), personals[-1], atol=1e-5)
        replies.append((FakeProxy(str(pid)), fit_res(arrays, num_examples, pid)))
    w2 = parameters_to_ndarrays(strategy.aggregate_fit(1, replies, [])[0])
    close(w2, weighted(globals_), atol=1e-5)  # FedAvg's example-weighted mean of the global models

    for pid, n in enumerate(SIZES):
        c = client(contexts[pid], pid, seed=pid + 20)  # a new object, other initial weights: same context
        data = c.data
        assert c.has_personal_model()
        close(personal_arrays(c), personals[pid], atol=1e-5)  # v_k survived the new client object
        arrays, _, _ = c.fit([a.copy() for a in w2], {"server-round": 2})
        close(arrays, replay(w2, data, EPOCHS), atol=1e-5)  # the global update ignores v_k
        # v_k continues from its own state, pulled towards the RECEIVED w2
        expected = replay(personals[pid], data, PERSONAL_EPOCHS, anchor=w2)
        close(personal_arrays(c), expected, atol=1e-5)
        # anchored at the client's updated global model instead, or at last round's w1: not this
        wrong = [replay(personals[pid], data, PERSONAL_EPOCHS, anchor=arrays), replay(personals[pid], data, PERSONAL_EPOCHS, anchor=w1)]
        for other in wrong:
            assert max(np.abs(a - b).max() for a, b in zip(other, expected) if a.dtype.kind == "f") > 1e-3

        # evaluation (a fresh object again): v_k on the test split, the received model beside it
        evaluator = client(contexts[pid], pid, seed=40)
        loss, num_examples, metrics = evaluator.evaluate([a.copy() for a in w2], {"server-round": 2})
        personal_loss, personal_acc = split_figures(expected, data)
        global_loss, global_acc = split_figures(w2, data)
        assert abs(personal_loss - global_loss) > 1e-3
        assert num_examples == n // 2
        assert loss == pytest.approx(personal_loss, rel=1e-5)
        assert metrics["accuracy"] == pytest.approx(personal_acc)
        assert metrics["global_loss"] == pytest.approx(global_loss, rel=1e-5)
        assert metrics["global_accuracy"] == pytest.approx(global_acc)
        close(arrays_of(evaluator.model), w2, atol=0)  # the global model is back in the module
        close(personal_arrays(evaluator), expected, atol=1e-5)  # evaluation stored nothing new
        # what export writes: v_k, by state_dict name
        assert list(evaluator.personal_state()) == list(evaluator.model.state_dict())


def test_the_global_update_draws_what_fedavg_draws_and_the_personal_model_stays_apart():
    """Shuffled batches, dropout and BatchNorm: the reply is FedAvg's client's reply bit for bit
    (Ditto trains the global model first, so the personal update cannot shift its draws), round
    after round, while the personal model differs from it."""
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(26, 6, generator=g), torch.arange(26) % 3
    data = LocalData(DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True), DataLoader(TensorDataset(x, y), batch_size=8))
    cfg = TrainConfig(local_epochs=2, batch_size=8, optimizer=OptimizerConfig("sgd", 0.1, momentum=0.5), device="cpu", seed=4)
    torch.manual_seed(0)
    start = [a.detach().numpy().copy() for a in BatchNormDropoutNet().state_dict().values()]
    ditto_ctx, fedavg_ctx = context(1), context(1)
    ours = theirs = start
    for server_round in (1, 2):
        torch.manual_seed(0)
        ditto = DittoClient(ditto_ctx, BatchNormDropoutNet(), data, cfg, head="fc2", lam=LAM, personal_epochs=2)
        torch.manual_seed(0)
        fedavg = FedAvgClient(fedavg_ctx, BatchNormDropoutNet(), data, cfg)
        ours, _, ours_metrics = ditto.fit([a.copy() for a in ours], {"server-round": server_round})
        theirs, _, theirs_metrics = fedavg.fit([a.copy() for a in theirs], {"server-round": server_round})
        close(ours, theirs, atol=0)
        assert ours_metrics["train_loss"] == theirs_metrics["train_loss"]
        assert max(np.abs(a - b).max() for a, b in zip(personal_arrays(ditto), ours) if a.dtype.kind == "f") > 1e-3


def test_before_its_first_fit_a_client_evaluates_and_exports_the_received_model():
    c = client(context(0), 0)
    w = [a * 1.1 if a.dtype.kind == "f" else a for a in arrays_of(make_net(seed=5))]
    loss, _, metrics = c.evaluate([a.copy() for a in w], {"server-round": 1})
    assert loss == pytest.approx(split_figures(w, c.data)[0], rel=1e-5)
    assert metrics["global_loss"] == loss and metrics["global_accuracy"] == metrics["accuracy"]
    assert not c.has_personal_model()
    close(personal_arrays(c), w, atol=0)  # its personalized model, as exported: the model it evaluated


def test_lambda_zero_trains_the_personal_model_on_the_local_loss_alone():
    ctx = context(1)
    w1 = arrays_of(make_net(seed=1))
    w2 = [a * 0.5 if a.dtype.kind == "f" else a for a in w1]
    for server_round, w in ((1, w1), (2, w2)):
        c = DittoClient(ctx, make_net(3), make_data(SIZES[1], 1), train_config(), lam=0.0, personal_epochs=2)
        c.fit([a.copy() for a in w], {"server-round": server_round})
    v1 = replay(w1, c.data, 2)
    close(personal_arrays(c), replay(v1, c.data, 2), atol=1e-5)  # round 2 ignores w2 entirely


def test_the_run_config_keys_reach_the_client_and_bad_values_are_refused():
    spec = ALGORITHMS["ditto"]
    assert spec.strategy is Ditto and spec.client is DittoClient
    experiment = parse_experiment({"algorithm": "ditto", "ditto.lam": 0.25, "ditto.personal-epochs": 4})
    assert spec.client_kwargs(experiment.options) == {"lam": 0.25, "personal_epochs": 4}
    defaults = spec.options()
    assert (defaults.lam, defaults.personal_epochs) == (1.0, 1)
    for key, value in (("ditto.lam", -0.5), ("ditto.lam", float("nan")), ("ditto.lam", float("inf")),
                       ("ditto.personal-epochs", 0)):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            parse_experiment({"algorithm": "ditto", key: value})
    with pytest.raises(ValueError, match="lambda"):
        DittoClient(context(0), make_net(), make_data(12, 0), train_config(), lam=-1.0)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="personal_epochs must be an integer >= 1"):
            DittoClient(context(0), make_net(), make_data(12, 0), train_config(), personal_epochs=bad)


def test_a_client_built_by_keywords_keeps_them_and_the_papers_defaults():
    config = train_config()
    c = DittoClient(context=context(0), model=make_net(), data=make_data(12, 0), train_config=config)
    assert c.train_config is config and (c.lam, c.personal_epochs) == (1.0, 1)


def test_train_seconds_count_the_global_and_the_personal_update(monkeypatch):
    handed = handed_out_seconds(monkeypatch)
    c = client(context(0), 0)
    _, _, metrics = c.fit(arrays_of(make_net(seed=1)), {"server-round": 1})
    assert len(handed) == 2 and metrics["train_seconds"] == sum(handed)
