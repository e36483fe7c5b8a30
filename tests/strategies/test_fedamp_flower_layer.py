"""FedAMP (Huang et al., AAAI 2021) in the Flower layer: three clients of unequal sizes and a fourth
never seen, a user's model with BatchNorm, full-batch loaders and non-default alpha_k, lambda and
sigma, so that a round can be replayed by hand (two SGD steps on Eq. 6 from u_i, the proximal
term written out) and the server's cloud models recomputed with loops over the clients (Eq. 5 over
the parameters, each client's own buffers); evaluation of the w_i the server holds; the
checkpoint round trip; bad replies; options."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flwr_pfl.app.entries.fedamp  # noqa: F401  (registers "fedamp")
from fakes import BatchNormDropoutNet, FakeProxy, NumPyProxy, client_manager, fit_res
from fakes import assert_arrays_close as close
from flwr_pfl.app.checkpoint import read_checkpoint, write_checkpoint
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.clients.fedamp import FedAMPClient
from flwr_pfl.core.fedamp import ALPHA_KEY, LAM_KEY
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.fedamp import FedAMP
from flwr_pfl.training import OptimizerConfig

LR, ALPHA, LAM, SIGMA = 0.4, 0.05, 0.1, 0.5  # mu = lambda / alpha_k = 2
SIZES = (10, 16, 6)
M = 4  # partition 3 never replies: its row stays the initial model
PARAMS = [0, 1, 2, 3, 7, 8]  # fc.weight, fc.bias, bn.weight, bn.bias, head.weight, head.bias
BUFFERS = [4, 5, 6]  # bn.running_mean, bn.running_var, bn.num_batches_tracked
CONFIG = {ALPHA_KEY: ALPHA, LAM_KEY: LAM}


class BNNet(nn.Module):
    """A user's model: fc (5 -> 4), BatchNorm1d, tanh, head (4 -> 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.bn(self.fc(x))))


def net(seed: int) -> BNNet:
    torch.manual_seed(seed)
    return BNNet()


def load(model: nn.Module, arrays: list[np.ndarray]) -> nn.Module:
    model.load_state_dict({k: torch.as_tensor(np.array(a)) for k, a in zip(model.state_dict(), arrays)})
    return model


def user_arrays(model: nn.Module) -> list[np.ndarray]:
    return [v.detach().numpy().copy() for v in model.state_dict().values()]


def initial() -> list[np.ndarray]:
    return user_arrays(net(0))


def make_data(pid: int) -> LocalData:
    n = SIZES[pid % 3]
    g = torch.Generator().manual_seed(20 + pid)
    y = torch.arange(n) % 3
    x = torch.randn(n, 5, generator=g) + y[:, None].float() * torch.tensor([1.0, -0.5, 0.3, 0.0, 0.8]) + pid
    test = TensorDataset(x[::2] + 0.1, y[::2])
    return LocalData(DataLoader(TensorDataset(x, y), batch_size=n, shuffle=False), DataLoader(test, batch_size=len(test)))


def context(pid: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})


def client(pid: int, ctx: Context | None = None, seed: int = 11, epochs: int = 2, model: nn.Module | None = None) -> FedAMPClient:
    config = TrainConfig(local_epochs=epochs, batch_size=32, optimizer=OptimizerConfig("sgd", LR), device="cpu")
    return FedAMPClient(ctx or context(pid), model or net(seed + pid), make_data(pid), config, head="head")


def mean_nll(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean of -log softmax(logits)[y], written with logsumexp (not F.cross_entropy)."""
    return (torch.logsumexp(logits, 1) - logits[torch.arange(len(y)), y]).mean()


def replay(received: list[np.ndarray], pid: int, lam: float = LAM, alpha: float = ALPHA, epochs: int = 2) -> list[np.ndarray]:
    """Client ``pid``'s fit by hand: from u_i, full-batch SGD steps on
    F_i(w) + lam / (2 alpha) ||w - u_i||^2, BatchNorm in train mode."""
    model = load(BNNet(), received).train()
    anchor = [p.detach().clone() for p in model.parameters()]
    x, y = make_data(pid).train.dataset.tensors
    for _ in range(epochs):
        prox = sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
        loss = mean_nll(model(x), y) + lam / (2 * alpha) * prox
        grads = torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p -= LR * g
    return user_arrays(model)


def hand_cloud(rows: list[list[np.ndarray]], i: int, alpha: float = ALPHA, sigma: float = SIGMA) -> tuple[list[np.ndarray], list[float]]:
    """u_i by Eq. 5 with loops: distances over the parameter arrays, xi_ij = alpha e^{-d/sigma} / sigma,
    xi_ii = 1 - the rest, u_i = sum_j xi_ij w_j on the parameters and w_i's own buffers."""
    xi = []
    for j, other in enumerate(rows):
        d = sum(float(((rows[i][a].astype(np.float64) - other[a].astype(np.float64)) ** 2).sum()) for a in PARAMS)
        xi.append(0.0 if j == i else alpha * math.exp(-d / sigma) / sigma)
    xi[i] = 1.0 - sum(xi)
    u = [rows[i][a].copy() for a in range(len(rows[i]))]
    for a in PARAMS:
        u[a] = sum(xi[j] * rows[j][a].astype(np.float64) for j in range(len(rows)))
    return u, xi


def strategy(**kwargs) -> FedAMP:
    options = {"num_clients": M, "initial_arrays": initial(), "alpha_k": ALPHA, "lam": LAM, "sigma": SIGMA, "seed": 0}
    return FedAMP(**(options | kwargs))


def proxies() -> list[FakeProxy]:
    return [FakeProxy(str(60 + 7 * pid), pid) for pid in range(M)]


def round_one(s: FedAMP, sizes=SIZES) -> tuple[list[list[np.ndarray]], dict]:
    """Round 1 of ``s``: every client is sent u_i, partitions 0-2 reply (their real fits), 3 does not."""
    instructions = s.configure_fit(1, ndarrays_to_parameters(initial()), client_manager(proxies()))
    replies, results = [], []
    for proxy, ins in instructions:
        if proxy.pid == 3:
            continue
        arrays, n, metrics = client(proxy.pid).fit(parameters_to_ndarrays(ins.parameters), dict(ins.config))
        replies.append(arrays)
        results.append((proxy, fit_res(arrays, sizes[proxy.pid], proxy.pid, metrics)))
    _, metrics = s.aggregate_fit(1, results, [])
    return replies, metrics


# ------------------------------------------------------------------------------------ the client
@pytest.mark.parametrize("lam", [LAM, 0.0])
def test_fit_trains_from_the_cloud_model_on_eq6_and_uploads_its_model_and_the_parameter_mask(lam):
    received = user_arrays(net(5))  # u_i: not the client's own initial weights
    for pid in range(3):
        arrays, n, metrics = client(pid).fit([a.copy() for a in received], {"server-round": 2, ALPHA_KEY: ALPHA, LAM_KEY: lam})
        assert n == SIZES[pid] and metrics["partition_id"] == pid and np.isfinite(metrics["train_loss"])
        expected = replay(received, pid, lam=lam)
        close(arrays[:-1], expected, atol=2e-6)
        assert int(arrays[6]) == 2 and arrays[6].dtype == np.int64  # two BatchNorm steps
        assert arrays[-1].tolist() == [1, 1, 1, 1, 0, 0, 0, 1, 1]
    other = replay(received, 0, lam=LAM if lam == 0 else 0.0)
    assert not np.allclose(client(0).fit([a.copy() for a in received], {"server-round": 2, ALPHA_KEY: ALPHA, LAM_KEY: lam})[0][0],
                           other[0], atol=1e-4)  # the proximal term matters here


def test_a_fit_without_fedamps_hyperparameters_or_with_bad_ones_is_refused():
    c = client(0)
    with pytest.raises(ConfigError, match="fedamp-lam"):
        c.fit(initial(), {"server-round": 1, ALPHA_KEY: ALPHA})
    with pytest.raises(ConfigError, match="alpha-k must be a finite number > 0"):
        c.fit(initial(), {"server-round": 1, ALPHA_KEY: 0.0, LAM_KEY: LAM})


def test_evaluation_uses_the_model_the_server_sends_whatever_client_object_receives_it():
    ctx = context(1)
    client(1, ctx).fit(initial(), {"server-round": 1, **CONFIG})
    assert not ctx.state  # the client keeps nothing: every client's model lives on the server
    sent = replay(user_arrays(net(3)), 1)
    x, y = make_data(1).test.dataset.tensors
    with torch.no_grad():
        logits = load(BNNet(), sent).eval()(x)
    for seed in (1, 2):  # two fresh objects with other random weights on the same context
        c = client(1, ctx, seed=seed * 100)
        loss, n, metrics = c.evaluate([a.copy() for a in sent], {"server-round": 1})
        assert n == len(y) and loss == pytest.approx(float(mean_nll(logits, y)), rel=1e-5)
        assert metrics["accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))
        close([t.numpy() for t in c.personal_state().values()], sent, atol=0)


def test_a_batchnorm_dropout_model_sends_its_tensors_and_mask_and_evaluates_deterministically():
    x = torch.randn(14, 6, generator=torch.Generator().manual_seed(5))
    y = torch.tensor([0] * 10 + [2] * 4)
    data = LocalData(DataLoader(TensorDataset(x, y), batch_size=7, shuffle=True), DataLoader(TensorDataset(x, y), batch_size=14))
    torch.manual_seed(0)
    c = FedAMPClient(context(2), BatchNormDropoutNet(), data, TrainConfig(device="cpu"), head="fc2")
    assert c.user_wire_names() == list(BatchNormDropoutNet().state_dict())
    arrays, _, _ = c.fit(c.get_parameters({}), {"server-round": 1, **CONFIG})
    assert arrays[-1].tolist() == [1, 1, 1, 1, 0, 0, 0, 1, 1] and arrays[6].dtype == np.int64 and int(arrays[6]) == 2
    handler = type(c).evaluate.__wrapped__  # without the per-message seeding
    answers = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        answers.append(handler(c, [a.copy() for a in arrays[:-1]], {"server-round": 1}))
    assert answers[0] == answers[1]


# ------------------------------------------------------------------------------------ the server
def test_round_one_sends_every_client_the_initial_model_and_the_hyperparameters():
    s = strategy()
    instructions = s.configure_fit(1, ndarrays_to_parameters(initial()), client_manager(proxies()))
    assert sorted(p.pid for p, _ in instructions) == list(range(M))
    for _, ins in instructions:
        close(parameters_to_ndarrays(ins.parameters), initial(), atol=0)
        assert ins.config[ALPHA_KEY] == ALPHA and ins.config[LAM_KEY] == LAM and ins.config["server-round"] == 1


def test_the_server_sends_each_client_its_cloud_model_over_every_clients_latest_model():
    rows_seen: list = []
    s = strategy(on_round=lambda *row: rows_seen.append(row))
    replies, metrics = round_one(s)
    assert metrics["num_rejected"] == 0
    (_, phase, _, per_client), = rows_seen
    assert phase == "fit" and sorted(per_client) == [0, 1, 2]
    for pid in range(3):  # the u_i of round 1 was w^0 with the weights of distance 0
        assert per_client[pid]["xi_self"] == pytest.approx(1 - (M - 1) * ALPHA / SIGMA)
    rows = [[a[:-1] for a in replies][pid] if pid < 3 else initial() for pid in range(M)]
    for pid in range(M):
        close(s.client_model(pid), rows[pid], atol=0)  # the uploads, and w^0 for the client never seen
    cm = client_manager(proxies())
    instructions = {p.pid: parameters_to_ndarrays(ins.parameters) for p, ins in s.configure_fit(2, None, cm)}
    weights = []
    for pid in range(M):
        expected, xi = hand_cloud(rows, pid)
        weights.append(xi)
        close(instructions[pid], expected, atol=1e-6)
        for a in BUFFERS:  # the client's own statistics and counter, bit for bit
            assert np.array_equal(instructions[pid][a], rows[pid][a]) and instructions[pid][a].dtype == rows[pid][a].dtype
    xi = np.array(weights)
    assert np.all((xi > 0.01) & (xi < 0.99))  # every weight is visible: neither ~0 nor ~1
    assert not np.allclose(xi[0, 1:3], xi[1, [0, 2]])  # each client its own weights
    assert s._self_weights[0] == pytest.approx(weights[0][0])
    for proxy, ins in s.configure_evaluate(2, None, cm):  # each client evaluates its own w_i
        close(parameters_to_ndarrays(ins.parameters), rows[proxy.pid], atol=0)


def test_the_weights_do_not_depend_on_the_clients_sizes():
    a, b = strategy(), strategy()
    round_one(a)
    round_one(b, sizes=(50, 3, 7))
    cm = client_manager(proxies())
    for (_, x), (_, y) in zip(a.configure_fit(2, None, cm), b.configure_fit(2, None, cm)):
        close(parameters_to_ndarrays(x.parameters), parameters_to_ndarrays(y.parameters), atol=0)


def test_partial_participation_updates_only_the_replying_rows():
    s = strategy(fraction_fit=0.5)
    instructions = s.configure_fit(1, ndarrays_to_parameters(initial()), client_manager(proxies()))
    sampled = sorted(p.pid for p, _ in instructions)
    assert len(sampled) == 2
    (proxy, ins), _ = instructions
    arrays, n, metrics = client(proxy.pid % 3).fit(parameters_to_ndarrays(ins.parameters), dict(ins.config))
    s.aggregate_fit(1, [(proxy, fit_res(arrays, n, proxy.pid, metrics))], [])
    for pid in range(M):
        close(s.client_model(pid), arrays[:-1] if pid == proxy.pid else initial(), atol=0)


def test_checkpoint_round_trip_resumes_with_the_same_next_rounds(tmp_path):
    s = strategy()
    round_one(s)
    saved = read_checkpoint(write_checkpoint(tmp_path, 1, {"algorithm": "fedamp"}, {}, s.state_dict()))
    resumed = strategy()
    resumed.load_state_dict(saved.state, saved.rounds_done)
    cm = client_manager(proxies())
    for original, again in ((s.configure_fit(2, None, cm), resumed.configure_fit(1, None, cm)),
                            (s.configure_evaluate(2, None, cm), resumed.configure_evaluate(1, None, cm))):
        assert [p.pid for p, _ in original] == [p.pid for p, _ in again]
        for (_, x), (_, y) in zip(original, again):
            assert x.config == y.config
            close(parameters_to_ndarrays(x.parameters), parameters_to_ndarrays(y.parameters), atol=0)
    # the same round-2 replies leave both servers in the same state
    results = []
    for proxy, ins in s.configure_fit(2, None, cm):
        if proxy.pid != 3:
            arrays, n, metrics = client(proxy.pid).fit(parameters_to_ndarrays(ins.parameters), dict(ins.config))
            results.append((proxy, fit_res(arrays, n, proxy.pid, metrics)))
    s.aggregate_fit(2, results, [])
    resumed.configure_fit(1, None, cm)
    resumed.aggregate_fit(1, results, [])
    for pid in range(M):
        close(resumed.client_model(pid), s.client_model(pid), atol=0)
    with pytest.raises(ConfigError, match="num_clients"):
        strategy(num_clients=M + 1).load_state_dict(saved.state, saved.rounds_done)


def test_bad_replies_are_rejected_and_the_round_goes_on():
    s = strategy()
    replies, _ = round_one(s)
    before = [s.client_model(pid) for pid in range(M)]
    cm = client_manager(proxies() + [FakeProxy("999", 0)])  # a second node claiming partition 0
    s.configure_fit(2, None, cm)
    good = [a.copy() for a in replies[1]]
    good[0] = good[0] + 0.5
    nan = [a.copy() for a in replies[0]]
    nan[1][0] = np.nan
    float_counter = [a.copy() for a in replies[2]]
    float_counter[6] = float_counter[6].astype(np.float32)
    bad_mask = [a.copy() for a in replies[2]]
    bad_mask[-1][4] = 1.0  # a running mean is no parameter
    buffer_mask = [a.copy() for a in replies[2]]
    buffer_mask[-1][6] = 1.0  # the integer counter marked as a parameter
    half = [a.copy() for a in replies[2]]
    half[-1][0] = 0.5
    by_pid = {p.pid: p for p in proxies()}
    results = [
        (by_pid[0], fit_res(nan, 10, 0)),
        (by_pid[1], fit_res(good, 16, 1)),
        (FakeProxy("999", 0), fit_res(replies[0], 10, 0)),  # partition 0's slot, first valid reply this round
        (by_pid[1], fit_res(good, 16, 1)),  # a second reply for partition 1
        (by_pid[2], fit_res(replies[2][:-1], 6, 2)),  # no mask
        (by_pid[2], fit_res([*replies[2][:-2], replies[2][-2][:1], replies[2][-1]], 6, 2)),  # wrong shape
        (by_pid[2], fit_res(float_counter, 6, 2)),
        (by_pid[2], fit_res(bad_mask, 6, 2)),
        (by_pid[2], fit_res(buffer_mask, 6, 2)),
        (by_pid[2], fit_res(half, 6, 2)),
        (by_pid[3], fit_res(replies[2], 6, 2)),  # partition 3's node claims partition 2
    ]
    _, metrics = s.aggregate_fit(2, results, [])
    assert metrics["num_rejected"] == len(results) - 2
    close(s.client_model(1), good[:-1], atol=0)
    close(s.client_model(0), replies[0][:-1], atol=0)
    for pid in (2, 3):
        close(s.client_model(pid), before[pid], atol=0)


def test_two_rounds_through_proxies_evaluate_what_each_client_uploaded():
    cs = [client(pid) for pid in range(3)]
    ps = [NumPyProxy(str(80 + pid), pid, c) for pid, c in enumerate(cs)]
    s = strategy(num_clients=3)
    cm = client_manager(ps)
    params = ndarrays_to_parameters(initial())
    for rnd in (1, 2):
        results = [(p, p.fit(ins, None, rnd)) for p, ins in s.configure_fit(rnd, params, cm)]
        uploads = {p.pid: parameters_to_ndarrays(r.parameters)[:-1] for p, r in results}
        _, metrics = s.aggregate_fit(rnd, results, [])
        assert metrics["num_rejected"] == 0 and "xi_self_mean" in metrics
        for p, ins in s.configure_evaluate(rnd, params, cm):
            loss, _, _ = p.client.evaluate(parameters_to_ndarrays(ins.parameters), {"server-round": rnd})
            close([t.numpy() for t in p.client.personal_state().values()], uploads[p.pid], atol=0)
            fresh = client(p.pid, seed=77)
            assert fresh.evaluate(uploads[p.pid], {"server-round": rnd})[0] == loss


# ------------------------------------------------------------------------------------ options, refusals
def test_the_options_reach_the_strategy_and_bad_values_name_the_key():
    spec = ALGORITHMS["fedamp"]
    defaults = spec.options()
    assert (defaults.alpha_k, defaults.lam, defaults.sigma) == (1.0, 1.0, 1.0)  # PFLlib's
    experiment = parse_experiment({"algorithm": "fedamp", "fedamp.alpha-k": 0.02, "fedamp.lam": 0.3, "fedamp.sigma": 4.0})
    kwargs = spec.strategy_kwargs(experiment.options)
    assert kwargs == {"alpha_k": 0.02, "lam": 0.3, "sigma": 4.0} and spec.client_kwargs(experiment.options) == {}
    s = spec.strategy(num_clients=3, **kwargs)
    assert (s.alpha_k, s.lam, s.sigma) == (0.02, 0.3, 4.0)
    for key, value, allowed in (("alpha-k", 0.0, "> 0"), ("lam", -1.0, ">= 0"), ("sigma", -2.0, "> 0")):
        with pytest.raises(ConfigError, match=f"fedamp.{key} must be a finite number {allowed}"):
            parse_experiment({"algorithm": "fedamp", f"fedamp.{key}": value})


def test_server_side_evaluation_and_robust_aggregation_are_refused():
    with pytest.raises(ConfigError, match="no global model"):
        strategy(evaluate_fn=lambda rnd, arrays, config: None)
    with pytest.raises(ConfigError, match="clip-update-norm"):
        strategy(clip_update_norm=1.0)
    with pytest.raises(ConfigError, match="sigma"):
        strategy(sigma=0.0)
