"""pFedMe (T. Dinh et al., NeurIPS 2020, Alg. 1) in the Flower layer, against a hand replay built
from the core's functions (the inner solve of Eq. 7 by autograd, the local update, the beta step):
two clients of unequal sizes, non-default lambda, K, personal and outer learning rates and beta,
unshuffled loaders of several batches so that every step can be replayed exactly."""

from __future__ import annotations

import re

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
import flwr_pfl.app.entries.pfedme  # noqa: F401  (registers "pfedme")
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.app.server_app import build_strategy
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.clients.pfedme import PFedMeClient
from flwr_pfl.core.pfedme import inner_solve, outer_step
from flwr_pfl.errors import ConfigError
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.strategies.pfedme import PFedMe
from flwr_pfl.training import OptimizerConfig, evaluate, get_arrays, set_arrays

CPU = torch.device("cpu")
LAM, K, PLR, ETA, BETA, EPOCHS, BATCH = 3.0, 3, 0.07, 0.05, 1.6, 2, 6
SIZES = (12, 18)  # unequal; 2 and 3 batches per epoch


def make_model(seed: int = 0) -> EncoderHeadModel:
    torch.manual_seed(seed)
    return EncoderHeadModel(nn.Sequential(nn.Linear(5, 4), nn.Tanh()), 4, 3)


def make_data(n: int, seed: int) -> LocalData:
    g = torch.Generator().manual_seed(300 + seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 5, generator=g) + y[:, None].float() * (1 + seed)
    d = torch.zeros(n, dtype=torch.long)
    test = TensorDataset(x[: n // 2] + 0.3, y[: n // 2], d[: n // 2])
    return LocalData(DataLoader(TensorDataset(x, y, d), batch_size=BATCH, shuffle=False), DataLoader(test, batch_size=4))


def context(pid: int, state: RecordDict | None = None) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": pid},
                   state=RecordDict() if state is None else state, run_config={})


def train_config(lr: float = ETA) -> TrainConfig:
    # momentum and weight decay set on purpose: pFedMe's steps must not use them
    return TrainConfig(local_epochs=EPOCHS, batch_size=BATCH, optimizer=OptimizerConfig("sgd", lr, momentum=0.9,
                       weight_decay=0.1), device="cpu")


def client(pid: int, state: RecordDict | None = None, seed: int = 3, **kwargs) -> PFedMeClient:
    options = {"lam": LAM, "k": K, "personal_lr": PLR} | kwargs
    return PFedMeClient(context(pid, state), make_model(seed), make_data(SIZES[pid], pid), train_config(), **options)


def hand_replay(start: list[np.ndarray], data: LocalData, eta: float = ETA) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(w_{i,R}, the last theta) of Alg. 1 from w^t = ``start``: per batch, :func:`inner_solve`
    (K autograd steps on Eq. 7, theta warm-started), then :func:`outer_step`."""
    model = make_model(seed=11)
    set_arrays(model, start, "all")
    w = {name: p.detach().clone() for name, p in model.named_parameters()}
    theta = dict(w)
    for _ in range(EPOCHS):
        for x, y, d in data.train:
            def loss(params, x=x, y=y, d=d):
                return F.cross_entropy(functional_call(model, params, (x, d)), y)

            theta = inner_solve(theta, w, loss, LAM, PLR, K)
            w = outer_step(w, theta, LAM, eta)
    names = [name for name, _ in model.named_parameters()]
    return [w[n].numpy() for n in names], [theta[n].numpy() for n in names]


def global_arrays() -> list[np.ndarray]:
    return [a * 0.8 for a in get_arrays(make_model(), "all")]


def test_clients_follow_alg1_and_the_server_mixes_their_example_weighted_mean_by_beta():
    start = global_arrays()
    replies, locals_ = [], []
    for pid, n in enumerate(SIZES):
        c = client(pid)
        arrays, num_examples, metrics = c.fit([a.copy() for a in start], {"server-round": 1})
        w, theta = hand_replay(start, c.data)
        assert num_examples == n and metrics["partition_id"] == pid and metrics["buffer_mask"] == "0000"
        close(arrays, w, atol=1e-6)
        close([v.numpy() for v in c.personal_state().values()], theta, atol=1e-6)
        assert max(np.abs(a - b).max() for a, b in zip(w, theta)) > 1e-3  # w and theta differ
        replies.append((FakeProxy(str(pid)), fit_res(arrays, num_examples, pid, {"buffer_mask": metrics["buffer_mask"]})))
        locals_.append(w)
    weights = np.array(SIZES, float) / sum(SIZES)
    mean = [weights[0] * a + weights[1] * b for a, b in zip(*locals_)]
    strategy = PFedMe(num_clients=2, initial_arrays=start, beta=BETA)
    out = parameters_to_ndarrays(strategy.aggregate_fit(1, replies, [])[0])
    close(out, [(1 - BETA) * g + BETA * m for g, m in zip(start, mean)], atol=1e-6)
    # Alg. 1's uniform mean, the paper's formula, on request
    uniform = PFedMe(num_clients=2, initial_arrays=start, beta=BETA, weighting="uniform")
    out = parameters_to_ndarrays(uniform.aggregate_fit(1, replies, [])[0])
    close(out, [(1 - BETA) * g + BETA * (a + b) / 2 for g, a, b in zip(start, *locals_)], atol=1e-6)


def test_the_round_learning_rate_is_eta_and_theta_restarts_from_each_round_global_model():
    """A fresh client object on the same context: the stored theta is evaluated (the personalized
    model) but the next round restarts theta from the new w^t, with the round's learning-rate
    as eta."""
    state = RecordDict()
    first, second = global_arrays(), [a * 0.5 for a in get_arrays(make_model(seed=5), "all")]
    c = client(1, state)
    c.fit([a.copy() for a in first], {"server-round": 1})
    _, theta = hand_replay(first, c.data)

    fresh = client(1, state, seed=8)  # another model object, the same node state
    close([v.numpy() for v in fresh.personal_state().values()], theta, atol=1e-6)
    personal, received = make_model(seed=9), make_model(seed=9)
    set_arrays(personal, theta, "all")
    set_arrays(received, second, "all")
    loss, n, metrics = fresh.evaluate([a.copy() for a in second], {"server-round": 1})
    expected = evaluate(personal, fresh.data.test, device=CPU)
    assert n == len(fresh.data.test.dataset)
    assert loss == pytest.approx(expected.loss, rel=1e-5) and metrics["accuracy"] == expected.accuracy
    assert metrics["global_loss"] == pytest.approx(evaluate(received, fresh.data.test, device=CPU).loss, rel=1e-5)
    close(get_arrays(fresh.model, "all"), second, atol=0)  # the received model is back after evaluation

    again = client(1, state, seed=4)
    arrays, _, _ = again.fit([a.copy() for a in second], {"server-round": 2, "learning-rate": 0.2})
    w, theta2 = hand_replay(second, again.data, eta=0.2)
    close(arrays, w, atol=1e-6)
    close([v.numpy() for v in again.personal_state().values()], theta2, atol=1e-6)


def test_a_client_without_a_personal_model_evaluates_the_received_one():
    c = client(0)
    start = global_arrays()
    loss, _, metrics = c.evaluate([a.copy() for a in start], {"server-round": 1})
    assert loss == pytest.approx(metrics["global_loss"], rel=1e-12) and not c.has_personal_model()
    close([v.numpy() for v in c.personal_state().values()], start, atol=0)  # what it evaluated, for export


def bn_client(pid: int, state: RecordDict) -> PFedMeClient:
    torch.manual_seed(0)
    n = SIZES[pid]
    g = torch.Generator().manual_seed(pid)
    x, y = torch.randn(n, 6, generator=g) + pid, torch.arange(n) % 3
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    return PFedMeClient(context(pid, state), BatchNormDropoutNet(), LocalData(loader, loader), train_config(),
                        head="fc2", lam=LAM, k=K, personal_lr=PLR)


def test_batchnorm_buffers_travel_with_the_reply_and_are_averaged_without_the_beta_step():
    """With a user's BatchNorm model: every inner step's forward pass moves the statistics (the
    counter counts K steps per batch), the reply flags its buffers, the personal copy keeps them,
    and the server averages the buffers by examples while it mixes the parameters by beta."""
    states = [RecordDict(), RecordDict()]
    start = get_arrays(bn_client(0, RecordDict()).model, "all")
    replies, arrays = [], []
    for pid in range(2):
        c = bn_client(pid, states[pid])
        out, n, metrics = c.fit([a.copy() for a in start], {"server-round": 1})
        names = c.wire_names()
        assert metrics["buffer_mask"] == "".join("1" if k.split(".")[-1] in
                                                 ("running_mean", "running_var", "num_batches_tracked") else "0"
                                                 for k in names)
        counter = names.index("module.bn.num_batches_tracked")
        assert int(out[counter]) == EPOCHS * K * -(-SIZES[pid] // BATCH)
        personal = bn_client(pid, states[pid]).personal_state()  # a fresh object reads it back
        np.testing.assert_array_equal(personal["module.bn.running_mean"].numpy(), out[names.index("module.bn.running_mean")])
        replies.append((FakeProxy(str(pid)), fit_res(out, n, pid, {"buffer_mask": metrics["buffer_mask"]})))
        arrays.append(out)
    strategy = PFedMe(num_clients=2, initial_arrays=start, beta=BETA)
    got = parameters_to_ndarrays(strategy.aggregate_fit(1, replies, [])[0])
    weights = np.array(SIZES, float) / sum(SIZES)
    for i, flag in enumerate(metrics["buffer_mask"]):
        mean = weights[0] * arrays[0][i].astype(np.float64) + weights[1] * arrays[1][i].astype(np.float64)
        if np.issubdtype(got[i].dtype, np.integer):
            np.testing.assert_array_equal(got[i], np.rint(mean).astype(got[i].dtype))
        elif flag == "1":
            np.testing.assert_allclose(got[i], mean, rtol=1e-5, atol=1e-7)
        else:
            np.testing.assert_allclose(got[i], (1 - BETA) * start[i] + BETA * mean, rtol=1e-5, atol=1e-6)


def test_the_beta_step_follows_clipping_and_a_malformed_mask_rejects_its_reply():
    start = [np.zeros((2, 2), np.float32), np.zeros(2, np.float32)]
    big = [np.full((2, 2), 3.0, np.float32), np.full(2, 3.0, np.float32)]  # update norm sqrt(6) * 3
    strategy = PFedMe(num_clients=2, initial_arrays=start, beta=BETA, clip_update_norm=1.0)
    replies = [(FakeProxy("1"), fit_res(big, 10, 0, {"buffer_mask": "00"})),
               (FakeProxy("2"), fit_res(big, 30, 1, {"buffer_mask": "0"}))]  # one flag for two arrays
    params, metrics = strategy.aggregate_fit(1, replies, [])
    assert metrics["num_rejected"] == 1
    out = parameters_to_ndarrays(params)
    norm = float(np.sqrt(sum(np.sum(a.astype(np.float64) ** 2) for a in out)))
    assert norm == pytest.approx(BETA * 1.0, rel=1e-5)  # the clipped update, extrapolated by beta
    from flwr_pfl.strategies.validation import ReplyError

    for mask in ("0", "012", 7):
        with pytest.raises(ReplyError, match=rf"^client 2 \(partition 1\): metric 'buffer_mask' must be one '0' or '1' "
                                             rf"per array \(2\), got {mask!r}$"):
            strategy.check_reply(1, FakeProxy("2"), fit_res(big, 30, 1, {"buffer_mask": mask}))


def test_without_a_global_model_yet_the_round_is_the_plain_average_and_one_reply_averages_alone():
    a = [np.full((2, 2), 1.0, np.float32)]
    b = [np.full((2, 2), 4.0, np.float32)]
    replies = [(FakeProxy("1"), fit_res(a, 10, 0)), (FakeProxy("2"), fit_res(b, 30, 1))]
    checked = [PFedMe(num_clients=2, initial_arrays=a).check_reply(1, proxy, res) for proxy, res in replies]
    fresh = PFedMe(num_clients=2, beta=BETA)  # no global model yet to take the beta step from
    close(fresh.aggregate_replies(1, checked), [np.full((2, 2), 3.25, np.float32)], atol=1e-6)
    alone = PFedMe(num_clients=2, initial_arrays=[np.zeros((2, 2), np.float32)], beta=BETA, weighting="uniform")
    out = parameters_to_ndarrays(alone.aggregate_fit(1, replies[1:], [])[0])
    close(out, [np.full((2, 2), BETA * 4.0, np.float32)], atol=1e-5)


def test_options_reach_the_client_and_strategy_and_bad_ones_are_refused():
    raw = {"algorithm": "pfedme", "num-clients": 2, "num-server-rounds": 2, "pfedme.lam": 4.0, "pfedme.k": 2,
           "pfedme.personal-lr": 0.03, "pfedme.beta": 2.0, "pfedme.weighting": "uniform"}
    experiment = parse_experiment(raw)
    spec = ALGORITHMS["pfedme"]
    assert spec.client_kwargs(experiment.options) == {"lam": 4.0, "k": 2, "personal_lr": 0.03}
    strategy = build_strategy(experiment)
    assert isinstance(strategy, PFedMe) and (strategy.beta, strategy.weighting) == (2.0, "uniform")
    assert isinstance(build_strategy(parse_experiment({**raw, "aggregate": "trimmed-mean"})), PFedMe)
    defaults = spec.options()
    assert (defaults.lam, defaults.k, defaults.personal_lr, defaults.beta, defaults.weighting) == (15.0, 5, 0.01, 1.0, "examples")
    for key, value in (("lam", 0.0), ("k", 0), ("personal-lr", -0.1), ("beta", 0.0), ("weighting", "median")):
        with pytest.raises(ConfigError, match=f"pfedme.{key}"):
            parse_experiment({**raw, f"pfedme.{key}": value})
    for beta in (float("inf"), 0.0, -1.0, True, "2"):
        with pytest.raises(ConfigError, match=r"^PFedMe: beta \(pfedme\.beta\) must be a finite number > 0 \(1 = plain "
                                              rf"averaging\), got {re.escape(repr(beta))}$"):
            PFedMe(num_clients=2, beta=beta)
    with pytest.raises(ConfigError, match=r"^PFedMe: weighting \(pfedme\.weighting\) = 'median' is not allowed; choose one "
                                          r"of 'examples', 'uniform'$"):
        PFedMe(num_clients=2, weighting="median")
    assert PFedMe(num_clients=2).beta == 1.0 and PFedMe(num_clients=2).weighting == "examples"
    with pytest.raises(ConfigError, match=r"^PFedMe: pfedme\.weighting='uniform' cannot be used with secure-aggregation: "
                                          r"SecAgg\+ weights every reply by its number of examples; use "
                                          r"pfedme\.weighting='examples'$"):
        PFedMe(num_clients=2, weighting="uniform", secure_aggregation=True)
    assert PFedMe(num_clients=2, weighting="examples", secure_aggregation=True).secure_aggregation
    for bad in ({"lam": -1.0}, {"k": 0}, {"personal_lr": 0.0}, {"k": True}, {"k": 2.5}, {"personal_lr": True},
                {"personal_lr": "0.1"}, {"personal_lr": float("inf")}):
        with pytest.raises(ValueError, match="pFedMe"):
            client(0, **bad)
    assert client(0, k=1).k == 1  # one inner step is allowed


def test_a_client_built_by_keywords_keeps_them_and_the_papers_defaults():
    config = train_config()
    c = PFedMeClient(context=context(0), model=make_model(3), data=make_data(SIZES[0], 0), train_config=config)
    assert c.train_config is config and (c.lam, c.k, c.personal_optimizer.learning_rate) == (15.0, 5, 0.01)
    assert (c.personal_optimizer.name, c.personal_optimizer.momentum, c.personal_optimizer.weight_decay) == ("sgd", 0.0, 0.0)


def test_each_batch_is_repeated_k_times_and_counted_so():
    from flwr_pfl.clients.pfedme import RepeatedBatches

    loader = make_data(SIZES[1], 1).train  # 18 samples, batches of 6
    repeated = RepeatedBatches(loader, 4)
    assert len(repeated) == 3 * 4 and repeated.dataset is loader.dataset
    batches = list(repeated)
    assert len(batches) == 12
    for i, batch in enumerate(batches):
        assert torch.equal(batch[0], batches[4 * (i // 4)][0])  # the same batch k times in a row
    assert not torch.equal(batches[0][0], batches[4][0])


def test_the_fit_reports_the_inner_loops_figures_and_a_bad_batch_names_the_client(monkeypatch):
    import dataclasses

    from flwr_pfl.clients import pfedme

    real = pfedme.train
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return dataclasses.replace(real(*args, **kwargs), loss=1.25, seconds=2.5)

    monkeypatch.setattr(pfedme, "train", spy)
    c = client(0)
    _, _, metrics = c.fit(global_arrays(), {"server-round": 1})
    assert (metrics["train_loss"], metrics["train_seconds"]) == (1.25, 2.5)
    assert seen[0]["device"] == c.device and seen[0]["keys"] is c.data.batch_keys
    monkeypatch.setattr(pfedme, "train", real)
    broken = client(1)
    broken.data.train.dataset.tensors[0][0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="partition 1"):
        broken.fit(global_arrays(), {"server-round": 1})


def test_a_regression_client_solves_its_inner_problem_on_the_squared_error():
    torch.manual_seed(0)
    x = torch.randn(12, 5)
    y = x.sum(1)
    loader = DataLoader(TensorDataset(x, y, torch.zeros(12, dtype=torch.long)), batch_size=BATCH, shuffle=False)
    data = LocalData(loader, loader, task="regression")
    model = EncoderHeadModel(nn.Sequential(nn.Linear(5, 4), nn.Tanh()), 4, 1)
    c = PFedMeClient(context(0), model, data, train_config(), lam=LAM, k=K, personal_lr=PLR)
    start = get_arrays(model, "all")
    arrays, _, metrics = c.fit([a.copy() for a in start], {"server-round": 1})
    assert np.isfinite(metrics["train_loss"]) and any(not np.array_equal(a, b) for a, b in zip(arrays, start))
