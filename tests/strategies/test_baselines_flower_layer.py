"""The baselines' Flower layer and the shared training loop, message by message, against
independent computations: FedAvg's sample weighting, which parameter group each client trains
in which phase and keeps in ``context.state``, what crosses the wire, fine-tuning at evaluation,
per-domain loss weighting, regularizers, optimizer settings and evaluation counting.

Every loader here is unshuffled, so each client's training is deterministic and can be replayed
step for step with :func:`flwr_pfl.training.train` on a copy of the model.
"""

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

from flwr_pfl.clients import FedAvgClient, FedPerClient, FedRepClient, FinetuneClient, LocalClient
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.strategies import FedAvg, FedRep
from flwr_pfl.training import evaluate, get_arrays, group_shapes, set_arrays, train
from flwr_pfl.training.optim import OptimizerConfig

from fakes import FakeProxy, fit_res
from fakes import assert_arrays_close as close

CPU = torch.device("cpu")
LR = 0.3


# ------------------------------------------------------------------------------------ helpers
def make_model(seed: int = 0, num_heads: int = 1) -> EncoderHeadModel:
    torch.manual_seed(seed)
    return EncoderHeadModel(nn.Sequential(nn.Linear(5, 4), nn.Tanh()), 4, 3, num_heads=num_heads)


def make_data(n: int = 20, seed: int = 0, batch_size: int = 8, num_domains: int = 1) -> LocalData:
    g = torch.Generator().manual_seed(100 + seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 5, generator=g) + y[:, None].float()
    d = (torch.arange(n) % 4 == 0).long() if num_domains > 1 else torch.zeros(n, dtype=torch.long)
    train_set = TensorDataset(x, y, d)
    test_set = TensorDataset(x[: n // 2] + 0.5, y[: n // 2], d[: n // 2])
    return LocalData(DataLoader(train_set, batch_size=batch_size, shuffle=False),
                     DataLoader(test_set, batch_size=4, shuffle=False), num_domains=num_domains)


def context(pid: int = 0) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})


def train_config(local_epochs: int = 2) -> TrainConfig:
    return TrainConfig(local_epochs=local_epochs, batch_size=8, optimizer=OptimizerConfig("sgd", LR), device="cpu")


def replay(model: EncoderHeadModel, data: LocalData, *phases: tuple[tuple[str, ...], int]) -> list[float]:
    """Train ``model`` in place phase by phase, as a client should; returns each phase's loss."""
    return [train(model, data.train, optimizer=OptimizerConfig("sgd", LR), device=CPU, epochs=epochs, groups=groups).loss
            for groups, epochs in phases]


def differ(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return any(not np.allclose(x, y, atol=1e-6) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------ FedAvg server
def test_fedavg_aggregate_fit_weights_replies_by_example_count():
    shapes = [(4, 5), (4,)]
    s = FedAvg(num_clients=3, initial_arrays=[np.zeros(sh, np.float32) for sh in shapes])
    rng = np.random.default_rng(0)
    sizes = [5, 20, 75]
    client_arrays = [[rng.standard_normal(sh).astype(np.float32) for sh in shapes] for _ in sizes]
    results = [(FakeProxy(str(i)), fit_res(a, n, i)) for i, (a, n) in enumerate(zip(client_arrays, sizes))]
    params, metrics = s.aggregate_fit(1, results, [])
    out = parameters_to_ndarrays(params)
    w = np.array(sizes, float) / sum(sizes)
    close(out, [sum(wi * a[k] for wi, a in zip(w, client_arrays)) for k in range(2)])
    assert metrics["num_failures"] == 0.0
    close(s.global_arrays, out)  # the server keeps the new global model for the next round


def test_fedrep_server_averages_bodies_by_example_count():
    model = make_model()
    body = get_arrays(model, "body")
    s = FedRep(num_clients=2, initial_arrays=body)
    a, b = [np.ones_like(x) for x in body], [np.full_like(x, 4.0) for x in body]
    results = [(FakeProxy("a"), fit_res(a, 30, 0)), (FakeProxy("b"), fit_res(b, 10, 1))]
    out = parameters_to_ndarrays(s.aggregate_fit(1, results, [])[0])
    close(out, [np.full_like(x, 1.75) for x in body])  # (30 * 1 + 10 * 4) / 40


# ------------------------------------------------------------------------------------ clients
def test_fedavg_client_trains_everything_and_returns_the_whole_model():
    data = make_data()
    client = FedAvgClient(context(), make_model(), data, train_config(local_epochs=2))
    start = get_arrays(client.model, "all")
    reference = make_model(seed=5)
    set_arrays(reference, start, "all")
    (loss,) = replay(reference, data, (("all",), 2))
    arrays, n, metrics = client.fit(start, {"server-round": 1})
    assert n == 20 and metrics["partition_id"] == 0
    close(arrays, get_arrays(reference, "all"))
    assert metrics["train_loss"] == pytest.approx(loss, rel=1e-6)


def test_fedrep_trains_the_head_alone_then_the_body_alone_and_keeps_the_head():
    """FedRep (Alg. 1): head_epochs on the head with the body frozen, then local_epochs on the
    body with the head frozen; the body goes back, the head stays in context.state."""
    data, ctx = make_data(), context()
    client = FedRepClient(ctx, make_model(), data, train_config(local_epochs=2), head_epochs=3)
    received = [a + 0.1 for a in get_arrays(client.model, "body")]  # the server's body
    reference = copy.deepcopy(client.model)
    set_arrays(reference, received, "body")
    head_loss, body_loss = replay(reference, data, (("heads",), 3), (("body",), 2))
    arrays, n, metrics = client.fit(received, {"server-round": 1})
    assert [a.shape for a in arrays] == group_shapes(client.model, "body") and n == 20
    close(arrays, get_arrays(reference, "body"))
    close(ctx.state["personal"].to_numpy_ndarrays(), get_arrays(reference, "heads"))
    assert metrics["train_loss"] == pytest.approx(body_loss, rel=1e-6)
    assert metrics["head_loss"] == pytest.approx(head_loss, rel=1e-6)
    # the next round's client object (a new one, as the engine builds) starts from the kept head
    again = FedRepClient(ctx, make_model(seed=9), data, train_config(), head_epochs=3)
    close(get_arrays(again.model, "heads"), get_arrays(reference, "heads"))


def test_fedper_trains_jointly_sends_the_body_and_keeps_the_head():
    data, ctx = make_data(), context()
    client = FedPerClient(ctx, make_model(), data, train_config(local_epochs=2))
    received = get_arrays(client.model, "body")
    reference = copy.deepcopy(client.model)
    replay(reference, data, (("all",), 2))
    arrays, _, _ = client.fit(received, {"server-round": 1})
    assert [a.shape for a in arrays] == group_shapes(client.model, "body")  # no head on the wire
    close(arrays, get_arrays(reference, "body"))
    close(ctx.state["personal"].to_numpy_ndarrays(), get_arrays(reference, "heads"))
    again = FedPerClient(ctx, make_model(seed=9), data, train_config())
    close(get_arrays(again.model, "heads"), get_arrays(reference, "heads"))
    assert differ(get_arrays(again.model, "heads"), get_arrays(make_model(seed=9), "heads"))


def test_local_client_sends_nothing_and_resumes_its_whole_model():
    data, ctx = make_data(), context()
    client = LocalClient(ctx, make_model(), data, train_config(local_epochs=2))
    reference = copy.deepcopy(client.model)
    replay(reference, data, (("all",), 2))
    arrays, n, metrics = client.fit([], {"server-round": 1})
    assert arrays == [] and n == 20 and "train_loss" in metrics
    again = LocalClient(ctx, make_model(seed=9), data, train_config())
    close(get_arrays(again.model, "all"), get_arrays(reference, "all"))
    loss, n_test, _ = again.evaluate([], {"server-round": 1})
    assert loss == pytest.approx(evaluate(reference, data.test, device=CPU).loss, rel=1e-6) and n_test == 10


def test_finetune_evaluates_the_finetuned_copy_beside_the_global_model():
    data = make_data()
    client = FinetuneClient(context(), make_model(), data, train_config(local_epochs=1), finetune_epochs=3)
    received = [a * 0.5 for a in get_arrays(client.model, "all")]
    global_model = make_model()
    set_arrays(global_model, received, "all")
    tuned = copy.deepcopy(global_model)
    replay(tuned, data, (("all",), 3))
    expected_global, expected = evaluate(global_model, data.test, device=CPU), evaluate(tuned, data.test, device=CPU)
    assert abs(expected.loss - expected_global.loss) > 1e-3  # fine-tuning visibly changes the model
    loss, n, metrics = client.evaluate(received, {"server-round": 1})
    assert n == 10
    assert loss == pytest.approx(expected.loss, rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(expected.accuracy)
    assert metrics["global_loss"] == pytest.approx(expected_global.loss, rel=1e-5)
    assert metrics["global_accuracy"] == pytest.approx(expected_global.accuracy)


# ------------------------------------------------------------------------------------ train loop
def _one_step_reference(model, x, y, d, *, lr, weights=None, reg=None):
    """One plain SGD step on mean_j(u_{d_j} l_j) (+ reg), computed without the train loop."""
    params = [p for p in model.parameters()]
    losses = F.cross_entropy(model(x, d), y, reduction="none")
    if weights is not None:
        losses = losses * weights[d]
    total = losses.mean() + (reg(model) if reg is not None else 0.0)
    grads = torch.autograd.grad(total, params)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p -= lr * g
    return float(losses.mean().detach())


def test_train_weights_each_sample_by_its_domain_weight():
    """Eq. 6: the step loss is (1/|B|) sum_j u_{z_j} l_j, with two domains of unequal size."""
    data = make_data(num_domains=2)
    x, y, d = data.train.dataset.tensors
    u = torch.tensor([0.3, 2.5])
    model, reference = make_model(num_heads=2), make_model(num_heads=2)
    loss = _one_step_reference(reference, x, y, d, lr=0.5, weights=u)
    stats = train(model, DataLoader(data.train.dataset, batch_size=len(x)), optimizer=OptimizerConfig("sgd", 0.5),
                  device=CPU, domain_weights=u)
    close(get_arrays(model), get_arrays(reference))
    assert stats.loss == pytest.approx(loss, rel=1e-6) and stats.steps == 1


def test_train_adds_the_regularizer_to_the_step_but_reports_the_data_loss():
    data = make_data()
    x, y, d = data.train.dataset.tensors

    def reg(m):
        return 0.7 * sum((p ** 2).sum() for p in m.encoder.parameters())

    model, reference = make_model(), make_model()
    loss = _one_step_reference(reference, x, y, d, lr=0.5, reg=reg)
    stats = train(model, DataLoader(data.train.dataset, batch_size=len(x)), optimizer=OptimizerConfig("sgd", 0.5),
                  device=CPU, regularizer=reg)
    close(get_arrays(model), get_arrays(reference))
    assert stats.loss == pytest.approx(loss, rel=1e-6)  # TrainStats.loss is before the regularizer


def test_train_only_updates_the_named_groups():
    data = make_data()
    model = make_model()
    body, heads = get_arrays(model, "body"), get_arrays(model, "heads")
    train(model, data.train, optimizer=OptimizerConfig("sgd", 0.5), device=CPU, epochs=2, groups=("heads",))
    close(get_arrays(model, "body"), body, atol=0)
    assert differ(get_arrays(model, "heads"), heads)


def test_sgd_uses_the_configured_momentum_and_weight_decay():
    data = make_data()
    loader = DataLoader(data.train.dataset, batch_size=len(data.train.dataset))
    model, reference = make_model(), make_model()
    train(model, loader, optimizer=OptimizerConfig("sgd", 0.2, momentum=0.9, weight_decay=0.05), device=CPU, epochs=3)
    opt = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9, weight_decay=0.05)
    x, y, d = data.train.dataset.tensors
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(reference(x, d), y).backward()
        opt.step()
    close(get_arrays(model), get_arrays(reference))


def test_scaled_optimizer_multiplies_only_the_learning_rate():
    config = OptimizerConfig("sgd", 0.2, momentum=0.5, weight_decay=0.01)
    assert config.scaled(0.25) == OptimizerConfig("sgd", 0.05, momentum=0.5, weight_decay=0.01)


# ------------------------------------------------------------------------------------ evaluation
def test_evaluate_counts_samples_not_batches_and_pools_per_domain_figures():
    """Mean loss over samples, accuracy, and per-domain n / mean loss / accuracy, with batches
    of 3 over 20 samples (a partial last batch) and two domains of 5 and 15 samples."""
    data = make_data(num_domains=2)
    model = make_model(num_heads=2)
    x, y, d = data.train.dataset.tensors
    loader = DataLoader(data.train.dataset, batch_size=3, shuffle=False)
    result = evaluate(model, loader, device=CPU, num_domains=2)
    with torch.no_grad():
        out = model(x, d)
        losses = F.cross_entropy(out, y, reduction="none").double()
        hits = (out.argmax(1) == y).double()
    assert result.num_examples == 20
    assert result.loss == pytest.approx(float(losses.mean()), rel=1e-6)
    assert result.accuracy == pytest.approx(float(hits.mean()))
    metrics = result.metrics()
    for m in (0, 1):
        mask = d == m
        assert metrics[f"n_d{m}"] == float(mask.sum()) and int(mask.sum()) in (5, 15)
        assert metrics[f"loss_d{m}"] == pytest.approx(float(losses[mask].mean()), rel=1e-6)
        assert metrics[f"acc_d{m}"] == pytest.approx(float(hits[mask].mean()))
