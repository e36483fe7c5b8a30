"""Per-FedAvg (Fallah et al., NeurIPS 2020) in the Flower layer, against hand replays of Alg. 1:
two clients of unequal sizes (10 and 18 samples in unshuffled batches of 4, so D, D', D'' are
known batches), non-default alpha and beta, both variants, a model with BatchNorm (its running
statistics move with every training forward pass). The replay takes the inner step on a copy of
the model with plain tensor arithmetic, the HF Hessian-vector product with
torch.autograd.functional.hvp, and the server's aggregate is the example-weighted mean."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Context, RecordDict
from flwr.common import parameters_to_ndarrays
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader, TensorDataset

from fakes import BatchNormDropoutNet, FakeProxy, fit_res
from fakes import assert_arrays_close as close
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.registry import ALGORITHMS
import flwr_pfl.app.entries.perfedavg  # noqa: F401  (registers per-fedavg)
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.clients.perfedavg import PerFedAvgClient
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.perfedavg import PerFedAvg
from flwr_pfl.training import OptimizerConfig, evaluate, get_arrays, set_arrays

CPU = torch.device("cpu")
ALPHA, BETA, EPOCHS, BATCH = 0.2, 0.3, 2, 4
SIZES = (10, 18)


class BNNet(nn.Module):
    """A user's model with BatchNorm (no dropout, so a replay is exact): Linear, BatchNorm1d, tanh,
    Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 6)
        self.bn = nn.BatchNorm1d(6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, domain: torch.Tensor | None = None) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def make_net(seed: int = 0) -> BNNet:
    """In float64: BatchNorm over the batches of 2 samples amplifies float32 rounding past what a
    replay can match."""
    torch.manual_seed(seed)
    return BNNet().double()


def make_data(n: int, seed: int, shuffle: bool = False) -> LocalData:
    g = torch.Generator().manual_seed(400 + seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 5, generator=g, dtype=torch.float64) + y[:, None].double() * (1 + seed)
    d = torch.zeros(n, dtype=torch.long)
    test = TensorDataset(x[: n // 2] + 0.3, y[: n // 2], d[: n // 2])
    return LocalData(DataLoader(TensorDataset(x, y, d), batch_size=BATCH, shuffle=shuffle), DataLoader(test, batch_size=4))


def context(pid: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})


def train_config() -> TrainConfig:
    return TrainConfig(local_epochs=EPOCHS, batch_size=BATCH, optimizer=OptimizerConfig("sgd", BETA), device="cpu")


def client(pid: int, variant: str, ctx: Context | None = None, net: nn.Module | None = None, **kwargs) -> PerFedAvgClient:
    return PerFedAvgClient(ctx or context(pid), net or make_net(3), make_data(SIZES[pid], pid), train_config(),
                           **({"alpha": ALPHA, "variant": variant} | kwargs))


def global_arrays() -> list[np.ndarray]:
    arrays = get_arrays(make_net(0), "all")
    return [a * 1.1 if a.dtype.kind == "f" else a for a in arrays]


# ------------------------------------------------------------------------------ the hand replay
def batches(data: LocalData) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y, _ = data.train.dataset.tensors
    return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]


def ce(net: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(net(batch[0]), batch[1])


def replay(start: list[np.ndarray], data: LocalData, variant: str, beta: float = BETA):
    """Alg. 1 step by step: epochs of ceil(len(batches) / k) meta steps on consecutive batches,
    cycling; the inner step on a copy, BatchNorm statistics carried from pass to pass."""
    net = make_net(7)
    set_arrays(net, start, "all")
    net.train()
    k = 3 if variant == "hf" else 2
    pool = batches(data)
    steps = EPOCHS * -(-len(pool) // k)
    stream = [pool[i % len(pool)] for i in range(steps * k)]
    losses, adapted = [], []
    for s in range(steps):
        d0, d1, *rest = stream[s * k:(s + 1) * k]
        params = list(net.parameters())
        loss = ce(net, d0)
        grads = torch.autograd.grad(loss, params)
        temp = copy.deepcopy(net)  # buffers after the D pass
        with torch.no_grad():
            for p, g in zip(temp.parameters(), grads):
                p -= ALPHA * g
        adapted_loss = ce(temp, d1)
        direction = torch.autograd.grad(adapted_loss, list(temp.parameters()))
        for name, buffer in temp.named_buffers():  # the same BatchNorm saw D then D'
            net.get_buffer(name).copy_(buffer)
        if variant == "hf":
            names = [n for n, _ in net.named_parameters()]

            def f(*values):
                return F.cross_entropy(functional_call(net, dict(zip(names, values)), (rest[0][0],)), rest[0][1])

            _, product = torch.autograd.functional.hvp(f, tuple(p.detach() for p in params), direction)
            direction = [g - ALPHA * h for g, h in zip(direction, product)]
        with torch.no_grad():
            for p, g in zip(params, direction):
                p -= beta * g
        losses.append(float(loss.detach()))
        adapted.append(float(adapted_loss.detach()))
    return get_arrays(net, "all"), np.mean(losses), np.mean(adapted), steps


# ------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_each_client_replays_alg1_and_the_server_takes_the_example_weighted_mean(variant):
    start, replies, expected = global_arrays(), [], []
    for pid, n in enumerate(SIZES):
        c = client(pid, variant)
        arrays, num_examples, metrics = c.fit([a.copy() for a in start], {"server-round": 1})
        reference, loss, adapted, steps = replay(start, c.data, variant)
        assert num_examples == n and metrics["partition_id"] == pid and metrics["meta_steps"] == steps
        close(arrays, reference, atol=1e-5)
        assert metrics["train_loss"] == pytest.approx(loss, rel=1e-5)
        assert metrics["adapted_loss"] == pytest.approx(adapted, rel=1e-5)
        assert len(list(c.context.state.keys())) == 0  # nothing is kept between rounds
        replies.append((FakeProxy(str(pid)), fit_res(arrays, num_examples, pid)))
        expected.append(reference)
    strategy = PerFedAvg(num_clients=2, initial_arrays=start)
    out = parameters_to_ndarrays(strategy.aggregate_fit(1, replies, [])[0])
    w = np.array(SIZES, float) / sum(SIZES)
    for got, a, b in zip(out, *expected):
        if np.issubdtype(got.dtype, np.integer):  # num_batches_tracked: the rounded mean
            assert got == np.rint(w[0] * a + w[1] * b)
        else:
            np.testing.assert_allclose(got, w[0] * a + w[1] * b, rtol=1e-5, atol=1e-6)


def test_the_variants_differ_and_the_round_learning_rate_is_beta():
    start = global_arrays()
    fo, _, _ = client(1, "fo").fit([a.copy() for a in start], {"server-round": 1})
    hf, _, _ = client(1, "hf").fit([a.copy() for a in start], {"server-round": 1})
    assert max(np.abs(a - b).max() for a, b in zip(fo, hf) if a.dtype.kind == "f") > 1e-3
    scheduled, _, _ = client(1, "hf").fit([a.copy() for a in start], {"server-round": 1, "learning-rate": 0.05})
    close(scheduled, replay(start, make_data(SIZES[1], 1), "hf", beta=0.05)[0], atol=1e-5)


def test_evaluation_adapts_a_copy_with_alpha_steps_and_leaves_the_received_model_intact():
    start = global_arrays()
    c = client(0, "hf", adapt_steps=2)
    loss, n, metrics = c.evaluate([a.copy() for a in start], {"server-round": 1})
    # by hand: two plain gradient steps of size alpha on batches 1 and 2, BatchNorm in train mode
    net = make_net(9)
    set_arrays(net, start, "all")
    received = copy.deepcopy(net)
    net.train()
    for batch in batches(c.data)[:2]:
        grads = torch.autograd.grad(ce(net, batch), list(net.parameters()))
        with torch.no_grad():
            for p, g in zip(net.parameters(), grads):
                p -= ALPHA * g
    adapted, plain = evaluate(net, c.data.test, device=CPU), evaluate(received, c.data.test, device=CPU)
    assert abs(adapted.loss - plain.loss) > 1e-3
    assert n == len(c.data.test.dataset)
    assert loss == pytest.approx(adapted.loss, rel=1e-5) and metrics["accuracy"] == adapted.accuracy
    assert metrics["global_loss"] == pytest.approx(plain.loss, rel=1e-5)
    close(get_arrays(c.model, "all"), start, atol=0)  # weights and BatchNorm statistics as received
    close([v.numpy() for v in c.personal_state().values()], get_arrays(net, "all"), atol=1e-6)
    no_adapt = client(0, "fo", adapt_steps=0)
    loss0, _, metrics0 = no_adapt.evaluate([a.copy() for a in start], {"server-round": 1})
    assert loss0 == pytest.approx(plain.loss, rel=1e-6) == metrics0["global_loss"]


def test_nothing_persists_a_fresh_client_on_the_same_context_answers_the_same():
    start, ctx = global_arrays(), context(1)
    first = client(1, "fo", ctx=ctx)
    first.fit([a.copy() for a in start], {"server-round": 1})
    answer = first.evaluate([a.copy() for a in start], {"server-round": 2})
    assert len(list(ctx.state.keys())) == 0
    again = client(1, "fo", ctx=ctx).evaluate([a.copy() for a in start], {"server-round": 2})
    assert again == answer
    assert client(1, "fo", ctx=ctx).personal_state() == {}


def test_shuffled_training_with_a_batchnorm_dropout_model_runs_in_both_variants():
    for variant, forwards in (("fo", 2 * 2 * EPOCHS), ("hf", 3 * 2 * EPOCHS)):  # k batches x 2 steps x epochs
        torch.manual_seed(0)
        c = PerFedAvgClient(context(0), BatchNormDropoutNet(), LocalData(
            DataLoader(TensorDataset(torch.randn(14, 6), torch.arange(14) % 3), batch_size=4, shuffle=True),
            DataLoader(TensorDataset(torch.randn(6, 6), torch.arange(6) % 3), batch_size=4)), train_config(),
            head="fc2", alpha=ALPHA, variant=variant)
        arrays, _, metrics = c.fit(c.get_parameters({}), {"server-round": 1})
        assert np.isfinite(metrics["train_loss"]) and len(arrays) == 9
        assert int(arrays[6]) == forwards  # num_batches_tracked: one count per training forward pass


class NoDoubleBackward(torch.autograd.Function):
    """tanh whose backward refuses to build a graph (as torch ops without a second derivative)."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            raise RuntimeError("the derivative for 'NoDoubleBackward' is not implemented")
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class OnceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 4).double(), nn.Linear(4, 3).double()

    def forward(self, x):
        return self.fc2(NoDoubleBackward.apply(self.fc1(x)))


def test_hf_refuses_a_model_without_second_derivatives_and_fo_trains_it():
    start = get_arrays(OnceNet(), "all")
    with pytest.raises(ConfigError, match=r"partition 0: Per-FedAvg \(HF\) needs second derivatives.*per-fedavg.variant"):
        client(0, "hf", net=OnceNet()).fit([a.copy() for a in start], {"server-round": 1})
    arrays, _, _ = client(0, "fo", net=OnceNet()).fit([a.copy() for a in start], {"server-round": 1})
    assert len(arrays) == 4


def test_the_run_config_keys_reach_the_client_and_bad_values_are_refused():
    experiment = parse_experiment({"algorithm": "per-fedavg", "per-fedavg.alpha": 0.02, "per-fedavg.variant": "hf",
                                   "per-fedavg.adapt-steps": 3})
    spec = ALGORITHMS["per-fedavg"]
    assert spec.client_kwargs(experiment.options) == {"alpha": 0.02, "variant": "hf", "adapt_steps": 3}
    assert spec.strategy is PerFedAvg and spec.client is PerFedAvgClient
    defaults = spec.options()
    assert (defaults.alpha, defaults.variant, defaults.adapt_steps) == (0.01, "fo", 1)
    for key, value, message in (("alpha", 0.0, "per-fedavg.alpha"), ("alpha", float("inf"), "per-fedavg.alpha"),
                                ("variant", "so", "per-fedavg.variant='so' is not allowed; choose one of 'fo', 'hf'"),
                                ("adapt-steps", -1, "per-fedavg.adapt-steps")):
        with pytest.raises(ConfigError, match=message):
            parse_experiment({"algorithm": "per-fedavg", f"per-fedavg.{key}": value})
    for kwargs, message in (({"alpha": -1.0}, "alpha"), ({"variant": "so"}, "fo, hf"), ({"adapt_steps": 1.5}, "adapt_steps"),
                            ({"alpha": True}, "alpha must be a finite number > 0"),
                            ({"alpha": "0.1"}, "alpha must be a finite number > 0"),
                            ({"adapt_steps": True}, "adapt_steps must be an integer >= 0")):
        with pytest.raises(ValueError, match=message):
            client(0, **({"variant": "fo"} | kwargs))


def test_a_client_built_by_keywords_keeps_them_and_the_papers_defaults():
    config = train_config()
    c = PerFedAvgClient(context=context(0), model=make_net(3), data=make_data(SIZES[0], 0), train_config=config)
    assert c.train_config is config and (c.alpha, c.variant, c.adapt_steps) == (0.01, "fo", 1)


def test_the_evaluation_keeps_the_adapted_models_own_figures_beside_the_global_ones():
    from flwr_pfl.core.metrics import ONE_CLASS

    c = client(0, "fo", adapt_steps=0)
    collapsed = global_arrays()
    collapsed[-1] = np.array([50.0, 0.0, 0.0], dtype=collapsed[-1].dtype)  # the last bias: class 0 for all
    assert collapsed[-1].shape == (3,)
    _, _, metrics = c.evaluate(collapsed, {"server-round": 1})
    assert metrics[ONE_CLASS] == 1.0 and metrics[f"global_{ONE_CLASS}"] == 1.0
