"""FedFomo (Zhang et al., ICLR 2021) in the Flower layer: clients of unequal sizes with their own
validation splits, a user's model with BatchNorm (statistics that are combined but do not count
in the distance, an integer counter that is kept), full-batch loaders and non-default options, so
that a client's round can be replayed by hand (validation losses written with logsumexp, the raw
weights, their normalisation, the step, one SGD step); the server's stored models, affinity rows,
epsilon-greedy downloads (top M by affinity at epsilon 0, per seed and round) and per-client
evaluation; the checkpoint round trip giving the same next round; bad replies rejected."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.common import parameters_to_ndarrays
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flwr_pfl.app.entries.fedfomo  # noqa: F401  (registers "fedfomo")
from fakes import BatchNormDropoutNet, FakeProxy, NumPyProxy, client_manager, fit_res
from fakes import assert_arrays_close as close
from flwr_pfl.app.checkpoint import read_checkpoint, write_checkpoint
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.clients.fedfomo import MODELS_KEY, FedFomoClient
from flwr_pfl.core.fedfomo import select_candidates
from flwr_pfl.data.sampling import stage_rng
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.fedfomo import FedFomo
from flwr_pfl.training import OptimizerConfig

LR = 0.4
#: per client: (training, validation, test) sizes, unequal
SIZES = ((10, 6, 5), (16, 4, 7), (6, 8, 4))
PARAMS = ["fc.weight", "fc.bias", "bn.weight", "bn.bias", "head.weight", "head.bias"]


class FomoNet(nn.Module):
    """A user's model: fc (5 -> 4), BatchNorm1d (running statistics, an integer counter), tanh,
    head (4 -> 3); its state_dict has 9 arrays, 6 of them parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.bn(self.fc(x))))


def net(seed: int, scale: float = 1.0) -> FomoNet:
    torch.manual_seed(seed)
    model = FomoNet()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
        model.bn.running_mean.uniform_(-0.3, 0.3)
        model.bn.running_var.uniform_(0.5, 1.5)
        model.bn.num_batches_tracked.fill_(seed)
    return model


def arrays(model: nn.Module) -> list[np.ndarray]:
    return [v.detach().numpy().copy() for v in model.state_dict().values()]


def load(arrs: list[np.ndarray]) -> FomoNet:
    model = FomoNet()
    model.load_state_dict({k: torch.as_tensor(a.copy()) for k, a in zip(model.state_dict(), arrs)})
    return model


def tensors(pid: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = sum(SIZES[pid])
    g = torch.Generator().manual_seed(50 + pid)
    y = (torch.arange(n) + pid) % 3
    x = torch.randn(n, 5, generator=g) + y[:, None].float() * torch.tensor([1.0, -0.7, 0.4, 0.0, 0.9])
    return x, y


def split(pid: int, part: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = tensors(pid)
    start = sum(SIZES[pid][:part])
    return x[start:start + SIZES[pid][part]], y[start:start + SIZES[pid][part]]


def make_data(pid: int, val: bool = True) -> LocalData:
    loaders = [DataLoader(TensorDataset(*split(pid, part)), batch_size=64, shuffle=False) for part in range(3)]
    return LocalData(loaders[0], loaders[2], loaders[1] if val else None)


def context(pid: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})


def client(pid: int, ctx: Context | None = None, val: bool = True) -> FedFomoClient:
    config = TrainConfig(local_epochs=1, batch_size=64, optimizer=OptimizerConfig("sgd", LR), device="cpu", seed=3)
    return FedFomoClient(ctx or context(pid), net(90 + pid), make_data(pid, val), config)


def mean_nll(logits: torch.Tensor, y: torch.Tensor) -> float:
    """Mean of -log softmax(logits)[y], written with logsumexp (not F.cross_entropy)."""
    return float((torch.logsumexp(logits.double(), 1) - logits.double()[torch.arange(len(y)), y]).mean())


def val_loss(arrs: list[np.ndarray], pid: int) -> float:
    x, y = split(pid, 1)
    with torch.no_grad():
        return mean_nll(load(arrs).eval()(x), y)


def distance(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """Over the parameters only, with a Python loop over the entries."""
    keys = list(FomoNet().state_dict())
    total = 0.0
    for key, u, v in zip(keys, a, b):
        if key in PARAMS:
            total += sum((float(p) - float(q)) ** 2 for p, q in zip(u.ravel(), v.ravel()))
    return total ** 0.5


def replay(pid: int, own: list[np.ndarray], others: list[list[np.ndarray]]) -> tuple[list[np.ndarray], list[float]]:
    """One fit of client ``pid`` by hand: (the reply's model arrays, the raw weights)."""
    raw = []
    for other in others:
        d = distance(own, other)
        raw.append((val_loss(own, pid) - val_loss(other, pid)) / d if d > 0 else 0.0)
    positive = [max(w, 0.0) for w in raw]
    start = own
    if sum(positive) > 0:
        weights = [w / sum(positive) for w in positive]
        start = []
        for i, mine in enumerate(own):
            if mine.dtype.kind != "f":
                start.append(mine.copy())
                continue
            value = mine.astype(np.float64) + sum(w * (o[i].astype(np.float64) - mine) for w, o in zip(weights, others))
            start.append(value.astype(mine.dtype))
    model = load(start).train()
    x, y = split(pid, 0)
    logits = model(x)
    loss = (torch.logsumexp(logits, 1) - logits[torch.arange(len(y)), y]).mean()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p.sub_(LR * g)
    return arrays(model), raw


def instruction(own: list[np.ndarray], others: list[list[np.ndarray]]) -> tuple[list[np.ndarray], dict]:
    return [a.copy() for a in own] + [a.copy() for o in others for a in o], {MODELS_KEY: len(others), "server-round": 2}


# ------------------------------------------------------------------------------------ the client
def test_a_client_weighs_by_validation_slope_steps_and_trains():
    """Own model with an overconfident head; a better model, a worse one, and the own parameters
    with other BatchNorm statistics (distance 0 over the parameters: weight 0 despite its loss)."""
    own = arrays(net(1, 2.5))
    better, worse = arrays(net(2, 0.6)), arrays(net(8, 6.0))
    same = [a.copy() for a in own]
    same[4] = same[4] + 0.4  # bn.running_mean
    others = [better, worse, same, arrays(net(4, 0.9))]
    c = client(1)
    reply, n, metrics = c.fit(*instruction(own, others))
    expected, raw = replay(1, own, others)
    assert n == SIZES[1][0] and metrics["partition_id"] == 1
    assert raw[0] > 0 > raw[1] and raw[2] == 0.0 and raw[3] > 0 and raw[0] != raw[3]
    assert val_loss(same, 1) != val_loss(own, 1)  # the zero-distance model does differ in loss
    assert reply[-1].dtype == np.float64 and reply[-1].shape == (4,)
    np.testing.assert_allclose(reply[-1], raw, rtol=1e-5)
    close(reply[:-1], expected, atol=1e-6)
    assert int(reply[6]) == int(own[6]) + 1  # the counter: the own one, plus one training step
    assert metrics["fomo_models"] == 4 and metrics["fomo_positive"] == 2
    assert metrics["fomo_val_loss"] == pytest.approx(val_loss(own, 1), rel=1e-6)


def test_no_better_model_keeps_the_own_one_and_reports_the_negative_weights():
    own = arrays(net(5, 0.5))
    others = [arrays(net(6, 5.0)), arrays(net(7, 7.0))]
    c = client(0)
    reply, _, metrics = c.fit(*instruction(own, others))
    expected, raw = replay(0, own, others)
    assert all(w < 0 for w in raw) and metrics["fomo_positive"] == 0
    np.testing.assert_allclose(reply[-1], raw, rtol=1e-5)
    close(reply[:-1], expected, atol=1e-6)  # trained from the own model
    # the first round: nothing to weigh, the own model is trained
    first, _, metrics = client(0).fit([a.copy() for a in own], {MODELS_KEY: 0, "server-round": 1})
    close(first[:-1], replay(0, own, [])[0], atol=1e-6)
    assert first[-1].shape == (0,) and metrics["fomo_models"] == 0


def test_without_a_validation_split_the_training_split_is_used():
    own, others = arrays(net(1, 2.5)), [arrays(net(2, 0.6))]
    reply, _, _ = client(2, val=False).fit(*instruction(own, others))
    x, y = split(2, 0)
    with torch.no_grad():
        expected = (mean_nll(load(own).eval()(x), y) - mean_nll(load(others[0]).eval()(x), y)) / distance(own, others[0])
    assert float(reply[-1][0]) == pytest.approx(expected, rel=1e-5)


def test_a_malformed_instruction_is_refused():
    own = arrays(net(1))
    with pytest.raises(ValueError, match="must have 18"):
        client(0).fit(own + own[:-1], {MODELS_KEY: 1})
    with pytest.raises(ValueError, match="integer >= 0"):
        client(0).fit(own, {MODELS_KEY: -1})


def test_evaluation_is_of_the_model_sent_and_leaves_nothing_on_the_client():
    model = arrays(net(8, 1.3))
    ctx = context(2)
    first = client(2, ctx)
    loss, n, metrics = first.evaluate([a.copy() for a in model], {"server-round": 1})
    x, y = split(2, 2)
    with torch.no_grad():
        assert loss == pytest.approx(mean_nll(load(model).eval()(x), y), rel=1e-6)
    assert n == SIZES[2][2] and metrics["partition_id"] == 2
    close(list(first.personal_state().values()), model, atol=0)  # exported: the model it evaluated
    assert len(ctx.state.array_records) == 0  # the personal model lives on the server
    again = client(2, ctx)  # a new client object on the same context answers the same
    assert again.evaluate([a.copy() for a in model], {"server-round": 1})[0] == loss


def test_a_batchnorm_dropout_model_evaluates_deterministically_and_keeps_its_counter():
    x = torch.randn(14, 6, generator=torch.Generator().manual_seed(5))
    y = torch.tensor([0] * 10 + [2] * 4)
    data = LocalData(DataLoader(TensorDataset(x, y), batch_size=7, shuffle=True), DataLoader(TensorDataset(x, y), batch_size=14),
                     DataLoader(TensorDataset(x[:6], y[:6]), batch_size=6))
    config = TrainConfig(batch_size=7, optimizer=OptimizerConfig("sgd", 0.1), device="cpu")
    torch.manual_seed(0)
    c = FedFomoClient(context(0), BatchNormDropoutNet(), data, config)
    own = c.get_parameters({})
    torch.manual_seed(1)
    other = [v.detach().numpy().copy() for v in BatchNormDropoutNet().state_dict().values()]
    other[6] = np.array(50, np.int64)
    reply, _, _ = c.fit([a.copy() for a in own + other], {MODELS_KEY: 1, "server-round": 2})
    assert int(reply[6]) == int(own[6]) + 2  # own counter kept, plus two batches
    handler = type(c).evaluate.__wrapped__  # without the per-message seeding
    answers = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        answers.append(handler(c, [a.copy() for a in reply[:-1]], {"server-round": 2}))
    assert answers[0] == answers[1]


# ------------------------------------------------------------------------------------ the server
def initial() -> list[np.ndarray]:
    return arrays(net(0))


def strategy(n: int = 4, **kwargs) -> FedFomo:
    options = {"num_models": 2, "epsilon": 0.0, "epsilon_decay": 0.05, "seed": 7, "min_available_clients": 1,
               "wait_timeout": 1.0} | kwargs  # some rounds sample part of the federation
    return FedFomo(num_clients=n, initial_arrays=initial(), **options)


def model_reply(seed: int, weights: list[float]) -> list[np.ndarray]:
    return arrays(net(seed)) + [np.array(weights, np.float64)]


def fit_round(s: FedFomo, rnd: int, proxies: list[FakeProxy], replies: dict[int, list[float]]):
    """configure_fit for ``proxies``, then aggregate_fit with a reply (model of seed 100 * rnd + pid,
    the given weights) from each pid of ``replies``; returns the instructions by pid."""
    sent = {p.pid: ins for p, ins in s.configure_fit(rnd, None, client_manager(proxies))}
    results = [(FakeProxy(str(pid), pid), fit_res(model_reply(100 * rnd + pid, w), 10 + pid, pid))
               for pid, w in replies.items()]
    _, metrics = s.aggregate_fit(rnd, results, [])
    return sent, metrics


def test_the_server_stores_models_adds_weights_and_sends_the_top_models_by_affinity():
    s = strategy()
    proxies = [FakeProxy(str(pid), pid) for pid in range(4)]
    sent, metrics = fit_round(s, 1, proxies, {0: [], 1: [], 2: []})  # client 3 fails
    assert metrics["num_rejected"] == 0
    for pid, ins in sent.items():  # nothing to download yet: the initial model alone
        assert ins.config[MODELS_KEY] == 0
        close(parameters_to_ndarrays(ins.parameters), initial(), atol=0)
    assert sorted(s.models) == [0, 1, 2] and s.latest == [0, 1, 2] and not s.affinity.any()
    close(s.models[1], arrays(net(101)), atol=0)
    s.affinity[3] = [0.1, 0.9, 0.5, 7.0]  # the diagonal is never read
    s.affinity[0] = [9.0, -1.0, 2.0, 5.0]  # client 3 has no model: not a candidate
    s.affinity[1] = [0.3, 0.0, 0.2, 0.0]
    s.affinity[2] = [0.0, 0.1, 0.0, 0.0]
    sent, _ = fit_round(s, 2, proxies, {0: [0.25, -0.5], 3: [0.125, 1.5]})
    assert s.sent == {0: [2, 1], 1: [0, 2], 2: [1, 0], 3: [1, 2]}
    got = parameters_to_ndarrays(sent[3].parameters)
    close(got, initial() + s_models_round1(1) + s_models_round1(2), atol=0)
    close(parameters_to_ndarrays(sent[0].parameters), s_models_round1(0) + s_models_round1(2) + s_models_round1(1), atol=0)
    assert [sent[pid].config[MODELS_KEY] for pid in range(4)] == [2] * 4
    np.testing.assert_array_equal(s.affinity[0], [9.0, -1.5, 2.25, 5.0])  # A[0, 2] += 0.25, A[0, 1] -= 0.5
    np.testing.assert_array_equal(s.affinity[3], [0.1, 1.025, 2.0, 7.0])
    assert s.latest == [0, 3] and sorted(s.models) == [0, 1, 2, 3]
    close(s.models[3], arrays(net(203)), atol=0)
    close(s.models[1], arrays(net(101)), atol=0)  # not replied: its model of round 1
    cm = client_manager(proxies)
    for proxy, ins in s.configure_evaluate(2, None, cm):
        close(parameters_to_ndarrays(ins.parameters), s.models[proxy.pid], atol=0)


def s_models_round1(pid: int) -> list[np.ndarray]:
    return arrays(net(100 + pid))


def test_the_pool_is_the_latest_repliers_or_every_client_with_a_model():
    for pool, expected in (("last-round", {0: [2], 1: [2]}), ("all", {0: [2, 1], 1: [2, 0]})):
        s = strategy(3, candidates=pool)
        proxies = [FakeProxy(str(pid), pid) for pid in range(3)]
        s.affinity[0] = [0.0, 1.0, 3.0]
        s.affinity[1] = [2.0, 0.0, 5.0]
        fit_round(s, 1, proxies[:2], {0: [], 1: []})
        fit_round(s, 2, proxies[2:], {2: [0.0, 0.0]})
        fit_round(s, 3, proxies[:2], {})
        assert {pid: s.sent[pid] for pid in (0, 1)} == expected, pool


def test_the_download_repeats_per_seed_and_round_and_explores():
    def picks(seed: int, rnd: int, epsilon: float) -> list[list[int]]:
        s = strategy(8, seed=seed, epsilon=epsilon, epsilon_decay=0.0, num_models=3)
        s.models = {j: initial() for j in range(8)}
        s.latest = list(range(8))
        s.affinity = np.tile(np.arange(8.0), (8, 1))
        return [s.choose(rnd, pid) for pid in range(8)]

    assert picks(1, 3, 0.0)[0] == [7, 6, 5] and picks(1, 3, 0.0)[7] == [6, 5, 4]  # top 3, never itself
    assert picks(1, 3, 0.9) == picks(1, 3, 0.9)
    assert picks(1, 3, 0.9) != picks(1, 4, 0.9) and picks(1, 3, 0.9) != picks(2, 3, 0.9)
    # the generator of (seed, round, partition) and the decayed epsilon: replayed with the core rule
    s = strategy(8, seed=4, epsilon=0.5, epsilon_decay=0.125, num_models=3)
    s.models, s.latest = {j: initial() for j in range(8)}, list(range(8))
    s.affinity = np.tile(np.arange(8.0), (8, 1))
    s.round_offset = 2  # a resumed run: process round 1 is the run's round 3, epsilon 0.5 - 2 * 0.125

    def replayed(pid: int, rate: float) -> list[int]:
        pool = [j for j in range(8) if j != pid]
        return select_candidates(s.affinity[pid], pool, 3, rate, stage_rng(4, f"fedfomo/candidates/{pid}", 3))

    assert [s.choose(1, pid) for pid in range(8)] == [replayed(pid, 0.25) for pid in range(8)]
    assert [replayed(pid, 0.25) for pid in range(8)] != [replayed(pid, 0.5) for pid in range(8)]  # the rate shows


def two_rounds(s: FedFomo, proxies: list[NumPyProxy], rounds=(1, 2), checkpoint=None):
    cm = client_manager(proxies)
    log = []
    for rnd in rounds:
        instructions = s.configure_fit(rnd, None, cm)
        log.append([(p.pid, parameters_to_ndarrays(ins.parameters), dict(ins.config)) for p, ins in instructions])
        results = [(p, p.fit(ins, None, rnd)) for p, ins in instructions]
        params, metrics = s.aggregate_fit(rnd, results, [])
        assert metrics["num_rejected"] == 0
        evaluations = [(p.pid, p.evaluate(ins, None, rnd)) for p, ins in s.configure_evaluate(rnd, params, cm)]
        log.append([(pid, res.loss) for pid, res in evaluations])
        if checkpoint is not None and rnd == rounds[0]:
            checkpoint(s)
    return log


def real_proxies() -> list[NumPyProxy]:
    return [NumPyProxy(str(40 + pid), pid, client(pid)) for pid in range(3)]


def test_two_rounds_through_proxies_store_each_clients_model_and_its_weights():
    s = strategy(3, num_models=5, epsilon=0.3)
    log = two_rounds(s, real_proxies())
    round2 = log[2]
    for pid, received, config in round2:
        assert config[MODELS_KEY] == 2  # M capped at the two other clients
        assert len(received) == 3 * 9
    # the affinity rows are the raw weights the clients sent, at the models they were sent
    for pid in range(3):
        others = s.sent[pid]
        own = round2[pid][1][:9]
        expected_raw = [(val_loss(own, pid) - val_loss(s_model, pid)) / distance(own, s_model)
                        for s_model in (round2[pid][1][9:18], round2[pid][1][18:])]
        # a difference of two float32 losses near 1: its rounding error is absolute (~1e-7), so
        # a weight near 0 needs an absolute tolerance (seen on one CPU: 1.2e-7 off at 0.0029)
        np.testing.assert_allclose(s.affinity[pid, others], expected_raw, rtol=1e-5, atol=1e-6)
    for pid, loss in log[3]:  # each evaluates its own stored model
        x, y = split(pid, 2)
        with torch.no_grad():
            assert loss == pytest.approx(mean_nll(load(s.models[pid]).eval()(x), y), rel=1e-6)


def test_checkpoint_round_trip_gives_the_same_next_round(tmp_path):
    reference = strategy(3, num_models=1, epsilon=0.5)
    full = two_rounds(reference, real_proxies())
    saved = {}
    first = strategy(3, num_models=1, epsilon=0.5)
    two_rounds(first, real_proxies(), rounds=(1,), checkpoint=lambda s: saved.setdefault(
        "checkpoint", read_checkpoint(write_checkpoint(tmp_path, 1, {"algorithm": "fedfomo"}, {}, s.state_dict()))))
    checkpoint = saved["checkpoint"]
    resumed = strategy(3, num_models=1, epsilon=0.5)
    resumed.load_state_dict(checkpoint.state, checkpoint.rounds_done)
    np.testing.assert_array_equal(resumed.affinity, first.affinity)
    assert resumed.latest == first.latest and sorted(resumed.models) == [0, 1, 2]
    for pid in range(3):
        close(resumed.models[pid], first.models[pid], atol=0)
        assert [a.dtype for a in resumed.models[pid]] == [a.dtype for a in first.models[pid]]
    again = two_rounds(resumed, real_proxies(), rounds=(1,))  # process round 1 = the run's round 2
    for (pid, got, config), (pid2, want, config2) in zip(again[0], full[2]):
        assert pid == pid2 and config == config2
        close(got, want, atol=0)
    assert again[1] == full[3]
    np.testing.assert_array_equal(resumed.affinity, reference.affinity)
    for pid in range(3):
        close(resumed.models[pid], reference.models[pid], atol=0)


def test_a_checkpoint_of_another_federation_or_model_is_refused():
    s = strategy(3)
    fit_round(s, 1, [FakeProxy(str(pid), pid) for pid in range(3)], {0: [], 1: []})
    state = s.state_dict()
    with pytest.raises(ConfigError, match="affinity"):
        strategy(4).load_state_dict(state | {"global_arrays": initial()}, 1)
    bad = state | {"fedfomo_models": {0: state["fedfomo_models"][0][:-1]}}
    with pytest.raises(ConfigError, match="partition 0"):
        strategy(3).load_state_dict(bad, 1)


def test_bad_replies_are_rejected_and_the_round_goes_on():
    s = strategy(4)
    proxies = [FakeProxy(str(pid), pid) for pid in range(4)]
    fit_round(s, 1, proxies, {0: [], 1: [], 2: [], 3: []})
    before = {pid: [a.copy() for a in s.models[pid]] for pid in range(4)}
    s.configure_fit(2, None, client_manager(proxies[:3]))  # client 3 is not sampled this round
    nan_weight, nan_model = model_reply(1, [0.5, np.nan]), model_reply(1, [0.5, 0.5])
    nan_model[0][0, 0] = np.nan
    results = [
        (FakeProxy("0", 0), fit_res(model_reply(200, [0.5, -0.25]), 10, 0)),  # good
        (FakeProxy("1", 1), fit_res(model_reply(201, [0.5]), 10, 1)),  # one weight too few
        (FakeProxy("2", 2), fit_res(nan_weight, 10, 2)),
        (FakeProxy("3", 3), fit_res(model_reply(203, [0.5, 0.5]), 10, 3)),  # not instructed this round
        (FakeProxy("1", 1), fit_res(nan_model, 10, 1)),
        (FakeProxy("2", 2), fit_res(model_reply(202, [0.5, 0.5])[1:], 10, 2)),  # an array missing
        (FakeProxy("0", 0), fit_res(model_reply(300, [1.0, 1.0]), 10, 0)),  # a second reply: its weights not added twice
    ]
    row = s.affinity.copy()
    _, metrics = s.aggregate_fit(2, results, [])
    assert metrics["num_rejected"] == 6 and s.latest == [0]
    close(s.models[0], arrays(net(200)), atol=0)
    for pid in (1, 2, 3):
        close(s.models[pid], before[pid], atol=0)
    np.testing.assert_array_equal(s.affinity[1:], row[1:])
    np.testing.assert_array_equal(s.affinity[0, s.sent[0]] - row[0, s.sent[0]], [0.5, -0.25])
    assert np.count_nonzero(s.affinity[0] - row[0]) == 2


# ------------------------------------------------------------------------------------ options and refusals
def test_the_options_reach_the_strategy_and_bad_values_name_the_key():
    spec = ALGORITHMS["fedfomo"]
    assert spec.options() == spec.options(num_models=5, epsilon=0.3, epsilon_decay=0.05, candidates="last-round")
    experiment = parse_experiment({"algorithm": "fedfomo", "fedfomo.num-models": 3, "fedfomo.epsilon": 0.1,
                                   "fedfomo.epsilon-decay": 0.01, "fedfomo.candidates": "all"})
    kwargs = spec.strategy_kwargs(experiment.options)
    assert kwargs == {"num_models": 3, "epsilon": 0.1, "epsilon_decay": 0.01, "candidates": "all"}
    assert spec.client_kwargs(experiment.options) == {}
    built = FedFomo(num_clients=3, **kwargs)
    assert (built.num_models, built.epsilon, built.epsilon_decay, built.candidates) == (3, 0.1, 0.01, "all")
    for key, value in (("num-models", 0), ("num-models", 1.5), ("epsilon", 1.5), ("epsilon", -0.1),
                       ("epsilon-decay", -1.0), ("candidates", "everyone")):
        with pytest.raises(ConfigError, match=f"fedfomo.{key}"):
            parse_experiment({"algorithm": "fedfomo", f"fedfomo.{key}": value})


def test_server_side_evaluation_and_reply_bounds_are_refused():
    with pytest.raises(ConfigError, match="no global model"):
        FedFomo(num_clients=3, evaluate_fn=lambda r, a, c: None)
    with pytest.raises(ConfigError, match="clip-update-norm"):
        FedFomo(num_clients=3, clip_update_norm=1.0)
    with pytest.raises(ConfigError, match="num_models"):
        FedFomo(num_clients=3, num_models=0)


def test_the_preset_is_fedoras_rotated_mnist_setting_with_the_authors_options():
    from flwr_pfl.app.overrides import parse_overrides
    from flwr_pfl.app.presets import PRESETS_DIR

    experiment = parse_experiment(parse_overrides([str(PRESETS_DIR / "fedfomo_rotated_mnist.toml")]))
    assert experiment.algorithm.name == "fedfomo" and experiment.run.num_clients == 36
    assert experiment.options == ALGORITHMS["fedfomo"].options(num_models=5, epsilon=0.3, epsilon_decay=0.05)
    assert experiment.data.val_fraction > 0  # the weights need a validation split
