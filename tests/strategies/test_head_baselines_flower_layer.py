"""LG-FedAvg (Liang et al., 2020) and FedBABU (Oh et al., ICLR 2022) in the Flower layer, with a
model whose body has BatchNorm: two clients of unequal sizes, non-default options, unshuffled
loaders so each client's training can be replayed with :func:`flwr_pfl.training.train`."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.common import parameters_to_ndarrays
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fakes import FakeProxy, fit_res
from fakes import assert_arrays_close as close
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.clients import FedBABUClient, LGFedAvgClient
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.errors import ConfigError
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.strategies import FedBABU, LGFedAvg
from flwr_pfl.training import OptimizerConfig, evaluate, get_arrays, group_keys, set_arrays, train

CPU = torch.device("cpu")
LR, EPOCHS = 0.2, 2
SIZES = (12, 30)


def make_model(seed: int = 0) -> EncoderHeadModel:
    torch.manual_seed(seed)
    return EncoderHeadModel(nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh()), 4, 3)


def make_data(n: int, seed: int) -> LocalData:
    g = torch.Generator().manual_seed(400 + seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 5, generator=g) + y[:, None].float() * (1 + seed)
    d = torch.zeros(n, dtype=torch.long)
    test = TensorDataset(x[: n // 2] + 0.3, y[: n // 2], d[: n // 2])
    return LocalData(DataLoader(TensorDataset(x, y, d), batch_size=6, shuffle=False), DataLoader(test, batch_size=4))


def context(pid: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})


def train_config() -> TrainConfig:
    return TrainConfig(local_epochs=EPOCHS, batch_size=6, optimizer=OptimizerConfig("sgd", LR), device="cpu")


def weighted(replies, sizes):
    """The example-weighted mean of two replies (integer buffers, the step counter, rounded)."""
    w = np.array(sizes, float) / sum(sizes)
    means = [w[0] * a.astype(np.float64) + w[1] * b.astype(np.float64) for a, b in zip(*replies)]
    return [np.rint(m) if a.dtype.kind in "iu" else m for m, a in zip(means, replies[0])]


# ------------------------------------------------------------------------------------ LG-FedAvg
def test_lg_fedavg_keeps_each_body_and_the_server_averages_the_heads_by_example_count():
    global_head = [a * 0.5 for a in get_arrays(make_model(), "heads")]
    replies, references, states = [], [], []
    for pid, n in enumerate(SIZES):
        data, ctx = make_data(n, pid), context(pid)
        client = LGFedAvgClient(ctx, make_model(seed=pid + 1), data, train_config())  # its own body
        reference = copy.deepcopy(client.model)
        set_arrays(reference, global_head, "heads")
        train(reference, data.train, optimizer=OptimizerConfig("sgd", LR), device=CPU, epochs=EPOCHS)  # jointly
        arrays, num_examples, _ = client.fit([a.copy() for a in global_head], {"server-round": 1})
        assert client.wire_names() == group_keys(client.model, "heads")  # no body tensor on the wire
        assert num_examples == n
        close(arrays, get_arrays(reference, "heads"), atol=1e-5)
        close(ctx.state["personal"].to_numpy_ndarrays(), get_arrays(reference, "body"), atol=1e-5)
        replies.append(arrays)
        references.append(reference)
        states.append((ctx, data))
    bodies = [get_arrays(r, "body") for r in references]
    assert all(not np.allclose(a, b) for a, b in zip(*bodies))  # personal bodies, BatchNorm statistics included
    strategy = LGFedAvg(num_clients=2, initial_arrays=global_head)
    results = [(FakeProxy(str(pid)), fit_res(a, n, pid)) for pid, (a, n) in enumerate(zip(replies, SIZES))]
    out = parameters_to_ndarrays(strategy.aggregate_fit(1, results, [])[0])
    close(out, weighted(replies, SIZES), atol=1e-6)
    for (ctx, data), body in zip(states, bodies):  # the next message's client resumes its body
        again = LGFedAvgClient(ctx, make_model(seed=9), data, train_config())
        close(get_arrays(again.model, "body"), body, atol=0)
        expected = copy.deepcopy(again.model)
        set_arrays(expected, out, "heads")
        loss, _, _ = again.evaluate([a.copy() for a in out], {"server-round": 2})
        assert loss == pytest.approx(evaluate(expected, data.test, device=CPU).loss, rel=1e-5)


# ------------------------------------------------------------------------------------ FedBABU
def test_fedbabu_trains_the_body_only_the_head_stays_bit_identical_and_the_body_is_the_weighted_mean():
    initial = get_arrays(make_model(), "all")
    head_keys = group_keys(make_model(), "heads")
    replies = []
    for pid, n in enumerate(SIZES):
        data = make_data(n, pid)
        client = FedBABUClient(context(pid), make_model(seed=pid + 1), data, train_config(), finetune_epochs=3)
        reference = make_model(seed=7)
        set_arrays(reference, initial, "all")
        train(reference, data.train, optimizer=OptimizerConfig("sgd", LR), device=CPU, epochs=EPOCHS, groups=("body",))
        arrays, num_examples, _ = client.fit([a.copy() for a in initial], {"server-round": 1})
        assert num_examples == n and client.wire_names() == list(make_model().state_dict())
        close(arrays, get_arrays(reference, "all"), atol=1e-5)
        # the head, on the client and in the reply, is the initial head bit for bit
        for got in (get_arrays(client.model, "heads"), arrays[-len(head_keys):]):
            assert all(g.tobytes() == h.tobytes() for g, h in zip(got, initial[-len(head_keys):]))
        assert not np.allclose(arrays[0], initial[0])  # the body did train
        replies.append(arrays)
    strategy = FedBABU(num_clients=2, initial_arrays=initial)
    results = [(FakeProxy(str(pid)), fit_res(a, n, pid)) for pid, (a, n) in enumerate(zip(replies, SIZES))]
    out = parameters_to_ndarrays(strategy.aggregate_fit(1, results, [])[0])
    close(out, weighted(replies, SIZES), atol=1e-6)
    assert all(o.tobytes() == h.tobytes() for o, h in zip(out[-len(head_keys):], initial[-len(head_keys):]))


def test_fedbabu_finetunes_the_whole_model_before_evaluating_and_restores_the_global_model():
    data = make_data(SIZES[1], 1)
    received = [a * 0.9 if a.dtype.kind == "f" else a for a in get_arrays(make_model(), "all")]
    client = FedBABUClient(context(1), make_model(seed=3), data, train_config(), finetune_epochs=3)
    global_model = make_model(seed=8)
    set_arrays(global_model, received, "all")
    tuned = copy.deepcopy(global_model)
    train(tuned, data.train, optimizer=OptimizerConfig("sgd", LR), device=CPU, epochs=3, groups=("all",))
    assert any(not np.allclose(a, b) for a, b in zip(get_arrays(tuned, "heads"), get_arrays(global_model, "heads")))
    expected, expected_global = evaluate(tuned, data.test, device=CPU), evaluate(global_model, data.test, device=CPU)
    loss, n, metrics = client.evaluate([a.copy() for a in received], {"server-round": 1})
    assert n == len(data.test.dataset)
    assert loss == pytest.approx(expected.loss, rel=1e-5)
    assert metrics["global_loss"] == pytest.approx(expected_global.loss, rel=1e-5)
    close(get_arrays(client.model, "all"), received, atol=0)  # the global model, head included, is restored


def test_fedbabu_options_reach_the_client_and_the_default_is_five_epochs():
    assert ALGORITHMS["fedbabu"].options().finetune_epochs == 5
    experiment = parse_experiment({"algorithm": "fedbabu", "fedbabu.finetune-epochs": 2})
    assert ALGORITHMS["fedbabu"].client_kwargs(experiment.options) == {"finetune_epochs": 2}
    assert FedBABUClient(context(0), make_model(), make_data(12, 0), train_config()).finetune_epochs == 5
    with pytest.raises(ConfigError, match="fedbabu.finetune-epochs"):
        parse_experiment({"algorithm": "fedbabu", "fedbabu.finetune-epochs": -1})
