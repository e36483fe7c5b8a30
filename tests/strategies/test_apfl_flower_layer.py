"""APFL (Deng, Kamani and Mahdavi, 2020, Alg. 1) in the Flower layer, against hand replays of its
local steps: two clients of unequal sizes, full-batch unshuffled loaders, a non-default alpha and a
learned alpha with its own step size, two rounds with a fresh client object per message on the
same context (v and alpha persist in ``context.state``), the server's example-weighted mean, the
mixed model's evaluation, a BatchNorm model's personal buffers, and refused options."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Context, RecordDict
from flwr.common import parameters_to_ndarrays
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flwr_pfl.app.entries.apfl  # noqa: F401  (registers "apfl")
from fakes import BatchNormDropoutNet, FakeProxy, fit_res
from fakes import assert_arrays_close as close
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.clients import FedAvgClient
from flwr_pfl.clients.apfl import APFLClient
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.errors import ConfigError
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.strategies.apfl import APFL
from flwr_pfl.training import OptimizerConfig, get_arrays

LR, ALPHA, ALPHA_LR, EPOCHS = 0.5, 0.3, 0.2, 3
SIZES = (10, 26)


def make_model(seed: int = 0) -> EncoderHeadModel:
    torch.manual_seed(seed)
    return EncoderHeadModel(nn.Sequential(nn.Linear(5, 4), nn.Tanh()), 4, 3)


def make_data(n: int, seed: int) -> LocalData:
    g = torch.Generator().manual_seed(300 + seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 5, generator=g) + y[:, None].float() * (1.5 - seed)
    d = torch.zeros(n, dtype=torch.long)
    test = TensorDataset(x[: n // 2] * 0.8 - 0.2, y[: n // 2], d[: n // 2])
    return LocalData(DataLoader(TensorDataset(x, y, d), batch_size=n, shuffle=False), DataLoader(test, batch_size=4))


def context(pid: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})


def train_config(epochs: int = EPOCHS) -> TrainConfig:
    return TrainConfig(local_epochs=epochs, batch_size=64, optimizer=OptimizerConfig("sgd", LR), device="cpu")


def client(ctx: Context, data: LocalData, **options) -> APFLClient:
    """A fresh client object on ``ctx``, as the engine builds one per message."""
    return APFLClient(ctx, make_model(seed=11), data, train_config(), **options)


# ------------------------------------------------------------------------------ the hand replay
def forward(p: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The model written out: tanh(x W1^T + b1) W2^T + b2 (state_dict order W1, b1, W2, b2)."""
    return torch.tanh(x @ p[0].T + p[1]) @ p[2].T + p[3]


def hand_round(w, v, alpha: float, data: LocalData, alpha_lr: float, lr: float = LR, steps: int = EPOCHS,
               losses: list[tuple[float, float]] | None = None):
    """Alg. 1 by hand: each full-batch step, from the step's iterates (w, v, alpha):
    w -= lr grad f(w); v -= lr d/dv f(alpha v + (1-alpha) w); alpha -= alpha_lr d/dalpha of the same,
    clipped to [0, 1]. Both derivatives through the mixture by autograd on alpha and v directly.
    ``losses`` (when given) receives each step's (f(w), f(v_bar))."""
    x, y, _ = data.train.dataset.tensors
    w = [torch.as_tensor(a).clone() for a in w]
    v = [torch.as_tensor(a).clone() for a in v]
    for _ in range(steps):
        w_leaf = [t.clone().requires_grad_(True) for t in w]
        own = F.cross_entropy(forward(w_leaf, x), y)
        grads_w = torch.autograd.grad(own, w_leaf)
        v_leaf = [t.clone().requires_grad_(True) for t in v]
        a = torch.tensor(alpha, requires_grad=True)
        mixed = [a * pv + (1 - a) * pw for pv, pw in zip(v_leaf, w)]
        personal = F.cross_entropy(forward(mixed, x), y)
        *grads_v, grad_a = torch.autograd.grad(personal, [*v_leaf, a])
        if losses is not None:
            losses.append((float(own), float(personal)))
        w = [t - lr * g for t, g in zip(w, grads_w)]
        v = [t - lr * g for t, g in zip(v, grads_v)]
        alpha = min(1.0, max(0.0, alpha - alpha_lr * float(grad_a)))
    return [t.numpy() for t in w], [t.numpy() for t in v], alpha


def mixed_loss(w, v, alpha: float, loader: DataLoader) -> float:
    x = torch.cat([b[0] for b in loader])
    y = torch.cat([b[1] for b in loader])
    p = [alpha * torch.as_tensor(a) + (1 - alpha) * torch.as_tensor(b) for a, b in zip(v, w)]
    return float(F.cross_entropy(forward(p, x), y))


def stored_personal(ctx: Context) -> list[np.ndarray]:
    return [t.numpy() for t in client(ctx, make_data(SIZES[0], 0)).personal_tensors().values()]


# ------------------------------------------------------------------------------ tests
def test_two_rounds_replay_alg1_with_a_learned_alpha_and_the_server_takes_the_example_weighted_mean():
    global_model = [a * 0.9 for a in get_arrays(make_model(), "all")]
    contexts = [context(pid) for pid in range(len(SIZES))]
    datas = [make_data(n, pid) for pid, n in enumerate(SIZES)]
    expected_v = [[a.copy() for a in global_model] for _ in SIZES]  # v starts at the first received w
    expected_alpha = [ALPHA] * len(SIZES)
    strategy = APFL(num_clients=2, initial_arrays=global_model)
    for server_round in (1, 2):
        replies, expected_w = [], []
        for pid, n in enumerate(SIZES):
            c = client(contexts[pid], datas[pid], alpha=ALPHA, learn_alpha=True, alpha_lr=ALPHA_LR)
            arrays, num_examples, metrics = c.fit([a.copy() for a in global_model], {"server-round": server_round})
            assert num_examples == n and metrics["partition_id"] == pid
            losses: list[tuple[float, float]] = []
            w, v, alpha = hand_round(global_model, expected_v[pid], expected_alpha[pid], datas[pid], ALPHA_LR, losses=losses)
            close(arrays, w, atol=1e-5)
            assert len(losses) == EPOCHS  # one full-batch step an epoch; the figures are the means over steps
            assert metrics["train_loss"] == pytest.approx(np.mean([own for own, _ in losses]), rel=1e-5)
            assert metrics["personal_loss"] == pytest.approx(np.mean([mixed for _, mixed in losses]), rel=1e-5)
            close(stored_personal(contexts[pid]), v, atol=1e-5)
            assert metrics["alpha"] == pytest.approx(alpha, abs=1e-6)
            assert abs(alpha - expected_alpha[pid]) > 1e-3  # alpha did move
            expected_v[pid], expected_alpha[pid] = v, alpha
            replies.append((FakeProxy(str(pid)), fit_res(arrays, num_examples, pid)))
            expected_w.append(w)
        global_model = parameters_to_ndarrays(strategy.aggregate_fit(server_round, replies, [])[0])
        weights = np.array(SIZES, float) / sum(SIZES)
        close(global_model, [weights[0] * a + weights[1] * b for a, b in zip(*expected_w)], atol=1e-5)
    assert abs(expected_alpha[0] - expected_alpha[1]) > 1e-3  # each client has its own alpha
    # evaluation: the mixed model alpha v + (1 - alpha) w with the received w, on the test split
    for pid in range(len(SIZES)):
        c = client(contexts[pid], datas[pid], alpha=ALPHA, learn_alpha=True, alpha_lr=ALPHA_LR)
        loss, n, metrics = c.evaluate([a.copy() for a in global_model], {"server-round": 2})
        assert n == len(datas[pid].test.dataset)
        assert loss == pytest.approx(mixed_loss(global_model, expected_v[pid], expected_alpha[pid], datas[pid].test), rel=1e-5)
        assert metrics["global_loss"] == pytest.approx(mixed_loss(global_model, global_model, 0.0, datas[pid].test), rel=1e-5)
        assert abs(loss - metrics["global_loss"]) > 1e-3
        assert metrics["alpha"] == pytest.approx(expected_alpha[pid], abs=1e-6)
        close(get_arrays(c.model, "all"), global_model, atol=0)  # the global model is back in place
        close(list(c.personal_state().values()), [expected_alpha[pid] * v + (1 - expected_alpha[pid]) * w
                                                  for v, w in zip(expected_v[pid], global_model)], atol=1e-5)


def test_a_fixed_alpha_stays_and_the_global_copy_trains_exactly_as_fedavg():
    data, ctx = make_data(SIZES[1], 1), context(1)
    start = [a * 1.1 for a in get_arrays(make_model(), "all")]
    arrays, _, metrics = client(ctx, data, alpha=ALPHA, learn_alpha=False, alpha_lr=ALPHA_LR).fit(
        [a.copy() for a in start], {"server-round": 1})
    plain, _, _ = FedAvgClient(context(1), make_model(seed=11), data, train_config()).fit(start, {"server-round": 1})
    close(arrays, plain, atol=0)  # f(v_bar) sends no gradient into w
    w, v, alpha = hand_round(start, start, ALPHA, data, alpha_lr=0.0)
    close(stored_personal(ctx), v, atol=1e-5)
    assert metrics["alpha"] == ALPHA and alpha == ALPHA
    assert client(ctx, data, alpha=ALPHA, learn_alpha=False).alpha == ALPHA


def test_alpha_steps_with_the_rounds_learning_rate_when_its_own_is_zero():
    data = make_data(SIZES[0], 0)
    start = get_arrays(make_model(), "all")
    _, _, metrics = client(context(0), data, alpha=0.8, learn_alpha=True, alpha_lr=0.0).fit(
        [a.copy() for a in start], {"server-round": 1, "learning-rate": 0.7})
    _, _, alpha = hand_round(start, start, 0.8, data, alpha_lr=0.7, lr=0.7)  # the round's rate drives all three
    assert metrics["alpha"] == pytest.approx(alpha, abs=1e-6) and abs(alpha - 0.8) > 1e-4


def test_batchnorm_statistics_of_the_mixed_forward_go_to_the_personal_model_and_evaluation_uses_them():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(12, 6, generator=g) * 2 + 1, torch.arange(12) % 3
    d = torch.zeros(12, dtype=torch.long)
    data = LocalData(DataLoader(TensorDataset(x, y, d), batch_size=12), DataLoader(TensorDataset(x, y, d), batch_size=12))
    ctx = context(0)
    config = TrainConfig(local_epochs=1, batch_size=12, optimizer=OptimizerConfig("sgd", LR), device="cpu")

    def fresh() -> APFLClient:
        return APFLClient(ctx, BatchNormDropoutNet(), data, config, head="fc2", alpha=ALPHA, learn_alpha=False)

    first = fresh().get_parameters({})
    fresh().fit([a.copy() for a in first], {"server-round": 1})
    before = fresh().personal_tensors()
    received = [a * 0.5 for a in first]  # a different global model: v != w now
    c = fresh()
    arrays, _, _ = c.fit([a.copy() for a in received], {"server-round": 2})
    after = fresh().personal_tensors()
    # one full-batch step: v's running mean moved by 0.1 towards the batch mean of the MIXED fc1
    w_fc1 = dict(zip(c.wire_names(), received))
    weight = ALPHA * before["module.fc1.weight"] + (1 - ALPHA) * torch.as_tensor(w_fc1["module.fc1.weight"])
    bias = ALPHA * before["module.fc1.bias"] + (1 - ALPHA) * torch.as_tensor(w_fc1["module.fc1.bias"])
    expected = 0.9 * before["module.bn.running_mean"] + 0.1 * (x @ weight.T + bias).mean(0)
    torch.testing.assert_close(after["module.bn.running_mean"], expected, rtol=1e-5, atol=1e-6)
    assert int(after["module.bn.num_batches_tracked"]) == 2 and after["module.bn.num_batches_tracked"].dtype == torch.int64
    # the global copy's statistics are its own forward's, sent to the server
    sent = dict(zip(c.wire_names(), arrays))
    expected_w = 0.9 * w_fc1["module.bn.running_mean"] + 0.1 * (x @ torch.as_tensor(w_fc1["module.fc1.weight"]).T
                                                                + torch.as_tensor(w_fc1["module.fc1.bias"])).mean(0).numpy()
    np.testing.assert_allclose(sent["module.bn.running_mean"], expected_w, rtol=1e-5, atol=1e-6)
    # evaluation: mixed parameters, v's buffers
    e = fresh()
    loss, _, _ = e.evaluate([a.copy() for a in received], {"server-round": 2})
    mixed = e.personal_state()  # with the received w the client now holds: what it evaluated
    for key in ("module.fc1.weight", "module.fc2.bias"):
        torch.testing.assert_close(mixed[key], ALPHA * after[key] + (1 - ALPHA) * torch.as_tensor(w_fc1[key]))
    for key in ("module.bn.running_mean", "module.bn.running_var", "module.bn.num_batches_tracked"):
        torch.testing.assert_close(mixed[key], after[key], rtol=0, atol=0)
    model = BatchNormDropoutNet()
    model.load_state_dict({k.removeprefix("module."): t for k, t in mixed.items()})
    model.eval()
    with torch.no_grad():
        expected_loss = float(F.cross_entropy(model(x), y))
    assert loss == pytest.approx(expected_loss, rel=1e-5)


def test_the_run_config_keys_reach_the_client_and_bad_values_are_refused():
    experiment = parse_experiment({"algorithm": "apfl", "apfl.alpha": 0.25, "apfl.learn-alpha": False, "apfl.alpha-lr": 0.05})
    assert ALGORITHMS["apfl"].client_kwargs(experiment.options) == {"alpha": 0.25, "learn_alpha": False, "alpha_lr": 0.05}
    defaults = ALGORITHMS["apfl"].options()
    assert (defaults.alpha, defaults.learn_alpha, defaults.alpha_lr) == (0.5, True, 0.0)
    for key, bad, allowed in (("alpha", 1.5, r"\[0, 1\]"), ("alpha", -0.2, r"\[0, 1\]"), ("alpha-lr", -1.0, ">= 0")):
        with pytest.raises(ConfigError, match=rf"apfl\.{key}.*{allowed}"):
            parse_experiment({"algorithm": "apfl", f"apfl.{key}": bad})
    with pytest.raises(ValueError, match=r"alpha must be a number in \[0, 1\]"):
        client(context(0), make_data(SIZES[0], 0), alpha=2.0)
    for bad in (float("inf"), True, "0.1"):
        with pytest.raises(ValueError, match="alpha_lr must be a finite number >= 0"):
            client(context(0), make_data(SIZES[0], 0), alpha_lr=bad)


def test_a_client_built_by_keywords_keeps_them_and_the_papers_defaults():
    config = train_config()
    c = APFLClient(context=context(0), model=make_model(), data=make_data(SIZES[0], 0), train_config=config)
    assert c.train_config is config
    assert (c.initial_alpha, c.learn_alpha, c.alpha_lr) == (0.5, True, 0.0)


def test_the_evaluation_keeps_the_mixed_models_own_figures_beside_the_global_ones():
    from flwr_pfl.core.metrics import ONE_CLASS

    data, ctx = make_data(SIZES[1], 1), context(1)
    c = client(ctx, data, alpha=1.0, learn_alpha=False)  # the mixture is v alone
    w = get_arrays(make_model(seed=4), "all")
    collapsed = {k: t.clone() for k, t in c.model.state_dict().items()}
    collapsed[list(collapsed)[-1]] = torch.tensor([50.0, 0.0, 0.0])  # the head's bias: class 0 for every sample
    c.store_personal(collapsed)
    _, _, metrics = c.evaluate([a.copy() for a in w], {"server-round": 1})
    assert metrics[ONE_CLASS] == 1.0 and f"global_{ONE_CLASS}" not in metrics
    assert metrics["alpha"] == 1.0 and {"global_loss", "global_accuracy"} <= set(metrics)


class DomainNet(nn.Module):
    """A model whose output depends on the sample's domain, with a parameter no forward uses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.shift = nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
        self.unused = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + d[:, None].float() * self.shift


def test_a_mixed_step_takes_both_losses_by_domain_and_sums_them_over_its_steps():
    from torch.func import functional_call

    from flwr_pfl.clients.apfl import MixedStep

    torch.manual_seed(0)
    model, alpha = DomainNet(), 0.25
    personal = {k: v + 0.3 for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    step = MixedStep(personal, names, alpha, 0.0, OptimizerConfig("sgd", 0.1), "classification")
    with pytest.raises(RuntimeError, match="^APFL's after_step ran without a loss taken before it$"):
        step.after(model, 0)
    x, y, d = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]), torch.tensor([0, 1, 1, 0, 1])
    own_means, mixed_means = [], []
    for k in range(2):
        w = {n: p.detach().clone() for n, p in model.named_parameters()}
        v = {n: p.detach().clone() for n, p in step.params.items()}
        own = F.cross_entropy(model(x, d), y, reduction="none").detach()
        mixed = F.cross_entropy(functional_call(model, {n: alpha * v[n] + (1 - alpha) * w[n] for n in w}, (x, d)), y,
                                reduction="none").detach()
        total = step.loss(model, x, y, d)
        torch.testing.assert_close(total.detach(), own + mixed)
        total.mean().backward()
        step.after(model, k)
        model.zero_grad()
        own_means.append(float(own.mean()))
        mixed_means.append(float(mixed.mean()))
        with pytest.raises(RuntimeError, match="without a loss taken before it"):
            step.after(model, k)  # one after_step per loss
    assert step.steps == 2
    assert step.global_sum == pytest.approx(sum(own_means)) and step.personal_sum == pytest.approx(sum(mixed_means))
    assert not torch.equal(step.params["lin.weight"], personal["lin.weight"])  # v moved
    torch.testing.assert_close(step.params["unused"].detach(), personal["unused"])  # no gradient: a zero step


def test_a_round_of_one_step_reports_that_steps_losses():
    data, ctx = make_data(SIZES[0], 0), context(0)
    start = get_arrays(make_model(seed=2), "all")
    c = APFLClient(ctx, make_model(seed=11), data, train_config(epochs=1), alpha=ALPHA, learn_alpha=False)
    _, _, metrics = c.fit([a.copy() for a in start], {"server-round": 1})
    losses: list[tuple[float, float]] = []
    hand_round(start, start, ALPHA, data, 0.0, steps=1, losses=losses)
    assert metrics["train_loss"] == pytest.approx(losses[0][0], rel=1e-5)
    assert metrics["personal_loss"] == pytest.approx(losses[0][1], rel=1e-5)
