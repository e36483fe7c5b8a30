"""kNN-Per's client and strategy through the Flower layer (flwr_pfl/clients/knnper.py,
flwr_pfl/strategies/knnper.py), on a user's BatchNorm + dropout model (head ``fc2``) and three
clients of unequal sizes (12, 20, 30 training samples, 8 validation, 10 test, two domains).

Every evaluation is replayed by hand in float64 numpy: the eval-mode representation written
out layer by layer (BatchNorm with its running statistics, no dropout), the kNN vote with loops,
lambda chosen on the validation split by accuracy, then loss, then smallness, and the mixture's
figures on the test split."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from torch.utils.data import DataLoader, TensorDataset

import flwr_pfl.app.entries.knnper  # noqa: F401  (registers "knn-per")
from fakes import BatchNormDropoutNet, FakeProxy, NumPyProxy, client_manager, fit_res
from fakes import assert_arrays_close as close
from flwr_pfl.app.checkpoint import read_checkpoint, write_checkpoint
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.clients.fedavg import FedAvgClient
from flwr_pfl.clients.knnper import EXPORT_KEYS, KNNPerClient
from flwr_pfl.core.knnper import PROBABILITY_FLOOR, datastore_indices, lambda_grid
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.knnper import KNNPer
from flwr_pfl.training import OptimizerConfig, client_seed

SIZES, VAL, TEST = (12, 20, 30), 8, 10
K, TEMPERATURE, STEP = 3, 0.5, 0.125
GRID = lambda_grid(STEP)
KEYS = list(BatchNormDropoutNet().state_dict())


# ------------------------------------------------------------------------------ data, model, clients
def samples(pid: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n samples of 6 features shifted by the class (3) and the partition; domains alternate."""
    g = torch.Generator().manual_seed(100 * pid + seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 6, generator=g) + 0.9 * y[:, None].float() * torch.tensor([1.0, -1.0, 0.5, 0.0, 0.7, -0.3])
    return x + 0.4 * pid, y, torch.arange(n) % 2


def make_data(pid: int, val: bool = True, test_labels: torch.Tensor | None = None,
              val_labels: torch.Tensor | None = None) -> LocalData:
    x, y, d = samples(pid, SIZES[pid], 1)
    vx, vy, vd = samples(pid, VAL, 2)
    tx, ty, td = samples(pid, TEST, 3)
    vy = vy if val_labels is None else val_labels
    ty = ty if test_labels is None else test_labels
    return LocalData(
        train=DataLoader(TensorDataset(x, y, d), batch_size=8, shuffle=True),
        val=DataLoader(TensorDataset(vx, vy, vd), batch_size=5) if val else None,
        test=DataLoader(TensorDataset(tx, ty, td), batch_size=4),
        num_domains=2,
    )


def context(pid: int) -> Context:
    return Context(run_id=1, node_id=10 + pid, node_config={"partition-id": pid}, state=RecordDict(), run_config={})


def train_config() -> TrainConfig:
    return TrainConfig(batch_size=8, device="cpu", optimizer=OptimizerConfig("sgd", 0.1, momentum=0.5), seed=4)


def client(pid: int, ctx: Context | None = None, data: LocalData | None = None, **options) -> KNNPerClient:
    torch.manual_seed(0)
    kwargs = {"k": K, "temperature": TEMPERATURE, "lambda_step": STEP} | options
    return KNNPerClient(ctx or context(pid), BatchNormDropoutNet(), data or make_data(pid), train_config(),
                        head="fc2", **kwargs)


def global_arrays() -> list[np.ndarray]:
    """A global model whose BatchNorm running statistics are far from any batch's (so train-mode
    features would differ) and whose step counter is not 0."""
    torch.manual_seed(3)
    net = BatchNormDropoutNet()
    with torch.no_grad():
        net.bn.running_mean.copy_(torch.randn(8) * 0.6)
        net.bn.running_var.copy_(torch.rand(8) + 0.4)
        net.bn.weight.copy_(1 + 0.3 * torch.randn(8))
        net.bn.bias.copy_(0.2 * torch.randn(8))
        net.fc2.weight.mul_(3.0)
        net.bn.num_batches_tracked.fill_(7)
    return [v.detach().numpy().copy() for v in net.state_dict().values()]


# ------------------------------------------------------------------------------ the replay by hand
def representation(arrays: list[np.ndarray], x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(phi(x), logits) in float64, eval mode written out: fc1, BatchNorm with the running
    statistics, ReLU (dropout is the identity), then the head fc2."""
    p = {k: np.asarray(a, np.float64) for k, a in zip(KEYS, arrays)}
    h = x.numpy().astype(np.float64) @ p["fc1.weight"].T + p["fc1.bias"]
    h = (h - p["bn.running_mean"]) / np.sqrt(p["bn.running_var"] + 1e-5) * p["bn.weight"] + p["bn.bias"]
    z = np.maximum(h, 0.0)
    return z, z @ p["fc2.weight"].T + p["fc2.bias"]


def vote(zq: np.ndarray, zs: np.ndarray, ys: np.ndarray, skip: list[int] | None = None) -> np.ndarray:
    """p_kNN with loops: per query, entries by (squared distance, index), the first K (its own
    entry skipped), weights exp(-d / (D T)) normalised, summed per class."""
    out = np.zeros((len(zq), 3))
    for q, point in enumerate(zq):
        cands = sorted((float(((point - s) ** 2).sum()), i) for i, s in enumerate(zs) if not (skip and skip[q] == i))
        chosen = cands[:K]
        w = [math.exp(-(d - chosen[0][0]) / (zs.shape[1] * TEMPERATURE)) for d, _ in chosen]
        for wi, (_, i) in zip(w, chosen):
            out[q, ys[i]] += wi / sum(w)
    return out


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def scores(pk: np.ndarray, logits: np.ndarray, y: np.ndarray, lam: float) -> tuple[int, float, np.ndarray]:
    """(correct, mean capped NLL, predictions) of lam pk + (1 - lam) softmax(logits)."""
    p = lam * pk + (1 - lam) * softmax(logits)
    picked = np.maximum(p[np.arange(len(y)), y], PROBABILITY_FLOOR)
    return int((p.argmax(1) == y).sum()), float(-np.log(picked).mean()), p.argmax(1)


def choose(pk: np.ndarray, logits: np.ndarray, y: np.ndarray) -> float:
    """Most correct, then lowest loss, then smallest lambda of GRID."""
    return max(GRID, key=lambda lam: (scores(pk, logits, y, lam)[0], -scores(pk, logits, y, lam)[1], -lam))


def replay(pid: int, arrays: list[np.ndarray], data: LocalData, lam: float | None = None) -> dict[str, float]:
    """The evaluate metrics client ``pid`` must report, computed by hand."""
    x, y, _ = data.train.dataset.tensors
    zs, _ = representation(arrays, x)
    vx, vy, _ = data.val.dataset.tensors
    vz, vlogits = representation(arrays, vx)
    if lam is None:
        lam = choose(vote(vz, zs, y.numpy()), vlogits, vy.numpy())
    tx, ty, td = data.test.dataset.tensors
    tz, tlogits = representation(arrays, tx)
    pk = vote(tz, zs, y.numpy())
    correct, loss, pred = scores(pk, tlogits, ty.numpy(), lam)
    g_correct, g_loss, _ = scores(pk, tlogits, ty.numpy(), 0.0)
    out = {"knn_lambda": lam, "loss": loss, "accuracy": correct / TEST, "global_accuracy": g_correct / TEST,
           "global_loss": g_loss, "knn_accuracy": float((pk.argmax(1) == ty.numpy()).mean())}
    for m in (0, 1):
        out[f"acc_d{m}"] = float((pred[td.numpy() == m] == ty.numpy()[td.numpy() == m]).mean())
    return out


def evaluate(c: KNNPerClient, arrays: list[np.ndarray], server_round: int = 1):
    return c.evaluate([a.copy() for a in arrays], {"server-round": server_round})


# ------------------------------------------------------------------------------ evaluation
@pytest.mark.parametrize("pid", [0, 1, 2])
def test_each_client_reports_the_mixture_with_lambda_chosen_on_validation_replayed_by_hand(pid):
    arrays = global_arrays()
    data = make_data(pid)
    loss, n, metrics = evaluate(client(pid, data=data), arrays)
    hand = replay(pid, arrays, data)
    assert n == TEST and metrics["partition_id"] == pid
    assert metrics["knn_lambda"] == hand["knn_lambda"]
    assert loss == pytest.approx(hand["loss"], rel=1e-5) and metrics["loss"] == loss
    for key in ("accuracy", "global_accuracy", "knn_accuracy", "acc_d0", "acc_d1"):
        assert metrics[key] == pytest.approx(hand[key], abs=1e-12), key
    assert metrics["global_loss"] == pytest.approx(hand["global_loss"], rel=1e-5)
    assert metrics["knn_datastore_size"] == SIZES[pid] and metrics["knn_selection_examples"] == VAL
    assert metrics["knn_selected_on_validation"] == 1.0


def test_the_chosen_lambdas_differ_between_clients_and_from_the_grid_ends():
    """The replay above is only telling if the selection is not trivial: across the clients the
    chosen lambdas are not all equal, and one lies strictly inside (0, 1)."""
    arrays = global_arrays()
    chosen = [evaluate(client(pid), arrays)[2]["knn_lambda"] for pid in range(3)]
    assert len(set(chosen)) > 1 and any(0 < lam < 1 for lam in chosen), chosen


def test_lambda_zero_is_the_global_model_and_lambda_one_the_knn_model():
    arrays, data = global_arrays(), make_data(1)
    loss0, _, m0 = evaluate(client(1, data=data, lam=0.0), arrays)
    assert m0["accuracy"] == m0["global_accuracy"] and loss0 == pytest.approx(m0["global_loss"], rel=1e-12, abs=1e-12)
    assert m0["knn_lambda"] == 0.0 and m0["knn_selection_examples"] == 0 and m0["knn_selected_on_validation"] == 0
    loss1, _, m1 = evaluate(client(1, data=data, lam=1.0), arrays)
    assert m1["accuracy"] == m1["knn_accuracy"] == pytest.approx(replay(1, arrays, data, lam=1.0)["accuracy"])
    assert loss1 == pytest.approx(replay(1, arrays, data, lam=1.0)["loss"], rel=1e-5)
    assert m1["accuracy"] != m0["accuracy"]  # the two ends are different models on this client


def test_lambda_is_chosen_on_the_validation_split_and_never_on_the_test_split():
    """Test labels made to favour the kNN model and validation labels the global model (each is
    that model's own prediction): the chosen lambda is the validation split's (by hand), which a
    selection on the test split would not give; relabelling the test split changes nothing of it,
    relabelling the validation split changes it."""
    arrays, pid = global_arrays(), 2
    base = make_data(pid)
    x, y, _ = base.train.dataset.tensors
    zs, _ = representation(arrays, x)
    tz, tlogits = representation(arrays, base.test.dataset.tensors[0])
    vz, vlogits = representation(arrays, base.val.dataset.tensors[0])
    knn_test = torch.tensor(vote(tz, zs, y.numpy()).argmax(1))
    global_val = torch.tensor(vlogits.argmax(1))
    knn_val = torch.tensor(vote(vz, zs, y.numpy()).argmax(1))
    data = make_data(pid, test_labels=knn_test, val_labels=global_val)
    chosen = evaluate(client(pid, data=data), arrays)[2]["knn_lambda"]
    on_val = choose(vote(vz, zs, y.numpy()), vlogits, global_val.numpy())
    on_test = choose(vote(tz, zs, y.numpy()), tlogits, knn_test.numpy())
    assert chosen == on_val and on_val != on_test
    relabelled_test = make_data(pid, test_labels=torch.tensor(tlogits.argmax(1)), val_labels=global_val)
    assert evaluate(client(pid, data=relabelled_test), arrays)[2]["knn_lambda"] == chosen
    relabelled_val = make_data(pid, test_labels=knn_test, val_labels=knn_val)
    assert evaluate(client(pid, data=relabelled_val), arrays)[2]["knn_lambda"] != chosen


def test_without_a_validation_split_lambda_is_chosen_by_leave_one_out_on_the_training_split():
    arrays, pid = global_arrays(), 1
    data = make_data(pid, val=False)
    with pytest.warns(RuntimeWarning, match="validation split"):
        _, _, metrics = evaluate(client(pid, data=data), arrays)
    x, y, _ = data.train.dataset.tensors
    zs, logits = representation(arrays, x)
    expected = choose(vote(zs, zs, y.numpy(), skip=list(range(len(y)))), logits, y.numpy())
    with_self = choose(vote(zs, zs, y.numpy()), logits, y.numpy())
    assert metrics["knn_lambda"] == expected != with_self  # the sample's own entry must not vote
    assert metrics["knn_selection_examples"] == SIZES[pid] and metrics["knn_selected_on_validation"] == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluate(client(pid, data=data, lam=0.5), arrays)  # a fixed lambda needs no selection data


def test_features_are_taken_in_eval_mode_and_evaluation_leaves_the_model_as_it_was():
    arrays, pid = global_arrays(), 0
    c = client(pid)
    first = evaluate(c, arrays)
    x, y, _ = c.data.train.dataset.tensors
    stored = c.personal_state()
    np.testing.assert_allclose(stored[EXPORT_KEYS[0]].numpy(), representation(arrays, x)[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(stored[EXPORT_KEYS[1]], y)
    after = c.model.module.state_dict()
    close([after[k].numpy() for k in KEYS], arrays, atol=0)  # no running statistic moved
    net = copy.deepcopy(c.model.module).train()
    train_mode = torch.relu(net.bn(net.fc1(x))).detach()  # batch statistics instead of the running ones
    assert not np.allclose(train_mode.numpy(), stored[EXPORT_KEYS[0]].numpy(), atol=1e-2)
    handler = type(c).evaluate.__wrapped__  # without the per-message seeding
    answers = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        answers.append(handler(c, [a.copy() for a in arrays], {"server-round": 1}))
    assert answers[0] == answers[1] and answers[0][:2] == first[:2]


def test_the_capacity_keeps_one_fixed_random_subset_per_client():
    arrays, pid = global_arrays(), 1
    ctx = context(pid)
    _, _, metrics = evaluate(client(pid, ctx, capacity=0.4), arrays)
    assert metrics["knn_datastore_size"] == 8  # floor(0.4 * 20)
    rows = datastore_indices(SIZES[pid], 0.4, torch.Generator().manual_seed(client_seed(4, pid, 0)))
    x, y, _ = make_data(pid).train.dataset.tensors
    first = client(pid, ctx, capacity=0.4)
    evaluate(first, arrays, server_round=2)
    np.testing.assert_allclose(first.personal_state()[EXPORT_KEYS[0]].numpy(), representation(arrays, x[rows])[0],
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(first.personal_state()[EXPORT_KEYS[1]], y[rows])
    again = client(pid, context(pid), capacity=0.4)  # another round, a new object: the same memory
    evaluate(again, arrays, server_round=5)
    assert torch.equal(again.personal_state()[EXPORT_KEYS[1]], y[rows])
    other = datastore_indices(SIZES[pid], 0.4, torch.Generator().manual_seed(client_seed(4, 2, 0)))
    assert not torch.equal(rows, other)


def test_the_export_is_the_evaluated_model():
    arrays, pid = global_arrays(), 2
    c = client(pid)
    assert c.personal_state() == {}
    loss, _, metrics = evaluate(c, arrays)
    saved = c.personal_state()
    assert list(saved) == list(EXPORT_KEYS) and saved[EXPORT_KEYS[2]].item() == metrics["knn_lambda"]
    fresh = client(pid)
    fresh.model.load_state_dict({k: torch.as_tensor(a) for k, a in zip(fresh.model.state_dict(), arrays)})
    result = fresh.evaluate_personal(saved)
    assert result.loss == loss and result.accuracy == metrics["accuracy"]
    with pytest.raises(KeyError, match="knn-per:lambda"):
        fresh.evaluate_personal({k: v for k, v in saved.items() if k != EXPORT_KEYS[2]})


# ------------------------------------------------------------------------------ training and the server
def test_fit_is_fedavgs_and_nothing_is_kept_between_rounds():
    arrays = global_arrays()
    ctx = context(1)
    knn = client(1, ctx)
    reply = knn.fit([a.copy() for a in arrays], {"server-round": 3})
    torch.manual_seed(0)
    fedavg = FedAvgClient(context(1), BatchNormDropoutNet(), make_data(1), train_config(), head="fc2")
    expected = fedavg.fit([a.copy() for a in arrays], {"server-round": 3})
    close(reply[0], expected[0], atol=0)
    assert reply[1] == expected[1] == SIZES[1] and reply[2]["train_loss"] == expected[2]["train_loss"]
    evaluate(knn, reply[0])
    assert len(ctx.state) == 0  # nothing personal persists: the datastore is rebuilt every evaluation
    assert evaluate(client(1, ctx), reply[0])[:2] == evaluate(knn, reply[0])[:2]


def strategy(**kwargs) -> KNNPer:
    return KNNPer(num_clients=3, seed=0, **({"on_round": None} | kwargs))


def run_round(s: KNNPer, rnd: int, params, contexts, rows: list | None = None):
    proxies = [NumPyProxy(str(70 + pid), pid, client(pid, contexts[pid])) for pid in range(3)]
    cm = client_manager(proxies)
    results = [(p, p.fit(ins, None, rnd)) for p, ins in s.configure_fit(rnd, params, cm)]
    new, metrics = s.aggregate_fit(rnd, results, [])
    evals = [(p, p.evaluate(ins, None, rnd)) for p, ins in s.configure_evaluate(rnd, new, cm)]
    s.aggregate_evaluate(rnd, evals, [])
    return new, metrics, results, evals


def test_two_rounds_average_the_models_by_examples_and_report_each_clients_lambda():
    rows: list = []
    s = strategy(on_round=lambda *row: rows.append(row))
    contexts = [context(pid) for pid in range(3)]
    params = ndarrays_to_parameters(global_arrays())
    for rnd in (1, 2):
        received = parameters_to_ndarrays(params)
        params, metrics, results, evals = run_round(s, rnd, params, contexts)
        replies = [parameters_to_ndarrays(r.parameters) for _, r in results]
        sizes = [r.num_examples for _, r in results]
        assert sorted(sizes) == sorted(SIZES) and metrics["num_rejected"] == 0
        for i, out in enumerate(parameters_to_ndarrays(params)):
            expected = sum(n * np.asarray(r[i], np.float64) for n, r in zip(sizes, replies)) / sum(sizes)
            if np.issubdtype(out.dtype, np.integer):
                assert out == np.rint(expected).astype(out.dtype)
            else:
                np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)
        new = parameters_to_ndarrays(params)
        for proxy, res in evals:
            hand = replay(proxy.pid, new, make_data(proxy.pid))
            assert res.metrics["knn_lambda"] == hand["knn_lambda"] and res.loss == pytest.approx(hand["loss"], rel=1e-5)
        assert not all(np.array_equal(a, b) for a, b in zip(received, new))
    _, phase, summary, clients = rows[-1]
    assert phase == "evaluate" and sorted(clients) == [0, 1, 2]
    lams = [clients[pid]["knn_lambda"] for pid in range(3)]
    assert summary["knn_lambda_wmean"] == pytest.approx(np.mean(lams))  # equal test splits: equal weights
    assert summary["global_accuracy_wmean"] == pytest.approx(np.mean([clients[p]["global_accuracy"] for p in range(3)]))


def test_a_resumed_strategy_runs_the_next_round_exactly_as_the_uninterrupted_one(tmp_path):
    contexts = [context(pid) for pid in range(3)]
    s = strategy(fraction_fit=0.67)
    params, _, _, _ = run_round(s, 1, ndarrays_to_parameters(global_arrays()), contexts)
    saved = read_checkpoint(write_checkpoint(tmp_path, 1, {"algorithm": "knn-per"}, {}, s.state_dict()))
    straight, _, fits, evals = run_round(s, 2, params, [context(pid) for pid in range(3)])
    resumed = strategy(fraction_fit=0.67)
    resumed.load_state_dict(saved.state, saved.rounds_done)
    again, _, fits2, evals2 = run_round(resumed, 1, ndarrays_to_parameters(resumed.global_arrays), [context(pid) for pid in range(3)])
    assert [p.pid for p, _ in fits] == [p.pid for p, _ in fits2] and len(fits) == 2
    close(parameters_to_ndarrays(again), parameters_to_ndarrays(straight), atol=0)
    assert [(r.loss, r.metrics) for _, r in evals] == [(r.loss, r.metrics) for _, r in evals2]


def test_bad_replies_are_rejected_and_the_round_goes_on():
    good = [global_arrays(), [a * 2 for a in global_arrays()]]
    good[1][6] = good[0][6]  # the step counter stays an integer
    nan = [a.copy() for a in good[0]]
    nan[0][0, 0] = np.nan
    wrong_shape = [a.copy() for a in good[0]]
    wrong_shape[7] = np.zeros((4, 8), np.float32)
    s = strategy()
    s.global_arrays = global_arrays()
    results = [
        (FakeProxy("0", 0), fit_res(good[0], 10, 0)),
        (FakeProxy("1", 1), fit_res(good[1], 30, 1)),
        (FakeProxy("2", 2), fit_res(nan, 20, 2)),
        (FakeProxy("3", 3), fit_res(wrong_shape, 20, 3)),
        (FakeProxy("4", 4), fit_res(good[0][:-1], 20, 4)),
    ]
    params, metrics = s.aggregate_fit(1, results, [])
    assert metrics["num_rejected"] == 3
    out = parameters_to_ndarrays(params)
    close(out[:6], [(10 * a + 30 * b) / 40 for a, b in zip(good[0][:6], good[1][:6])], atol=1e-6)


# ------------------------------------------------------------------------------ options and refusals
def test_the_options_reach_the_client_and_bad_values_name_the_key():
    spec = ALGORITHMS["knn-per"]
    default = spec.client_kwargs(spec.options())
    assert default == {"k": 10, "lam": None, "lambda_step": 0.01, "capacity": 1.0, "temperature": 1.0}
    experiment = parse_experiment({"algorithm": "knn-per", "knn-per.k": 4, "knn-per.lam": 0.3,
                                   "knn-per.lambda-step": 0.05, "knn-per.capacity": 0.5, "knn-per.temperature": 2.0})
    kwargs = spec.client_kwargs(experiment.options)
    assert kwargs == {"k": 4, "lam": 0.3, "lambda_step": 0.05, "capacity": 0.5, "temperature": 2.0}
    c = KNNPerClient(context(0), BatchNormDropoutNet(), make_data(0), train_config(), head="fc2", **kwargs)
    assert (c.k, c.lam, len(c.grid), c.capacity, c.temperature) == (4, 0.3, 21, 0.5, 2.0)
    for key, value, allowed in (("k", 0, ">= 1"), ("lam", 1.5, "-1"), ("lam", -0.5, "-1"), ("lambda-step", 0.0, r"\(0, 1\]"),
                                ("capacity", 0.0, r"\(0, 1\]"), ("temperature", 0.0, "> 0")):
        with pytest.raises(ConfigError, match=f"knn-per.{key} must .*{allowed}"):
            parse_experiment({"algorithm": "knn-per", f"knn-per.{key}": value})


def test_models_tasks_and_options_the_method_cannot_use_are_refused():
    data = make_data(0)
    with pytest.raises(ConfigError, match="head"):
        KNNPerClient(context(0), BatchNormDropoutNet(), data, train_config())
    with pytest.raises(ConfigError, match="classification"):
        KNNPerClient(context(0), BatchNormDropoutNet(), LocalData(data.train, data.test, task="regression"),
                     train_config(), head="fc2")
    for bad in ({"k": 2.5}, {"lam": -1.0}, {"lambda_step": 2.0}, {"capacity": 1.5}, {"temperature": math.inf}):
        with pytest.raises(ConfigError, match="kNN-Per"):
            client(0, **bad)
