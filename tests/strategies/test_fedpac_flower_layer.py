"""FedPAC (Xu, Tong and Huang, ICLR 2023) in the Flower layer: three clients of unequal sizes with
skewed labels (each lacks a class), a user's model with BatchNorm and its head named, full-batch
loaders and non-default options, so that a round can be replayed by hand (statistics before
training, head steps, body steps with the alignment loss written out, prototypes after); the
server's FedAvg, count-weighted prototypes and per-client combined heads from the QP; the head
kept in ``context.state`` across fresh client objects; the checkpoint round trip; refusals."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.common import parameters_to_ndarrays
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flwr_pfl.app.entries.fedpac  # noqa: F401  (registers "fedpac")
from fakes import BatchNormDropoutNet, FakeProxy, NumPyProxy, client_manager, fit_res
from fakes import assert_arrays_close as close
from flwr_pfl.app.checkpoint import read_checkpoint, write_checkpoint
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.clients.fedpac import FedPACClient
from flwr_pfl.core.fedpac import HEAD_KEY, combination_weights
from flwr_pfl.errors import ConfigError
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.strategies.fedpac import FedPAC
from flwr_pfl.training import OptimizerConfig

LR, HEAD_LR, LAM, HEAD_EPOCHS = 0.3, 0.9, 2.5, 2
KEY = FedPACClient.PERSONAL_KEY
#: per client: training labels (unequal sizes; client 0 lacks class 2, client 2 lacks class 0)
LABELS = ([0] * 7 + [1] * 3, [0] * 2 + [1] * 4 + [2] * 10, [2] * 5 + [1])
EXTRAS = ["fedpac:prototypes", "fedpac:prototype-counts"]


class SkewNet(nn.Module):
    """A user's model: fc (5 -> 4), BatchNorm1d, tanh, then the head ``head`` (4 -> 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 3)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.bn(self.fc(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def net(seed: int) -> SkewNet:
    torch.manual_seed(seed)
    return SkewNet()


def load(model: nn.Module, arrays: list[np.ndarray]) -> nn.Module:
    model.load_state_dict({k: torch.as_tensor(a) for k, a in zip(model.state_dict(), arrays)})
    return model


def user_arrays(model: nn.Module) -> list[np.ndarray]:
    return [v.detach().numpy().copy() for v in model.state_dict().values()]


def make_data(pid: int) -> LocalData:
    y = torch.tensor(LABELS[pid])
    g = torch.Generator().manual_seed(30 + pid)
    x = torch.randn(len(y), 5, generator=g) + y[:, None].float() * torch.tensor([1.0, -0.5, 0.3, 0.0, 0.8])
    test = TensorDataset(x[::2] + 0.2, y[::2])
    return LocalData(DataLoader(TensorDataset(x, y), batch_size=len(y), shuffle=False), DataLoader(test, batch_size=len(test)))


def context(pid: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})


def train_config() -> TrainConfig:
    return TrainConfig(local_epochs=1, batch_size=32, optimizer=OptimizerConfig("sgd", LR), device="cpu")


def client(pid: int, ctx: Context, seed: int = 11, **kwargs) -> FedPACClient:
    options = {"lam": LAM, "head_epochs": HEAD_EPOCHS, "head_learning_rate": HEAD_LR} | kwargs
    return FedPACClient(ctx, net(seed + pid), make_data(pid), train_config(), head="head", **options)


def global_arrays(protos: np.ndarray | None = None, counts: np.ndarray | None = None) -> list[np.ndarray]:
    """A model (the initial one, scaled) and global prototypes (default: none yet)."""
    model = net(0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    protos = np.zeros((3, 4), np.float32) if protos is None else protos.astype(np.float32)
    counts = np.zeros(3, np.float32) if counts is None else counts.astype(np.float32)
    return [*user_arrays(model), protos, counts]


def mean_nll(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean of -log softmax(logits)[y], written with logsumexp (not F.cross_entropy)."""
    return (torch.logsumexp(logits, 1) - logits[torch.arange(len(y)), y]).mean()


def stats_by_hand(z: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Per-class means, counts and the authors' V, with Python loops over the samples."""
    n = len(y)
    means, counts, v = np.zeros((3, z.shape[1])), np.zeros(3), 0.0
    for k in range(3):
        rows = [z[i] for i in range(n) if y[i] == k]
        if not rows:
            continue
        counts[k] = len(rows)
        means[k] = sum(rows) / len(rows)
        p = len(rows) / n
        v += p * sum(float(r @ r) for r in rows) / len(rows) - p * p * float(means[k] @ means[k])
    return means, counts, v / n


def replay(received: list[np.ndarray], head: list[np.ndarray], pid: int) -> list[np.ndarray]:
    """One round of the client by hand: the reply's arrays."""
    x, y = make_data(pid).train.dataset.tensors
    model = load(SkewNet(), received[:-2])
    with torch.no_grad():
        model.head.weight.copy_(torch.as_tensor(head[0]))
        model.head.bias.copy_(torch.as_tensor(head[1]))
    model.eval()
    with torch.no_grad():
        before, counts, variance = stats_by_hand(model.body(x).double().numpy(), y.numpy())
    with torch.no_grad():  # head phase: the frozen body's BatchNorm in eval mode
        z = model.body(x)
    for _ in range(HEAD_EPOCHS):
        weight, bias = model.head.weight.detach().requires_grad_(), model.head.bias.detach().requires_grad_()
        grads = torch.autograd.grad(mean_nll(z @ weight.T + bias, y), [weight, bias])
        with torch.no_grad():
            model.head.weight.copy_(weight - HEAD_LR * grads[0])
            model.head.bias.copy_(bias - HEAD_LR * grads[1])
    model.train()  # body phase: BatchNorm statistics move once; the head is frozen
    z = model.body(x)
    loss = mean_nll(model.head(z), y)
    protos, global_counts = received[-2], received[-1]
    if global_counts.sum() > 0:
        targets = torch.stack([torch.as_tensor(protos[c] if global_counts[c] > 0 else before[c], dtype=torch.float32)
                               for c in y.tolist()])
        loss = loss + LAM * ((z - targets) ** 2).sum() / z.numel()
    body = [model.fc.weight, model.fc.bias, model.bn.weight, model.bn.bias]
    grads = torch.autograd.grad(loss, body)
    with torch.no_grad():
        for p, g in zip(body, grads):
            p -= LR * g
    model.eval()
    with torch.no_grad():
        after, after_counts, _ = stats_by_hand(model.body(x).double().numpy(), y.numpy())
    return [*user_arrays(model), after, after_counts, before, np.array([variance])]


# ------------------------------------------------------------------------------------ the client
def test_first_round_adopts_the_global_head_trains_head_then_body_without_alignment():
    received = global_arrays()
    for pid in range(3):
        ctx = context(pid)
        arrays, n, metrics = client(pid, ctx).fit([a.copy() for a in received], {"server-round": 1, HEAD_KEY: False})
        assert n == len(LABELS[pid]) and metrics["head_arrays"] == 2
        close(arrays, replay(received, received[7:9], pid), atol=2e-5)
        assert int(arrays[6]) == 1  # num_batches_tracked: one body step, none in the head phase
        close(ctx.state[KEY].to_numpy_ndarrays(), arrays[7:9], atol=0)  # the trained head is kept


@pytest.mark.parametrize("combined", [True, False])
def test_a_fresh_client_object_uses_the_combined_head_or_its_own_and_aligns_to_global_prototypes(combined):
    ctx = context(1)
    first, _, _ = client(1, ctx).fit(global_arrays(), {"server-round": 1, HEAD_KEY: False})
    own = ctx.state[KEY].to_numpy_ndarrays()
    # class 2 has no global prototype: client 1's samples of class 2 align to its own class mean
    received = global_arrays(np.array([[0.5, -0.2, 0.1, 0.9], [-0.7, 0.3, 0.2, 0.0], [0.0] * 4]), np.array([4.0, 9.0, 0.0]))
    sent_head = [np.full((3, 4), 0.2, np.float32), np.array([0.1, -0.3, 0.2], np.float32)]
    received[7:9] = sent_head
    again = client(1, ctx, seed=40)
    close(list(again.personal_state().values()), own, atol=0)
    arrays, _, _ = again.fit([a.copy() for a in received], {"server-round": 2, HEAD_KEY: combined})
    expected = replay(received, sent_head if combined else own, 1)
    close(arrays, expected, atol=2e-5)
    without = replay(received[:-1] + [np.zeros(3, np.float32)], sent_head if combined else own, 1)
    assert not np.allclose(without[0], expected[0], atol=1e-3)  # the alignment term matters here


def test_evaluation_uses_and_keeps_the_combined_head():
    ctx = context(0)
    client(0, ctx).fit(global_arrays(), {"server-round": 1, HEAD_KEY: False})
    own = ctx.state[KEY].to_numpy_ndarrays()
    received = global_arrays()
    received[7:9] = [np.eye(3, 4, dtype=np.float32), np.zeros(3, np.float32)]
    x, y = make_data(0).test.dataset.tensors
    for flag, head in ((False, own), (True, received[7:9])):
        loss, n, metrics = client(0, ctx, seed=5).evaluate([a.copy() for a in received], {"server-round": 1, HEAD_KEY: flag})
        model = load(SkewNet(), [*received[:7], *head]).eval()
        with torch.no_grad():
            logits = model(x)
        assert n == len(y) and loss == pytest.approx(float(mean_nll(logits, y)), rel=1e-5)
        assert metrics["accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))
        close(ctx.state[KEY].to_numpy_ndarrays(), head, atol=0)


def test_the_wire_layout_names_the_users_tensors_then_the_prototypes():
    c = client(0, context(0))
    assert c.user_wire_names() == [*SkewNet().state_dict(), *EXTRAS]
    assert [name for name, _ in c.wire_layout()] == [*(f"module.{k}" for k in SkewNet().state_dict()), *EXTRAS]
    assert [tuple(s) for _, s in c.wire_layout()][-2:] == [(3, 4), (3,)]
    arrays, _, _ = c.fit(c.get_parameters({}), {"server-round": 1})
    assert [a.shape for a in arrays[-4:]] == [(3, 4), (3,), (3, 4), (1,)]


# ------------------------------------------------------------------------------------ the server
def round_one() -> tuple[list[list[np.ndarray]], list[int]]:
    replies = [client(pid, context(pid)).fit(global_arrays(), {"server-round": 1})[0] for pid in range(3)]
    return replies, [len(labels) for labels in LABELS]


def strategy(num_clients: int = 4) -> FedPAC:
    return FedPAC(num_clients=num_clients, initial_arrays=global_arrays())


def hand_qp(i: int, replies: list[list[np.ndarray]]) -> np.ndarray:
    """P_i by the authors' double loop over clients and classes."""
    h = [r[-2] * (r[-3] / r[-3].sum())[:, None] for r in replies]
    v = [float(r[-1][0]) for r in replies]
    p = np.zeros((3, 3))
    for j1, j2 in itertools.product(range(3), repeat=2):
        p[j1, j2] = sum(float(np.dot(h[i][k] - h[j1][k], h[i][k] - h[j2][k])) for k in range(3)) + (v[j1] if j1 == j2 else 0)
    return p


def test_server_averages_the_model_weights_prototypes_by_counts_and_combines_heads_per_client():
    replies, sizes = round_one()
    s = strategy()
    results = [(FakeProxy(str(50 + pid), pid), fit_res(r, n, pid, {"head_arrays": 2})) for pid, (r, n) in enumerate(zip(replies, sizes))]
    out = parameters_to_ndarrays(s.aggregate_fit(1, results, [])[0])
    w = np.array(sizes, float) / sum(sizes)
    for i in range(9):
        mean = sum(wj * r[i].astype(np.float64) for wj, r in zip(w, replies))
        close([out[i]], [np.rint(mean) if replies[0][i].dtype.kind in "iu" else mean], atol=1e-6)
    for k in range(3):  # weighted by each client's count of class k, not by its size
        holders = [r for r in replies if r[-3][k] > 0]
        expected = sum(r[-3][k] * r[-4][k].astype(np.float64) for r in holders) / sum(r[-3][k] for r in holders)
        np.testing.assert_allclose(out[9][k], expected, rtol=1e-5)
        assert out[10][k] == sum(r[-3][k] for r in replies)
    alphas = []
    for i in range(3):
        alpha = combination_weights(hand_qp(i, replies))
        alphas.append(alpha)
        expected = [sum(a * r[j].astype(np.float64) for a, r in zip(alpha, replies)) for j in (7, 8)]
        close(s.heads[i], expected, atol=1e-6)
    assert not np.allclose(alphas[0], alphas[1])  # each client its own weights
    # the instructions: each known client its own head in the head slot, flagged; others the mean
    proxies = [FakeProxy(str(50 + pid), pid) for pid in range(4)]
    instructions = s.configure_fit(2, None, client_manager(proxies))
    assert len(instructions) == 4
    for proxy, ins in instructions:
        arrays, pid = parameters_to_ndarrays(ins.parameters), proxy.pid
        close(arrays[:7] + arrays[9:], out[:7] + out[9:], atol=0)
        assert ins.config[HEAD_KEY] is (pid < 3)
        close(arrays[7:9], s.heads[pid] if pid < 3 else out[7:9], atol=0)
    for proxy, ins in s.configure_evaluate(2, None, client_manager(proxies)):
        assert ins.config[HEAD_KEY] is (proxy.pid < 3)
        close(parameters_to_ndarrays(ins.parameters)[7:9], s.heads[proxy.pid] if proxy.pid < 3 else out[7:9], atol=0)


def test_checkpoint_round_trip_resumes_with_every_clients_combined_head(tmp_path):
    replies, sizes = round_one()
    s = strategy()
    results = [(FakeProxy(str(pid), pid), fit_res(r, n, pid, {"head_arrays": 2})) for pid, (r, n) in enumerate(zip(replies, sizes))]
    s.aggregate_fit(1, results, [])
    saved = read_checkpoint(write_checkpoint(tmp_path, 1, {"algorithm": "fedpac"}, {}, s.state_dict()))
    resumed = strategy()
    resumed.load_state_dict(saved.state, saved.rounds_done)
    assert resumed.head_arrays == 2 and sorted(resumed.heads) == [0, 1, 2]
    for pid in range(4):
        close(resumed.personal_arrays(pid)[0], s.personal_arrays(pid)[0], atol=0)
        assert resumed.personal_arrays(pid)[1] == s.personal_arrays(pid)[1]


def test_bad_replies_are_rejected():
    replies, sizes = round_one()
    s = strategy()
    negative = [a.copy() for a in replies[1]]
    negative[-1][0] = -1.0
    results = [
        (FakeProxy("0", 0), fit_res(replies[0], sizes[0], 0, {"head_arrays": 2})),
        (FakeProxy("1", 1), fit_res(negative, sizes[1], 1, {"head_arrays": 2})),
        (FakeProxy("2", 2), fit_res(replies[2], sizes[2], 2, {"head_arrays": 0})),
        (FakeProxy("3", 3), fit_res(replies[2][:-1], sizes[2], 3, {"head_arrays": 2})),
    ]
    _, metrics = s.aggregate_fit(1, results, [])
    assert metrics["num_rejected"] == 3 and sorted(s.heads) == [0]
    close(s.heads[0], replies[0][7:9], atol=1e-6)  # alone: its own head


def test_two_rounds_through_proxies_deliver_each_client_its_combined_head():
    contexts = [context(pid) for pid in range(3)]
    proxies = [NumPyProxy(str(70 + pid), pid, client(pid, contexts[pid])) for pid in range(3)]
    s = strategy(3)
    cm = client_manager(proxies)
    for rnd in (1, 2):
        results = [(p, p.fit(ins, None, rnd)) for p, ins in s.configure_fit(rnd, None, cm)]
        assert [p.fit_configs[-1][HEAD_KEY] for p in proxies] == [rnd > 1] * 3
        params, metrics = s.aggregate_fit(rnd, results, [])
        assert metrics["num_rejected"] == 0
        for p, ins in s.configure_evaluate(rnd, params, cm):
            p.evaluate(ins, None, rnd)
            close(contexts[p.pid].state[KEY].to_numpy_ndarrays(), s.heads[p.pid], atol=0)


# ------------------------------------------------------------------------------------ models, refusals, options
def test_a_batchnorm_dropout_model_keeps_its_head_and_evaluates_deterministically():
    x = torch.randn(14, 6, generator=torch.Generator().manual_seed(5))
    y = torch.tensor([0] * 10 + [2] * 4)
    data = LocalData(DataLoader(TensorDataset(x, y), batch_size=7, shuffle=True), DataLoader(TensorDataset(x, y), batch_size=14))
    ctx = context(2)
    torch.manual_seed(0)
    first = FedPACClient(ctx, BatchNormDropoutNet(), data, train_config(), head="fc2")
    assert first.user_wire_names() == [*BatchNormDropoutNet().state_dict(), *EXTRAS]
    arrays, _, _ = first.fit(first.get_parameters({}), {"server-round": 1})
    stored = ctx.state[KEY].to_numpy_ndarrays()
    close(stored, arrays[7:9], atol=0)
    torch.manual_seed(9)
    again = FedPACClient(ctx, BatchNormDropoutNet(), data, train_config(), head="fc2")
    close(list(again.personal_state().values()), stored, atol=0)
    handler = type(again).evaluate.__wrapped__  # without the per-message seeding
    answers = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        answers.append(handler(again, [a.copy() for a in arrays[:-2]], {"server-round": 1}))
    assert answers[0] == answers[1]


def test_models_tasks_and_options_the_method_cannot_use_are_refused():
    data, ctx = make_data(0), context(0)
    with pytest.raises(ConfigError, match="head"):
        FedPACClient(ctx, SkewNet(), data, train_config())
    with pytest.raises(ConfigError, match="one head"):
        FedPACClient(ctx, EncoderHeadModel(nn.Linear(5, 4), 4, 3, num_heads=2), data, train_config())
    with pytest.raises(ConfigError, match="classification"):
        FedPACClient(ctx, SkewNet(), LocalData(data.train, data.test, task="regression"), train_config(), head="head")
    for bad in ({"lam": -1.0}, {"head_epochs": 1.5}, {"head_learning_rate": 0}):
        with pytest.raises(ConfigError, match="FedPAC"):
            client(0, ctx, **bad)


def test_the_options_reach_the_client_and_bad_values_name_the_key():
    assert ALGORITHMS["fedpac"].options().lam == 1.0
    experiment = parse_experiment({"algorithm": "fedpac", "fedpac.lam": 0.5, "fedpac.head-epochs": 3,
                                   "fedpac.head-learning-rate": 0.05})
    kwargs = ALGORITHMS["fedpac"].client_kwargs(experiment.options)
    assert kwargs == {"lam": 0.5, "head_epochs": 3, "head_learning_rate": 0.05}
    c = FedPACClient(context(0), net(0), make_data(0), train_config(), head="head", **kwargs)
    assert (c.lam, c.head_epochs, c.head_learning_rate) == (0.5, 3, 0.05)
    for key, value, allowed in (("lam", -0.1, ">= 0"), ("head-epochs", -1, ">= 0"), ("head-learning-rate", 0.0, "> 0")):
        with pytest.raises(ConfigError, match=f"fedpac.{key} must be .*{allowed}"):
            parse_experiment({"algorithm": "fedpac", f"fedpac.{key}": value})
