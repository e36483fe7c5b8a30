"""pFedHN (Shamsian et al., ICML 2021) in the Flower layer.

Client: a user's model with BatchNorm (fc, bn, tanh, head), full-batch loaders of unequal sizes
and an optimizer with momentum and weight decay, so that K inner steps can be replayed by hand
(BatchNorm written out, running statistics included); the buffers kept in ``context.state``
across fresh client objects; evaluation of the received model with the client's own statistics.

Server: the model each client is sent is its own ``h(v_i; phi)``; after a round phi and the
embeddings are what a hand-written replay gives (the surrogate ``<h(v_i; phi), delta_i>`` by
plain ``backward``, clipping and SGD with momentum and weight decay written out, one step per
client in partition order, every gradient at the round's phi); example counts do not weigh; a
zero change moves phi by weight decay only; the checkpoint round trip resumes bit for bit; bad
replies are rejected and the round goes on. Then two rounds through proxies that build a fresh
client per message, and the options and refusals."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flwr_pfl.app.entries.pfedhn  # noqa: F401  (registers "pfedhn")
from fakes import BatchNormDropoutNet, FakeProxy, client_manager, fit_res
from fakes import assert_arrays_close as close
from flwr_pfl.app.checkpoint import read_checkpoint, write_checkpoint
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.clients.pfedhn import PFedHNClient
from flwr_pfl.core import pfedhn as core
from flwr_pfl.errors import ConfigError
from flwr_pfl.models.split import user_keys
from flwr_pfl.strategies.pfedhn import PFedHN
from flwr_pfl.training import OptimizerConfig

LR, MOMENTUM, WD, K = 0.2, 0.5, 0.01, 3
SIZES = (10, 16, 6)  # unequal clients
PARAMS = ["fc.weight", "fc.bias", "bn.weight", "bn.bias", "head.weight", "head.bias"]
BUFFERS = ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
#: the server's non-default options
HN = {"embed_dim": 3, "hidden_dim": 6, "n_hidden": 1, "server_lr": 0.05, "server_momentum": 0.5,
      "server_weight_decay": 0.01, "server_clip_norm": 0.8, "round_step": "mean"}
NUM_CLIENTS, SEED = 4, 3


class BNNet(nn.Module):
    """A user's model: fc (5 -> 4), BatchNorm1d, tanh, then ``head`` (4 -> 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.bn(self.fc(x))))


def net(seed: int = 0) -> BNNet:
    torch.manual_seed(seed)
    return BNNet()


def param_arrays(seed: int = 0, scale: float = 1.0) -> list[np.ndarray]:
    model = net(seed)
    return [scale * p.detach().numpy().copy() for p in model.parameters()]


def data(pid: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(20 + pid)
    y = torch.arange(SIZES[pid]) % 3
    x = torch.randn(SIZES[pid], 5, generator=g) + y[:, None].float() * torch.tensor([0.8, -0.4, 0.2, 0.0, 0.6])
    return x, y


def local_data(pid: int, batch_size: int | None = None, shuffle: bool = False) -> LocalData:
    x, y = data(pid)
    test = TensorDataset(x[::2] + 0.3, y[::2])
    return LocalData(DataLoader(TensorDataset(x, y), batch_size=batch_size or len(y), shuffle=shuffle),
                     DataLoader(test, batch_size=len(test)))


def context(pid: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})


def train_config(epochs: int = 1) -> TrainConfig:
    return TrainConfig(local_epochs=epochs, optimizer=OptimizerConfig("sgd", LR, momentum=MOMENTUM, weight_decay=WD),
                       device="cpu")


def client(pid: int, ctx: Context, seed: int = 11, inner_steps: int = K, **kwargs) -> PFedHNClient:
    return PFedHNClient(ctx, net(seed + pid), kwargs.pop("data", local_data(pid)), train_config(kwargs.pop("epochs", 1)),
                        inner_steps=inner_steps, **kwargs)


def user_state(c: PFedHNClient) -> dict[str, torch.Tensor]:
    """The client's model state under the user's own names (a plain module is wrapped)."""
    state = c.model.state_dict()
    return dict(zip(user_keys(c.model, list(state)), state.values()))


def mean_nll(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (torch.logsumexp(logits, 1) - logits[torch.arange(len(y)), y]).mean()


def forward(p: list[torch.Tensor], x: torch.Tensor, stats: list[torch.Tensor], training: bool) -> torch.Tensor:
    """BNNet written out; in training mode ``stats`` (running mean, var, count) move as torch's do."""
    z = x @ p[0].T + p[1]
    if training:
        mean, var = z.mean(0), z.var(0, unbiased=False)
        with torch.no_grad():
            stats[0].mul_(0.9).add_(0.1 * mean)
            stats[1].mul_(0.9).add_(0.1 * z.var(0, unbiased=True))
            stats[2] += 1
    else:
        mean, var = stats[0], stats[1]
    h = torch.tanh((z - mean) / torch.sqrt(var + 1e-5) * p[2] + p[3])
    return h @ p[4].T + p[5]


def fresh_stats() -> list[torch.Tensor]:
    return [torch.zeros(4), torch.ones(4), torch.tensor(0)]


def replay_fit(received: list[np.ndarray], pid: int, stats: list[torch.Tensor], steps: int = K,
               clip: float = 0.0) -> list[np.ndarray]:
    """``steps`` full-batch SGD steps with momentum and weight decay, by hand; with ``clip``, each
    step's loss gradient is first scaled to norm ``clip`` when it is longer."""
    x, y = data(pid)
    p = [torch.tensor(a) for a in received]
    bufs: list[torch.Tensor] = []
    for step in range(steps):
        q = [t.clone().requires_grad_() for t in p]
        grads = torch.autograd.grad(mean_nll(forward(q, x, stats, True), y), q)
        if clip:
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).float()
            grads = [g * torch.clamp(clip / (norm + 1e-6), max=1.0) for g in grads]
        d = [g + WD * t for g, t in zip(grads, p)]
        bufs = d if step == 0 else [MOMENTUM * b + dk for b, dk in zip(bufs, d)]
        p = [t - LR * b for t, b in zip(p, bufs)]
    return [t.numpy() for t in p]


# ------------------------------------------------------------------------------------ the client
def test_the_wire_is_the_models_parameters_without_its_buffers():
    c = client(0, context(0), head="head")  # a head may be named; pFedHN does not need one
    assert c.user_wire_names() == PARAMS
    assert [name for name, _ in c.wire_layout()] == [f"module.{k}" for k in PARAMS]
    plain = client(0, context(0))
    assert plain.user_wire_names() == PARAMS and [a.shape for a in plain.get_parameters({})] == [
        (4, 5), (4,), (4,), (4,), (3, 4), (3,)]
    assert BUFFERS == [k for k in BNNet().state_dict() if k not in PARAMS]


def test_fit_runs_k_inner_steps_from_the_received_model_and_keeps_the_buffers_on_the_client():
    received = param_arrays(5, scale=1.3)
    for pid in range(3):
        ctx = context(pid)
        arrays, n, metrics = client(pid, ctx).fit([a.copy() for a in received], {"server-round": 1})
        stats = fresh_stats()
        close(arrays, replay_fit(received, pid, stats), atol=2e-6)
        assert n == SIZES[pid] and metrics["inner_steps"] == K and metrics["partition_id"] == pid
        stored = ctx.state[PFedHNClient.BUFFERS_KEY].to_numpy_ndarrays()
        close(stored[:2], [s.numpy() for s in stats[:2]], atol=1e-6)
        assert int(stored[2]) == K
        # round 2 on a fresh client object: the stored statistics go on, the parameters are the new ones
        again = client(pid, ctx, seed=40)
        assert int(user_state(again)["bn.num_batches_tracked"]) == K
        second = param_arrays(6)
        arrays2, _, _ = again.fit([a.copy() for a in second], {"server-round": 2})
        close(arrays2, replay_fit(second, pid, stats), atol=2e-6)
        assert int(ctx.state[PFedHNClient.BUFFERS_KEY].to_numpy_ndarrays()[2]) == 2 * K


def test_each_inner_step_clips_the_gradient_norm_as_the_authors_do():
    received = param_arrays(5, scale=1.3)
    x, y = data(0)
    q = [torch.tensor(a).requires_grad_() for a in received]
    first = torch.sqrt(sum((g ** 2).sum() for g in torch.autograd.grad(mean_nll(forward(q, x, fresh_stats(), True), y), q)))
    clip = float(first) / 3  # active from the first step on
    clipped, _, _ = client(0, context(0), inner_clip_norm=clip).fit([a.copy() for a in received], {"server-round": 1})
    close(clipped, replay_fit(received, 0, fresh_stats(), clip=clip), atol=2e-6)
    unclipped, _, _ = client(0, context(0), inner_clip_norm=0.0).fit([a.copy() for a in received], {"server-round": 1})
    close(unclipped, replay_fit(received, 0, fresh_stats()), atol=2e-6)
    assert not np.allclose(clipped[0], unclipped[0], atol=1e-4)
    for bad in (-1.0, float("inf"), float("nan"), True):
        with pytest.raises(ConfigError, match=r"pfedhn.inner-clip-norm.*>= 0"):
            client(0, context(0), inner_clip_norm=bad)


def test_inner_steps_run_on_across_passes_and_zero_means_local_epochs():
    received = param_arrays(1)
    d = local_data(0, batch_size=4, shuffle=True)  # 10 samples: 3 batches a pass
    c = client(0, context(0), inner_steps=5, data=d)
    _, _, metrics = c.fit([a.copy() for a in received], {"server-round": 1})
    assert metrics["inner_steps"] == 5 and int(user_state(c)["bn.num_batches_tracked"]) == 5
    c = client(0, context(0), inner_steps=0, data=local_data(0, batch_size=4, shuffle=True), epochs=2)
    _, _, metrics = c.fit([a.copy() for a in received], {"server-round": 1})
    assert metrics["inner_steps"] == 6 and int(user_state(c)["bn.num_batches_tracked"]) == 6


def test_evaluation_uses_the_received_model_with_the_clients_own_statistics():
    ctx = context(1)
    client(1, ctx).fit(param_arrays(2), {"server-round": 1})
    stored = [torch.tensor(a) for a in ctx.state[PFedHNClient.BUFFERS_KEY].to_numpy_ndarrays()]
    received = param_arrays(8, scale=0.7)
    loss, n, metrics = client(1, ctx, seed=3).evaluate([a.copy() for a in received], {"server-round": 1})
    x, y = data(1)
    x, y = x[::2] + 0.3, y[::2]
    with torch.no_grad():
        logits = forward([torch.tensor(a) for a in received], x, stored, False)
    assert n == len(y) and loss == pytest.approx(float(mean_nll(logits, y)), rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))
    close(ctx.state[PFedHNClient.BUFFERS_KEY].to_numpy_ndarrays(), [s.numpy() for s in stored], atol=0)  # unchanged
    exported = client(1, ctx, seed=3)
    exported.evaluate([a.copy() for a in received], {"server-round": 1})
    personal = exported.personal_state()
    assert user_keys(exported.model, list(personal)) == list(BNNet().state_dict())
    close([user_state(exported)[k].numpy() for k in PARAMS], received, atol=0)


def test_a_batchnorm_dropout_model_evaluates_deterministically_and_keeps_its_statistics():
    x = torch.randn(14, 6, generator=torch.Generator().manual_seed(5))
    y = torch.tensor([0] * 10 + [2] * 4)
    d = LocalData(DataLoader(TensorDataset(x, y), batch_size=7, shuffle=True), DataLoader(TensorDataset(x, y), batch_size=14))
    ctx = context(2)
    torch.manual_seed(0)
    first = PFedHNClient(ctx, BatchNormDropoutNet(), d, train_config(), inner_steps=4)
    assert first.user_wire_names() == ["fc1.weight", "fc1.bias", "bn.weight", "bn.bias", "fc2.weight", "fc2.bias"]
    arrays, _, _ = first.fit(first.get_parameters({}), {"server-round": 1})
    stored = ctx.state[PFedHNClient.BUFFERS_KEY].to_numpy_ndarrays()
    assert int(stored[2]) == 4 and stored[2].dtype == np.int64
    torch.manual_seed(9)
    again = PFedHNClient(ctx, BatchNormDropoutNet(), d, train_config(), inner_steps=4)
    close([user_state(again)[k].numpy() for k in ("bn.running_mean", "bn.running_var")], stored[:2], atol=0)
    handler = type(again).evaluate.__wrapped__  # without the per-message seeding
    answers = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        answers.append(handler(again, [a.copy() for a in arrays], {"server-round": 1}))
    assert answers[0] == answers[1]


# ------------------------------------------------------------------------------------ the server
def strategy(**kwargs) -> PFedHN:
    return PFedHN(**({"num_clients": NUM_CLIENTS, "initial_arrays": param_arrays(0), "seed": SEED} | HN | kwargs))


def reference_hnet() -> core.HyperNetwork:
    return core.build_hypernetwork(NUM_CLIENTS, [a.shape for a in param_arrays(0)], seed=SEED, embed_dim=3,
                                   hidden_dim=6, n_hidden=1)


def proxies(n: int = NUM_CLIENTS) -> list[FakeProxy]:
    return [FakeProxy(str(100 + 7 * pid), pid) for pid in range(n)]


def hand_round(hnet: nn.Module, momentum: list[torch.Tensor] | None, replies: dict[int, list[np.ndarray]],
               lr: float = 0.05, m: float = 0.5, wd: float = 0.01, clip: float = 0.8,
               round_step: str = "mean") -> list[torch.Tensor]:
    """The server's round by hand: gradients of <h(v_i; phi), theta_i - theta~_i> at the round's
    phi by backward(); then ``per-client``: per partition (ascending) clipping and SGD written
    out, ``mean``: one clipped SGD step along the mean gradient off the embedding table and
    the sum on it (each row its own client's), or ``sum``: one SGD step along the sum of the
    gradients each clipped. Returns the momentum; ``hnet`` is updated in place."""
    params = list(hnet.parameters())
    grads = []
    for pid in sorted(replies):
        hnet.zero_grad()
        theta = hnet(pid)
        delta = [t.detach() - torch.tensor(a) for t, a in zip(theta, replies[pid])]
        sum((t * d).sum() for t, d in zip(theta, delta)).backward()
        grads.append([p.grad.clone() for p in params])
    def clipped(g: list[torch.Tensor]) -> list[torch.Tensor]:
        norm = torch.sqrt(sum((x.double() ** 2).sum() for x in g)).float()
        return [x * torch.clamp(clip / (norm + 1e-6), max=1.0) for x in g] if clip else g

    if round_step == "mean":
        grads = [clipped([sum(g[k] for g in grads) / (1 if p is hnet.embeddings.weight else len(grads))
                          for k, p in enumerate(params)])]
    elif round_step == "sum":
        each = [clipped(g) for g in grads]
        grads = [[sum(g[k] for g in each) for k in range(len(params))]]
    else:
        grads = [clipped(g) for g in grads]
    for g in grads:
        with torch.no_grad():
            d = [x + wd * p for x, p in zip(g, params)]
            momentum = d if momentum is None else [m * b + dk for b, dk in zip(momentum, d)]
            for p, b in zip(params, momentum):
                p -= lr * b
    return momentum


def trained(arrays: list[np.ndarray], seed: int) -> list[np.ndarray]:
    """A client's reply: the arrays it was sent, moved by a seeded perturbation."""
    g = torch.Generator().manual_seed(seed)
    return [(a + 0.3 * torch.randn(a.shape, generator=g).numpy()).astype(a.dtype) for a in arrays]


def round_one(s: PFedHN) -> dict[int, list[np.ndarray]]:
    instructions = s.configure_fit(1, None, client_manager(proxies()))
    return {proxy.pid: parameters_to_ndarrays(ins.parameters) for proxy, ins in instructions}


def test_each_client_is_sent_the_model_of_its_own_embedding():
    s = strategy()
    sent = round_one(s)
    ref = reference_hnet()
    assert sorted(sent) == list(range(NUM_CLIENTS))
    for pid, arrays in sent.items():
        with torch.no_grad():
            close(arrays, [t.numpy() for t in ref(pid)], atol=0)
        assert [a.dtype for a in arrays] == [np.float32] * 6
    assert not np.allclose(sent[0][0], sent[1][0])
    assert s.embed_dim == 3 and core.auto_embed_dim(NUM_CLIENTS) != 3 and strategy(embed_dim=0, num_clients=50).embed_dim == 13


def test_the_round_steps_phi_by_the_chain_rule_once_per_client_in_partition_order_not_by_example_counts():
    s = strategy(round_step="per-client")
    sent = round_one(s)
    replies = {pid: trained(sent[pid], pid) for pid in (2, 0, 1)}  # client 3 sampled but silent
    order = [2, 0, 1]
    results = [(FakeProxy(str(100 + 7 * pid), pid), fit_res(replies[pid], SIZES[pid], pid, {"train_loss": 1.0}))
               for pid in order]
    params, metrics = s.aggregate_fit(1, results, [])
    assert metrics["num_rejected"] == 0 and metrics["delta_norm_mean"] > 0 and metrics["hn_grad_norm_mean"] > 0.8
    close(parameters_to_ndarrays(params), param_arrays(0), atol=0)  # no global model: the initial arrays stay
    ref = reference_hnet()
    hand_round(ref, None, replies, round_step="per-client")
    for got, expected in zip(s.hnet.parameters(), ref.parameters()):
        np.testing.assert_allclose(got.detach().numpy(), expected.detach().numpy(), rtol=2e-5, atol=2e-7)
    # the example counts do not weigh: every reply makes one step
    other = strategy(round_step="per-client")
    round_one(other)
    other.aggregate_fit(1, [(FakeProxy(str(100 + 7 * pid), pid), fit_res(replies[pid], 1, pid)) for pid in (0, 1, 2)], [])
    assert all(torch.equal(a, b) for a, b in zip(s.hnet.parameters(), other.hnet.parameters()))
    # the next models are the updated hypernetwork's, at fit and at evaluation
    with torch.no_grad():
        after = {pid: [t.numpy() for t in ref(pid)] for pid in range(NUM_CLIENTS)}
    for proxy, ins in s.configure_evaluate(1, None, client_manager(proxies())):
        close(parameters_to_ndarrays(ins.parameters), after[proxy.pid], atol=2e-6)
        assert ins.config["server-round"] == 1
    for proxy, ins in s.configure_fit(2, None, client_manager(proxies())):
        close(parameters_to_ndarrays(ins.parameters), after[proxy.pid], atol=2e-6)


def test_a_zero_change_moves_phi_by_weight_decay_only():
    for wd in (0.0, 0.01):
        s = strategy(server_weight_decay=wd)
        sent = round_one(s)
        before = [p.detach().clone() for p in s.hnet.parameters()]
        _, metrics = s.aggregate_fit(1, [(FakeProxy("107", 1), fit_res(sent[1], 5, 1))], [])
        assert metrics["delta_norm_mean"] == 0.0
        for p, b in zip(s.hnet.parameters(), before):
            if wd == 0:
                assert torch.equal(p, b)
            else:
                torch.testing.assert_close(p.detach(), b * (1 - 0.05 * wd), rtol=1e-6, atol=0)


def test_the_checkpoint_round_trip_resumes_the_next_round_bit_for_bit(tmp_path):
    s = strategy()
    sent = round_one(s)
    s.aggregate_fit(1, [(FakeProxy(str(100 + 7 * pid), pid), fit_res(trained(sent[pid], pid), 4, pid)) for pid in (0, 3)], [])
    saved = read_checkpoint(write_checkpoint(tmp_path, 1, {"algorithm": "pfedhn"}, {}, s.state_dict()))
    resumed = strategy()
    resumed.load_state_dict(saved.state, saved.rounds_done)
    cm = client_manager(proxies())
    a = {p.pid: parameters_to_ndarrays(i.parameters) for p, i in s.configure_fit(2, None, cm)}
    b = {p.pid: parameters_to_ndarrays(i.parameters) for p, i in resumed.configure_fit(1, None, cm)}
    assert sorted(a) == sorted(b)
    for pid in a:
        assert all(x.tobytes() == y.tobytes() for x, y in zip(a[pid], b[pid]))
    no_momentum = strategy()
    no_momentum.load_state_dict({**saved.state, "pfedhn": {**saved.state["pfedhn"], "momentum": False}}, 1)
    no_momentum.configure_fit(1, None, cm)
    replies = {pid: trained(a[pid], 10 + pid) for pid in (1, 2)}
    for st, r in ((s, 2), (resumed, 1), (no_momentum, 1)):
        st.aggregate_fit(r, [(FakeProxy(str(100 + 7 * pid), pid), fit_res(replies[pid], 3, pid)) for pid in (1, 2)], [])
    assert all(torch.equal(x, y) for x, y in zip(s.hnet.parameters(), resumed.hnet.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(s.hnet.parameters(), no_momentum.hnet.parameters()))
    assert resumed.round_offset == 1
    with pytest.raises(ConfigError, match="hidden_dim 6 in the checkpoint, 7 now"):
        strategy(hidden_dim=7).load_state_dict(saved.state, 1)


def test_bad_replies_are_rejected_and_the_round_goes_on_with_the_others():
    s = strategy()
    sent = round_one(s)
    good = trained(sent[0], 0)
    nan = trained(sent[1], 1)
    nan[2][0] = np.nan
    results = [
        (FakeProxy("100", 0), fit_res(good, 4, 0)),
        (FakeProxy("107", 1), fit_res(nan, 4, 1)),                              # NaN
        (FakeProxy("114", 2), fit_res(trained(sent[2], 2)[:-1], 4, 2)),         # an array missing
        (FakeProxy("121", 3), fit_res([a.T for a in trained(sent[3], 3)], 4, 3)),  # wrong shapes
        (FakeProxy("999", 3), fit_res(trained(sent[3], 3), 4, 3)),              # no model was sent to it
    ]
    _, metrics = s.aggregate_fit(1, results, [])
    assert metrics["num_rejected"] == 4 and metrics["num_failures"] == 4
    ref = reference_hnet()
    hand_round(ref, None, {0: good})
    for got, expected in zip(s.hnet.parameters(), ref.parameters()):
        np.testing.assert_allclose(got.detach().numpy(), expected.detach().numpy(), rtol=2e-5, atol=2e-7)
    # a client reporting another partition than the one it was sent
    s2 = strategy(stop_if_nothing_trains=False)  # its round 1's only reply is rejected
    sent2 = round_one(s2)
    _, metrics = s2.aggregate_fit(1, [(FakeProxy("100", 0), fit_res(trained(sent2[1], 1), 4, 1))], [])
    assert metrics["num_rejected"] == 1 and s2.partition_of["100"] == 0  # the lie taught the server nothing
    assert all(torch.equal(a, b) for a, b in zip(s2.hnet.parameters(), reference_hnet().parameters()))
    # and one reporting none: the base takes it for a client of unknown partition, pFedHN cannot
    silent = fit_res(trained(sent2[0], 0), 4, 0)
    del silent.metrics["partition_id"]
    _, metrics = s2.aggregate_fit(1, [(FakeProxy("100", 0), silent)], [])
    assert metrics["num_rejected"] == 1
    assert all(torch.equal(a, b) for a, b in zip(s2.hnet.parameters(), reference_hnet().parameters()))
    failed = FitRes(Status(Code.FIT_NOT_IMPLEMENTED, "x"), ndarrays_to_parameters([]), 0, {})
    assert s2.aggregate_fit(1, [], [(FakeProxy("107", 1), failed)])[1]["num_failures"] == 1


class FreshClientProxy(FakeProxy):
    """A node whose every message is handled by a new client object on the node's context."""

    def __init__(self, pid: int) -> None:
        super().__init__(str(300 + pid), pid)
        self.ctx = context(pid)
        self.evaluated: list[tuple[list[np.ndarray], float]] = []

    def fit(self, ins, timeout, group_id):
        arrays, n, metrics = client(self.pid, self.ctx, seed=50 + group_id).fit(parameters_to_ndarrays(ins.parameters),
                                                                               dict(ins.config))
        return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, metrics)

    def evaluate(self, ins, timeout, group_id):
        from flwr.common import EvaluateRes

        received = parameters_to_ndarrays(ins.parameters)
        loss, n, metrics = client(self.pid, self.ctx, seed=60 + group_id).evaluate(received, dict(ins.config))
        self.evaluated.append((received, loss))
        return EvaluateRes(Status(Code.OK, ""), loss, n, metrics)


def test_round_step_mean_makes_one_step_along_the_mean_gradient_not_weighted_by_example_counts():
    results = {}
    for sizes in (SIZES, (1, 1, 1, 1)):
        s = strategy()
        sent = round_one(s)
        replies = {pid: trained(sent[pid], pid) for pid in (2, 0, 1)}
        s.aggregate_fit(1, [(FakeProxy(str(100 + 7 * pid), pid), fit_res(replies[pid], sizes[pid], pid)) for pid in (2, 0, 1)], [])
        results[sizes] = [p.detach().numpy().copy() for p in s.hnet.parameters()]
    ref = reference_hnet()
    hand_round(ref, None, replies)
    for got, expected in zip(results[SIZES], ref.parameters()):
        np.testing.assert_allclose(got, expected.detach().numpy(), rtol=2e-5, atol=2e-7)
    assert all(np.array_equal(a, b) for a, b in zip(results[SIZES], results[(1, 1, 1, 1)]))
    with pytest.raises(ConfigError, match="pfedhn.round-step"):
        strategy(round_step="median")


def test_round_step_sum_makes_one_step_along_the_sum_of_the_gradients_each_clipped():
    results, norms = {}, {}
    for sizes in (SIZES, (1, 1, 1, 1)):
        s = strategy(round_step="sum")
        sent = round_one(s)
        replies = {pid: trained(sent[pid], pid) for pid in (2, 0, 1)}
        _, metrics = s.aggregate_fit(1, [(FakeProxy(str(100 + 7 * pid), pid), fit_res(replies[pid], sizes[pid], pid))
                                         for pid in (2, 0, 1)], [])
        results[sizes] = [p.detach().numpy().copy() for p in s.hnet.parameters()]
        norms[sizes] = metrics
    # the clip (0.8) acts on each reply: every reply's gradient is longer than it
    assert norms[SIZES]["hn_grad_norm_min"] > HN["server_clip_norm"]
    ref = reference_hnet()
    hand_round(ref, None, replies, round_step="sum")
    for got, expected in zip(results[SIZES], ref.parameters()):
        np.testing.assert_allclose(got, expected.detach().numpy(), rtol=2e-5, atol=2e-7)
    assert all(np.array_equal(a, b) for a, b in zip(results[SIZES], results[(1, 1, 1, 1)]))
    # neither the mean nor one step per client
    for other in ("mean", "per-client"):
        alt = reference_hnet()
        hand_round(alt, None, replies, round_step=other)
        assert not all(np.allclose(g, a.detach().numpy(), atol=1e-6) for g, a in zip(results[SIZES], alt.parameters()))


def test_with_one_client_a_round_every_round_step_is_the_authors_step():
    steps = []
    for round_step in core.ROUND_STEPS:
        s = strategy(round_step=round_step)
        sent = round_one(s)
        reply = trained(sent[1], 1)
        s.aggregate_fit(1, [(FakeProxy(str(107), 1), fit_res(reply, SIZES[1], 1))], [])
        steps.append([p.detach().numpy().copy() for p in s.hnet.parameters()])
    ref = reference_hnet()
    hand_round(ref, None, {1: reply}, round_step="per-client")
    for got in steps:
        for g, expected in zip(got, ref.parameters()):
            np.testing.assert_allclose(g, expected.detach().numpy(), rtol=2e-5, atol=2e-7)


def test_two_rounds_through_fresh_client_objects_train_the_hypernetwork_and_evaluate_its_models():
    nodes = [FreshClientProxy(pid) for pid in range(3)]
    cm = client_manager(nodes)
    s = strategy(num_clients=3, initial_arrays=param_arrays(0))
    ref = core.build_hypernetwork(3, [a.shape for a in param_arrays(0)], seed=SEED, embed_dim=3, hidden_dim=6, n_hidden=1)
    momentum, stats = None, {pid: fresh_stats() for pid in range(3)}
    for rnd in (1, 2):
        instructions = s.configure_fit(rnd, None, cm)
        results = [(p, p.fit(ins, None, rnd)) for p, ins in instructions]
        _, metrics = s.aggregate_fit(rnd, results, [])
        assert metrics["num_rejected"] == 0 and metrics["inner_steps_mean"] == K
        with torch.no_grad():
            sent = {pid: [t.numpy().copy() for t in ref(pid)] for pid in range(3)}
        replies = {pid: replay_fit(sent[pid], pid, stats[pid]) for pid in range(3)}
        momentum = hand_round(ref, momentum, replies)
        for p, ins in s.configure_evaluate(rnd, None, cm):
            p.evaluate(ins, None, rnd)
        for node in nodes:
            received, loss = node.evaluated[-1]
            with torch.no_grad():
                close(received, [t.numpy() for t in ref(node.pid)], atol=5e-6)
            x, y = data(node.pid)
            with torch.no_grad():
                expected = mean_nll(forward([torch.tensor(a) for a in received], x[::2] + 0.3, stats[node.pid], False), y[::2])
            assert loss == pytest.approx(float(expected), rel=1e-4)
            assert int(node.ctx.state[PFedHNClient.BUFFERS_KEY].to_numpy_ndarrays()[2]) == rnd * K


# ------------------------------------------------------------------------------------ options, refusals
def test_hooks_and_options_that_pfedhn_cannot_honour_are_refused():
    with pytest.raises(ConfigError, match="no global model"):
        strategy(evaluate_fn=lambda r, a, c: None)
    with pytest.raises(ConfigError, match="clip-update-norm"):
        strategy(clip_update_norm=1.0)
    with pytest.raises(ConfigError, match="trimmed-mean"):
        strategy(aggregate="trimmed-mean")
    for bad, key in (({"hidden_dim": 0}, "hidden-dim"), ({"server_lr": 0.0}, "server-lr"),
                     ({"server_momentum": 1.0}, "server-momentum"), ({"server_clip_norm": -1.0}, "server-clip-norm"),
                     ({"n_hidden": -1}, "n-hidden"), ({"embed_dim": 1.5}, "embed-dim")):
        with pytest.raises(ConfigError, match=f"pfedhn.{key}"):
            strategy(**bad)
    with pytest.raises(ConfigError, match="inner-steps"):
        client(0, context(0), inner_steps=-1)
    s = strategy(initial_arrays=[*param_arrays(0), np.zeros((), np.int64)])
    with pytest.raises(ConfigError, match="floating-point parameters only"):
        s.configure_fit(1, None, client_manager(proxies()))


def test_the_run_config_keys_reach_the_client_and_the_strategy_and_bad_values_name_the_key():
    spec = ALGORITHMS["pfedhn"]
    defaults = spec.options()
    assert (defaults.embed_dim, defaults.hidden_dim, defaults.n_hidden, defaults.inner_steps) == (0, 100, 3, 50)
    assert (defaults.server_lr, defaults.server_momentum, defaults.server_weight_decay, defaults.server_clip_norm) == (
        0.01, 0.9, 0.001, 50.0)
    assert defaults.round_step == "sum" and PFedHN(num_clients=2).round_step == "sum" and defaults.inner_clip_norm == 50.0
    experiment = parse_experiment({"algorithm": "pfedhn", "pfedhn.embed-dim": 3, "pfedhn.hidden-dim": 6,
                                   "pfedhn.n-hidden": 1, "pfedhn.server-lr": 0.05, "pfedhn.server-momentum": 0.5,
                                   "pfedhn.server-weight-decay": 0.01, "pfedhn.server-clip-norm": 0.8,
                                   "pfedhn.inner-steps": 7, "pfedhn.round-step": "mean",
                                   "pfedhn.inner-clip-norm": 2.5})
    assert spec.client_kwargs(experiment.options) == {"inner_steps": 7, "inner_clip_norm": 2.5}
    assert spec.strategy_kwargs(experiment.options) == HN
    s = spec.strategy(num_clients=4, **spec.strategy_kwargs(experiment.options))
    assert (s.embed_dim, s.hidden_dim, s.n_hidden, s.server_lr, s.server_momentum, s.server_weight_decay,
            s.server_clip_norm) == (3, 6, 1, 0.05, 0.5, 0.01, 0.8)
    built = client(0, context(0), **spec.client_kwargs(experiment.options))
    assert (built.inner_steps, built.inner_clip_norm) == (7, 2.5)
    with pytest.raises(ConfigError, match="pfedhn.round-step='median' is not allowed; choose one of 'sum', 'mean', 'per-client'"):
        parse_experiment({"algorithm": "pfedhn", "pfedhn.round-step": "median"})
    for key, value, allowed in (("embed-dim", -1, ">= 0"), ("inner-steps", -2, ">= 0"), ("server-weight-decay", -0.1, ">= 0"),
                                ("inner-clip-norm", -0.5, ">= 0")):
        with pytest.raises(ConfigError, match=f"pfedhn.{key} must be .*{allowed}"):
            parse_experiment({"algorithm": "pfedhn", f"pfedhn.{key}": value})
