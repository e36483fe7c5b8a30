"""FedRoD (Chen and Chao, ICLR 2022) in the Flower layer: two clients of unequal sizes with skewed
labels (one lacks a class), a user's model with BatchNorm and its head named, full-batch loaders,
so that one local step can be replayed by hand (logsumexp written out, autograd per loss, SGD by
hand); the server's FedAvg of body and generic head; the personal head kept in ``context.state``
across fresh client objects and never on the wire; refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.common import parameters_to_ndarrays
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flwr_pfl.app.entries.fedrod  # noqa: F401  (registers "fedrod")
from fakes import BatchNormDropoutNet, FakeProxy, fit_res
from fakes import assert_arrays_close as close
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.clients.fedrod import FedRoDClient
from flwr_pfl.errors import ConfigError
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.strategies.fedrod import FedRoD
from flwr_pfl.training import OptimizerConfig

LR = 0.7
KEY = FedRoDClient.PERSONAL_HEAD_KEY
#: per client: class labels of its training set (unequal sizes; client 0 has no class 2)
LABELS = ([0] * 7 + [1] * 3, [0] * 2 + [1] * 4 + [2] * 10)


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


def user_arrays(model: nn.Module) -> list[np.ndarray]:
    return [v.detach().numpy().copy() for v in model.state_dict().values()]


def load(model: nn.Module, arrays: list[np.ndarray]) -> nn.Module:
    model.load_state_dict({k: torch.as_tensor(a) for k, a in zip(model.state_dict(), arrays)})
    return model


def make_data(pid: int) -> LocalData:
    y = torch.tensor(LABELS[pid])
    g = torch.Generator().manual_seed(70 + pid)
    x = torch.randn(len(y), 5, generator=g) + y[:, None].float() * torch.tensor([1.0, -0.5, 0.3, 0.0, 0.8])
    test = TensorDataset(x[::2] + 0.2, y[::2])
    return LocalData(DataLoader(TensorDataset(x, y), batch_size=len(y), shuffle=False), DataLoader(test, batch_size=len(test)))


def context(pid: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})


def train_config() -> TrainConfig:
    return TrainConfig(local_epochs=1, batch_size=32, optimizer=OptimizerConfig("sgd", LR), device="cpu")


def client(pid: int, ctx: Context, seed: int = 11, **kwargs) -> FedRoDClient:
    return FedRoDClient(ctx, net(seed + pid), make_data(pid), train_config(), head="head", **kwargs)


def global_arrays() -> list[np.ndarray]:
    model = net(0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    return user_arrays(model)


def mean_nll(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean of -log softmax(logits)[y], written with logsumexp (not F.cross_entropy)."""
    return (torch.logsumexp(logits, 1) - logits[torch.arange(len(y)), y]).mean()


def replay(received: list[np.ndarray], personal: list[np.ndarray], pid: int, balanced: bool):
    """One full-batch SGD step by hand: (wire arrays after it, personal head after it, generic
    loss, personal loss). The generic loss shifts the logits by log n_c (-inf for absent
    classes) when ``balanced``; the personal head sees z and g(z) as constants."""
    data = make_data(pid)
    x, y = data.train.dataset.tensors
    model = load(SkewNet(), received).train()
    weight, bias = (torch.tensor(a, requires_grad=True) for a in personal)
    z = model.body(x)  # train mode: the BatchNorm statistics move once
    g = model.head(z)
    counts = torch.tensor([float((y == c).sum()) for c in range(3)])
    shift = torch.log(counts) if balanced else torch.zeros(3)
    generic_loss = mean_nll(g + shift, y)
    personal_loss = mean_nll(g.detach() + z.detach() @ weight.T + bias, y)
    params = list(model.parameters())
    generic_grads = torch.autograd.grad(generic_loss, params)
    personal_grads = torch.autograd.grad(personal_loss, [weight, bias])
    with torch.no_grad():
        for p, grad in zip(params, generic_grads):
            p -= LR * grad
        new_personal = [(t - LR * grad).numpy() for t, grad in zip((weight, bias), personal_grads)]
    return user_arrays(model), new_personal, generic_loss.item(), personal_loss.item()


def weighted(replies, sizes):
    w = np.array(sizes, float) / sum(sizes)
    means = [w[0] * a.astype(np.float64) + w[1] * b.astype(np.float64) for a, b in zip(*replies)]
    return [np.rint(m) if a.dtype.kind in "iu" else m for m, a in zip(means, replies[0])]


# ------------------------------------------------------------------------------------ training
@pytest.mark.parametrize("generic_loss", ["balanced-softmax", "cross-entropy"])
def test_one_full_batch_step_of_unequal_skewed_clients_replayed_by_hand_then_averaged_and_resumed(generic_loss):
    balanced = generic_loss == "balanced-softmax"
    received = global_arrays()
    head = received[-2:]  # the personal head starts as a copy of the received generic head
    replies, contexts = [], []
    for pid in (0, 1):
        ctx = context(pid)
        c = client(pid, ctx, generic_loss=generic_loss)
        arrays, num_examples, metrics = c.fit([a.copy() for a in received], {"server-round": 1})
        expected, personal, loss_g, loss_p = replay(received, head, pid, balanced)
        assert num_examples == len(LABELS[pid])
        close(arrays, expected, atol=1e-6)
        close(ctx.state[KEY].to_numpy_ndarrays(), personal, atol=1e-6)
        assert metrics["generic_loss"] == pytest.approx(loss_g, rel=1e-5)
        assert metrics["personal_loss"] == pytest.approx(loss_p, rel=1e-5)
        assert metrics["train_loss"] == pytest.approx(loss_g + loss_p, rel=1e-5)
        assert int(arrays[6]) == 1  # num_batches_tracked: one step
        if balanced:  # the shift by log n_c matters on these skewed labels
            other, _, _, _ = replay(received, head, pid, balanced=False)
            assert not np.allclose(arrays[0], other[0], atol=1e-4)
        replies.append(arrays)
        contexts.append(ctx)
    strategy = FedRoD(num_clients=2, initial_arrays=received)
    sizes = [len(labels) for labels in LABELS]
    results = [(FakeProxy(str(pid)), fit_res(a, n, pid)) for pid, (a, n) in enumerate(zip(replies, sizes))]
    out = parameters_to_ndarrays(strategy.aggregate_fit(1, results, [])[0])
    close(out, weighted(replies, sizes), atol=1e-6)
    for pid, ctx in enumerate(contexts):  # round 2: a new client object resumes its personal head
        stored = ctx.state[KEY].to_numpy_ndarrays()
        again = client(pid, ctx, seed=40, generic_loss=generic_loss)
        close(list(again.personal_state().values()), stored, atol=0)
        assert list(again.personal_state()) == ["fedrod:personal_head.weight", "fedrod:personal_head.bias"]
        arrays, _, _ = again.fit([a.copy() for a in out], {"server-round": 2})
        expected, personal, _, _ = replay(out, stored, pid, balanced)
        close(arrays, expected, atol=1e-6)
        close(ctx.state[KEY].to_numpy_ndarrays(), personal, atol=1e-6)


def test_the_wire_is_the_users_whole_model_and_the_personal_head_stays_off_it():
    ctx = context(1)
    c = client(1, ctx)
    user_keys = list(SkewNet().state_dict())
    assert c.user_wire_names() == user_keys  # body and the generic head, nothing personal
    arrays, _, _ = c.fit(global_arrays(), {"server-round": 1})
    assert len(arrays) == len(user_keys) == len(c.get_parameters({}))
    personal = ctx.state[KEY].to_numpy_ndarrays()
    assert not np.allclose(personal[0], arrays[-2])  # the personal head is not the generic head
    assert not any(a.shape == p.shape and np.array_equal(a, p) for a in arrays for p in personal)


# ------------------------------------------------------------------------------------ evaluation
def expected_evaluation(received: list[np.ndarray], personal: list[np.ndarray], pid: int) -> tuple[float, float, float, float]:
    """(personalized loss, accuracy, generic loss, accuracy) in eval mode, by hand."""
    x, y = make_data(pid).test.dataset.tensors
    model = load(SkewNet(), received).eval()
    with torch.no_grad():
        z = model.body(x)
        g = model.head(z)
        s = g + z @ torch.as_tensor(personal[0]).T + torch.as_tensor(personal[1])
        return (float(mean_nll(s, y)), float((s.argmax(1) == y).float().mean()),
                float(mean_nll(g, y)), float((g.argmax(1) == y).float().mean()))


def test_evaluation_scores_generic_plus_personal_and_reports_the_generic_head_as_global():
    received = global_arrays()
    ctx = context(0)
    loss, n, metrics = client(0, ctx).evaluate([a.copy() for a in received], {"server-round": 1})
    # before any fit: the personal head is the received generic head (g + g), and nothing is stored
    ploss, pacc, gloss, gacc = expected_evaluation(received, received[-2:], 0)
    assert n == 5 and KEY not in ctx.state
    assert loss == pytest.approx(ploss, rel=1e-5) and metrics["accuracy"] == pytest.approx(pacc)
    assert metrics["global_loss"] == pytest.approx(gloss, rel=1e-5) and metrics["global_accuracy"] == pytest.approx(gacc)
    arrays, _, _ = client(0, ctx).fit([a.copy() for a in received], {"server-round": 1})
    personal = ctx.state[KEY].to_numpy_ndarrays()
    loss, _, metrics = client(0, ctx, seed=3).evaluate([a.copy() for a in arrays], {"server-round": 1})
    ploss, pacc, gloss, gacc = expected_evaluation(arrays, personal, 0)
    assert loss == pytest.approx(ploss, rel=1e-5) and metrics["accuracy"] == pytest.approx(pacc)
    assert metrics["global_loss"] == pytest.approx(gloss, rel=1e-5) and metrics["global_accuracy"] == pytest.approx(gacc)
    assert loss != pytest.approx(gloss, rel=1e-3)
    close(ctx.state[KEY].to_numpy_ndarrays(), personal, atol=0)  # evaluation stores nothing new


def test_a_batchnorm_dropout_model_trains_keeps_its_personal_head_and_evaluates_deterministically():
    x = torch.randn(14, 6, generator=torch.Generator().manual_seed(5))
    y = torch.tensor([0] * 10 + [2] * 4)
    data = LocalData(DataLoader(TensorDataset(x, y), batch_size=7, shuffle=True), DataLoader(TensorDataset(x, y), batch_size=14))
    ctx = context(2)
    torch.manual_seed(0)
    first = FedRoDClient(ctx, BatchNormDropoutNet(), data, train_config(), head="fc2")
    received = first.get_parameters({})
    assert first.user_wire_names() == list(BatchNormDropoutNet().state_dict())
    arrays, _, _ = first.fit(received, {"server-round": 1})
    stored = ctx.state[KEY].to_numpy_ndarrays()
    torch.manual_seed(9)
    again = FedRoDClient(ctx, BatchNormDropoutNet(), data, train_config(), head="fc2")
    close(list(again.personal_state().values()), stored, atol=0)
    exported = {**dict(zip(again.user_wire_names(), map(torch.as_tensor, arrays))), **again.personal_state()}
    loaded = FedRoDClient(context(2), BatchNormDropoutNet(), data, train_config(), head="fc2")
    loaded.load_personal_state(exported)  # an export's clients/<id>.pt: the global entries are ignored
    close(list(loaded.personal_state().values()), stored, atol=0)
    handler = type(again).evaluate.__wrapped__  # without the per-message seeding
    answers = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        answers.append(handler(again, [a.copy() for a in arrays], {"server-round": 1}))
    assert answers[0] == answers[1]


# ------------------------------------------------------------------------------------ refusals and options
def test_models_tasks_labels_and_options_the_method_cannot_use_are_refused_with_what_it_needs():
    data, ctx = make_data(0), context(0)
    with pytest.raises(ConfigError, match="head"):
        FedRoDClient(ctx, SkewNet(), data, train_config())
    with pytest.raises(ConfigError, match="one head"):
        FedRoDClient(ctx, EncoderHeadModel(nn.Linear(5, 4), 4, 3, num_heads=2), data, train_config())
    regression = LocalData(data.train, data.test, task="regression")
    with pytest.raises(ConfigError, match="classification"):
        FedRoDClient(ctx, SkewNet(), regression, train_config(), head="head")
    with pytest.raises(ConfigError, match="balanced-softmax"):
        FedRoDClient(ctx, SkewNet(), data, train_config(), head="head", generic_loss="focal")
    x = torch.randn(4, 5)
    bad = LocalData(DataLoader(TensorDataset(x, torch.tensor([0, 1, 3, 0])), batch_size=4), data.test)
    with pytest.raises(ValueError, match=r"partition 0: .*\[0, 3\)"):
        FedRoDClient(ctx, SkewNet(), bad, train_config(), head="head").fit(global_arrays(), {"server-round": 1})


def test_the_options_reach_the_client_and_bad_values_name_the_key():
    assert ALGORITHMS["fedrod"].options().generic_loss == "balanced-softmax"
    experiment = parse_experiment({"algorithm": "fedrod", "fedrod.generic-loss": "cross-entropy"})
    kwargs = ALGORITHMS["fedrod"].client_kwargs(experiment.options)
    assert kwargs == {"generic_loss": "cross-entropy"}
    assert client(0, context(0), **kwargs).generic_loss == "cross-entropy"
    with pytest.raises(ConfigError, match="fedrod.generic-loss.*'balanced-softmax', 'cross-entropy'"):
        parse_experiment({"algorithm": "fedrod", "fedrod.generic-loss": "bsm"})
