"""FEDORA's NumPyClient and Strategy message by message, against independent computations.

The client tests build :class:`FEDORAClient` on a tiny model (Linear(5, 4) + tanh body, a 3-class
head) with unshuffled loaders of two batches, so that every round's training can be replayed by a
hand-written SGD loop (``reference_sgd``): the selection weight of Eq. 8 (its direction), the
proximal term of Eq. 9 in both modes (its sign, its reference ``theta_hat_k``, the post-step
correction's "before" parameters), the model a round starts from (``context.state`` or, on first
contact, ``theta_hat_k``), what is uploaded and stored, the LOCAL shadow model and evaluation.

The strategy tests drive :class:`FEDORA` with fake client proxies: the setup exchange, the
auxiliary model each client is sent, ``Theta_hat = M Theta`` after an aggregation (Eq. 6), a
sampled client that failed (its ``theta_hat_k`` is frozen), R-Acc / PTR and the best-validation
round.

The last test is end to end (in process): the adaptive rule of Eq. 8 against a constant lambda.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Context, RecordDict
from flwr.common import Code, EvaluateRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from torch.utils.data import DataLoader, TensorDataset

from flwr_pfl.clients import FEDORAClient
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.core import fedora as core
from flwr_pfl.strategies import FEDORA
from flwr_pfl.strategies.fedora import client_rule_config
from flwr_pfl.training import OptimizerConfig, get_arrays, load_arrays, save_arrays, set_arrays

from fakes import FakeProxy, arrays_of, assert_arrays_close, client_manager, fit_res, load_test_module, tiny_model

LR = 0.3
BATCH = 6


# ------------------------------------------------------------------------------ client helpers
def dataset(teacher: list[np.ndarray], n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and the labels ``teacher`` predicts (so that ``teacher`` has a low loss)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    model = tiny_model()
    set_arrays(model, teacher)
    with torch.no_grad():
        y = model(x).argmax(1)
    return x, y


TEACHER = arrays_of(7, scale=3.0)
TRAIN = dataset(TEACHER, 2 * BATCH, 1)
VAL = dataset(TEACHER, 10, 2)
TEST = dataset(TEACHER, 10, 3)


def local_data() -> LocalData:
    def loader(xy, bs):
        return DataLoader(TensorDataset(*xy), batch_size=bs, shuffle=False)

    return LocalData(train=loader(TRAIN, BATCH), test=loader(TEST, 64), val=loader(VAL, 64))


def make_client(state: RecordDict | None = None, epochs: int = 2, pid: int = 2, **kwargs) -> FEDORAClient:
    context = Context(run_id=1, node_id=1, node_config={"partition-id": pid}, state=state if state is not None else RecordDict(), run_config={})
    train_config = TrainConfig(local_epochs=epochs, batch_size=BATCH, optimizer=OptimizerConfig("sgd", LR), device="cpu")
    return FEDORAClient(context, tiny_model(99), local_data(), train_config, **kwargs)


def fit_config(config: core.FedoraConfig, local_baseline: bool = True, server_round: int = 1) -> dict:
    return {"fedora-phase": "train", "server-round": server_round, **client_rule_config(config, local_baseline)}


def rule_config(rule: str = "paper", constant: float = 1.0, factor: float = 2.0, mode: str = "loss") -> core.FedoraConfig:
    return core.FedoraConfig(selection=core.LambdaOptions(rule=rule, constant=constant),
                             prox=core.ProxOptions(factor=factor, mode=mode))


def val_loss(arrays: list[np.ndarray], xy=VAL) -> float:
    model = tiny_model()
    set_arrays(model, arrays)
    with torch.no_grad():
        return float(F.cross_entropy(model(xy[0]), xy[1]))


def accuracy(arrays: list[np.ndarray], xy=TEST) -> float:
    model = tiny_model()
    set_arrays(model, arrays)
    with torch.no_grad():
        return float((model(xy[0]).argmax(1) == xy[1]).float().mean())


def reference_sgd(start, epochs: int, aux=None, lam: float = 0.0, factor: float = 2.0, mode: str = "loss"):
    """Plain SGD over the two batches in order; with ``lam`` > 0 the proximal term of Eq. 9
    toward ``aux``: added to the loss (``(factor / 2) lam ||theta - aux||^2``) or, ``post_step``,
    ``theta -= LR factor lam (theta_before_step - aux)`` after each step."""
    model = tiny_model()
    set_arrays(model, start)
    params = list(model.parameters())
    anchor = [torch.from_numpy(a) for a in aux] if aux is not None else None
    x, y = TRAIN
    for _ in range(epochs):
        for b in range(0, len(y), BATCH):
            before = [p.detach().clone() for p in params]
            loss = F.cross_entropy(model(x[b:b + BATCH]), y[b:b + BATCH])
            if lam > 0 and mode == "loss":
                loss = loss + 0.5 * factor * lam * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor))
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p -= LR * g
                if lam > 0 and mode == "post_step":
                    for p, pb, a in zip(params, before, anchor):
                        p -= LR * factor * lam * (pb - a)
    return get_arrays(model)


def stored(state: RecordDict, key: str = "personal"):
    return load_arrays(state, key)


# ------------------------------------------------------------------------------ client: Eq. 8
@pytest.mark.parametrize("personal_is_worse", [True, False], ids=["aux-better", "personal-better"])
def test_lambda_is_eq8_on_the_validation_split(personal_is_worse):
    """Delta = L~(theta_k) - L~(theta_hat_k) on the *validation* split, before training; the paper
    rule lambda = max(eps, Delta) pulls only when the auxiliary model generalises better, and the
    round trains with exactly that lambda."""
    good, bad = TEACHER, arrays_of(11)
    personal, aux = (bad, good) if personal_is_worse else (good, bad)
    state = RecordDict()
    save_arrays(state, "personal", personal)
    client = make_client(state)
    config = rule_config("paper")
    arrays, n, metrics = client.fit(aux, fit_config(config))
    lp, la = val_loss(personal), val_loss(aux)
    assert val_loss(personal, TRAIN) != pytest.approx(lp, abs=1e-3)  # the splits tell apart
    assert metrics["val_loss_personal"] == pytest.approx(lp, rel=1e-5)
    assert metrics["val_loss_aux"] == pytest.approx(la, rel=1e-5)
    assert metrics["delta"] == pytest.approx(lp - la, rel=1e-5)
    expected_lam = max(config.selection.epsilon, lp - la)
    assert metrics["lambda"] == pytest.approx(expected_lam, rel=1e-5)
    assert metrics["lambda_active"] == float(personal_is_worse)
    assert (lp > la) is personal_is_worse
    assert_arrays_close(arrays, reference_sgd(personal, 2, aux, expected_lam))
    assert n == len(TRAIN[1])


# ------------------------------------------------------------------------------ client: Eq. 9
@pytest.mark.parametrize("mode,factor", [("loss", 1.0), ("post_step", 2.0)])
def test_proximal_term_pulls_toward_theta_hat(mode, factor):
    """An active constant lambda: the round equals SGD from the stored theta_k with the proximal
    term toward the received theta_hat_k (added to the loss, or the official post-step correction
    against the parameters from just before each step). The upload is the trained theta_k, which
    is also what context.state keeps; theta_hat_k is not."""
    personal, aux = arrays_of(3), arrays_of(4)
    state = RecordDict()
    save_arrays(state, "personal", personal)
    client = make_client(state)
    lam = 0.8
    arrays, _, metrics = client.fit(aux, fit_config(rule_config("constant", lam, factor, mode), local_baseline=False))
    assert metrics["lambda"] == pytest.approx(lam)
    expected = reference_sgd(personal, 2, aux, lam, factor, mode)
    assert_arrays_close(arrays, expected)
    assert_arrays_close(stored(state), expected)
    # the pull is visible: without it the result is farther from theta_hat_k
    free = reference_sgd(personal, 2)
    dist = lambda xs: sum(float(((x - a) ** 2).sum()) for x, a in zip(xs, aux))  # noqa: E731
    assert dist(arrays) < dist(free) - 0.05 * dist(free)


def test_first_contact_starts_from_theta_hat_and_stores_theta_k():
    """No personal model yet: theta_k := theta_hat_k (Delta = 0, so the paper rule gives eps);
    afterwards context.state holds the trained theta_k and the LOCAL shadow model."""
    aux = arrays_of(5)
    state = RecordDict()
    client = make_client(state)
    arrays, _, metrics = client.fit(aux, fit_config(rule_config("paper")))
    assert metrics["first_contact"] == 1.0 and metrics["delta"] == 0.0
    expected = reference_sgd(aux, 2)  # lambda = eps: no visible pull
    assert_arrays_close(arrays, expected, atol=1e-5)
    assert_arrays_close(stored(state), arrays, atol=0)
    assert_arrays_close(stored(state, "fedora-local"), expected, atol=1e-5)


def test_local_shadow_model_keeps_its_own_state():
    """The LOCAL shadow model starts from theta_hat at first contact and then continues from its
    own stored model, whatever theta_hat_k the server sends later."""
    state = RecordDict()
    first, second = arrays_of(5), arrays_of(6)
    make_client(state).fit(first, fit_config(rule_config("paper")))
    make_client(state).fit(second, fit_config(rule_config("paper"), server_round=2))
    expected = reference_sgd(reference_sgd(first, 2), 2)
    assert_arrays_close(stored(state, "fedora-local"), expected, atol=1e-5)


def test_client_takes_the_servers_rules():
    """The strategy's fit config (every option away from its default) overrides the client's
    defaults key by key."""
    config = core.FedoraConfig(
        selection=core.LambdaOptions(rule="official", epsilon=1e-3, constant=2.5, lambda_max=7.0, on_nonfinite="no_transfer"),
        prox=core.ProxOptions(factor=1.0, mode="post_step"),
        validation=core.ValidationOptions(metric="error_rate", reduction="sum_of_batch_means", batch_size=16),
    )
    client = make_client()
    sel, prox, val, local = client.rules(fit_config(config, local_baseline=False))
    assert (sel, prox, val, local) == (config.selection, config.prox, config.validation, False)
    assert make_client().rules({})[:3] == (core.LambdaOptions(), core.ProxOptions(), core.ValidationOptions())
    constant = fit_config(rule_config("constant", constant=2.5), local_baseline=False)
    _, _, metrics = make_client().fit(arrays_of(5), constant)
    assert metrics["lambda"] == 2.5


def test_evaluate_uses_the_stored_personal_model():
    """Evaluation: the stored theta_k on the test split (and validation split), the LOCAL shadow
    model beside it, and theta_hat_k only as the diagnostic ``aux_accuracy``."""
    personal, local, aux = TEACHER, arrays_of(8), arrays_of(12)
    state = RecordDict()
    save_arrays(state, "personal", personal)
    save_arrays(state, "fedora-local", local)
    loss, n, metrics = make_client(state).evaluate(aux, {"server-round": 3})
    assert metrics["trained"] == 1.0
    assert metrics["accuracy"] == pytest.approx(accuracy(personal))
    assert loss == pytest.approx(val_loss(personal, TEST), rel=1e-5)
    assert metrics["val_accuracy"] == pytest.approx(accuracy(personal, VAL))
    assert metrics["local_accuracy"] == pytest.approx(accuracy(local))
    assert metrics["aux_accuracy"] == pytest.approx(accuracy(aux))
    assert accuracy(personal) != accuracy(aux) != accuracy(local)
    assert n == len(TEST[1])


# ------------------------------------------------------------------------------ strategy
K = 4
LAYOUT = arrays_of(0)


class SubspaceProxy(FakeProxy):
    """Answers the setup exchange with a canned subspace."""

    def __init__(self, cid: str, pid: int, subspace: np.ndarray) -> None:
        super().__init__(cid, pid)
        self.subspace = subspace

    def fit(self, ins, timeout, group_id):
        assert ins.config["fedora-phase"] == "setup"
        return fit_res([self.subspace], 10, self.pid)


def subspaces() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    base = rng.standard_normal(6)
    out = []
    for k in range(K):  # correlated directions: a non-trivial similarity graph
        v = base + 0.7 * k * rng.standard_normal(6)
        out.append((v / np.linalg.norm(v))[:, None].astype(np.float32))
    return out


def strategy_and_manager(**kwargs):
    config = core.FedoraConfig(graph=core.GraphOptions(top_k=2), propagation=core.PropagationOptions(kappa=0.6))
    strategy = FEDORA(num_clients=K, config=config, fraction_fit=1.0, wait_timeout=5, initial_arrays=LAYOUT, **kwargs)
    proxies = [SubspaceProxy(f"c{pid}", pid, u) for pid, u in enumerate(subspaces())]
    return strategy, client_manager(proxies), {p.pid: p for p in proxies}, config


def flat(arrays) -> np.ndarray:
    return np.concatenate([np.asarray(a, np.float32).ravel() for a in arrays])


def test_strategy_sends_each_client_its_propagated_model():
    """Round 1: every client is sent theta^0. After an aggregation of unequal uploads the server
    holds Theta_hat = M Theta (Eq. 6, M from the clients' subspaces) and round 2 sends client k
    row k of it; a sampled client that failed keeps its theta_hat_k (and its theta_k)."""
    strategy, cm, proxies, config = strategy_and_manager()
    params = ndarrays_to_parameters(LAYOUT)
    ins = strategy.configure_fit(1, params, cm)
    assert len(ins) == K
    for proxy, fit_ins in ins:
        assert fit_ins.config["fedora-phase"] == "train"
        assert_arrays_close(parameters_to_ndarrays(fit_ins.parameters), LAYOUT, atol=0)
    graph = core.build_propagation_graph([u.astype(np.float64) for u in subspaces()], config.graph, config.propagation)
    m = graph.propagation
    assert not np.allclose(m, np.eye(K))
    uploads = {pid: arrays_of(20 + pid) for pid in range(K)}
    failed = 3
    results = [(proxies[pid], fit_res(uploads[pid], 5 + 7 * pid, pid, {"lambda": 0.1}))
               for pid in range(K) if pid != failed]
    strategy.aggregate_fit(1, results, [])
    theta = np.stack([flat(uploads[pid]) if pid != failed else flat(LAYOUT) for pid in range(K)])
    expected = (m @ theta.astype(np.float64)).astype(np.float32)
    expected[failed] = flat(LAYOUT)  # frozen: its round failed
    np.testing.assert_allclose(strategy.theta, theta, atol=0)
    np.testing.assert_allclose(strategy.theta_hat, expected, atol=1e-6)
    ins = strategy.configure_fit(2, params, cm)
    sent = {proxy.pid: flat(parameters_to_ndarrays(fit_ins.parameters)) for proxy, fit_ins in ins}
    for pid in range(K):
        np.testing.assert_allclose(sent[pid], expected[pid], atol=1e-6)
    # the rules travel with every instruction
    assert {k: v for k, v in ins[0][1].config.items() if k in client_rule_config(config, True)} == client_rule_config(config, True)


def _eval_res(acc: float, local: float, val: float, local_val: float, pid: int) -> EvaluateRes:
    metrics = {"accuracy": acc, "local_accuracy": local, "val_accuracy": val, "local_val_accuracy": local_val,
               "partition_id": pid}
    return EvaluateRes(Status(Code.OK, ""), 0.5, 10, metrics)


def test_transfer_metrics_and_the_best_validation_round():
    """R-Acc = mean_k (acc_k - local_k) / local_k and PTR = share with acc_k >= local_k (Def. 3.2,
    3.3); the best-validation round is the one with the *highest* mean validation accuracy."""
    recorded = []
    strategy, cm, proxies, _ = strategy_and_manager(report_round="best_val",
                                                    on_round=lambda r, ph, m, c: recorded.append((r, ph, dict(c))))
    acc1, local1 = [0.8, 0.5, 0.9, 0.6], [0.5, 0.6, 0.6, 0.6]
    r1 = [(proxies[k], _eval_res(acc1[k], local1[k], 0.9, 0.2, k)) for k in range(K)]
    _, m1 = strategy.aggregate_evaluate(1, r1, [])
    a, b = np.array(acc1), np.array(local1)
    assert m1["r_acc"] == pytest.approx(np.mean((a - b) / b))
    assert m1["ptr"] == pytest.approx(np.mean(a >= b))
    assert m1["ptr_strict"] == pytest.approx(np.mean(a > b))
    per_client = recorded[-1][2]
    for k in range(K):
        assert per_client[k]["r_acc"] == pytest.approx((acc1[k] - local1[k]) / local1[k])
    acc2 = [0.3, 0.3, 0.3, 0.3]
    r2 = [(proxies[k], _eval_res(acc2[k], local1[k], 0.1, 0.8, k)) for k in range(K)]
    _, m2 = strategy.aggregate_evaluate(2, r2, [])
    assert m2["best_val_round"] == 1.0  # round 1 had validation accuracy 0.9, round 2 only 0.1
    assert m2["accuracy_bestval_mean"] == pytest.approx(np.mean(acc1))
    assert m2["reported_accuracy"] == pytest.approx(np.mean(acc1))
    # LOCAL's best round is chosen on its own curve: round 2 (0.8 > 0.2)
    assert m2["r_acc_bestval"] == pytest.approx(np.mean((a - b) / b))
    assert m2["r_acc"] == pytest.approx(np.mean((np.array(acc2) - b) / b))


# ------------------------------------------------------------------------------ end to end
def test_adaptive_lambda_avoids_the_negative_transfer_a_constant_lambda_suffers(tmp_path):
    """End to end (in process, the registered app): 6 clients of the rotated-prototype federation
    60 degrees apart, so every neighbour's model is a poor model for a client (2 local epochs, 4
    rounds). FEDORA's adaptive rule (Eq. 8, paper form) sees theta_hat_k validate worse than
    theta_k and keeps lambda at its floor: it matches the in-run LOCAL shadow model (R-Acc 0).
    A constant lambda = 10 (Table 5's largest) pulls every client toward its poor auxiliary model
    and loses a third of LOCAL's accuracy.

    Measured over seeds 0-7: adaptive R-Acc 0.0000 on every seed, lambda active in 0 % of
    client-rounds; constant R-Acc -0.394 .. -0.306; gap (adaptive - constant) 0.306 .. 0.394.
    Asserted on seeds 0 and 1: the gap above 0.15 (half the smallest), the adaptive R-Acc
    within 0.005 of LOCAL and its pull active in under 10 % of client-rounds (an inverted Eq. 8
    comparison turns it on in every round after the first, with too small a lambda to show in
    the accuracy).
    """
    e2e = load_test_module("app/test_fedora_e2e.py", "_fedora_e2e_helpers")
    for seed in (0, 1):
        r_acc = {}
        for name, rule in (("adaptive", {"fedora.lambda-rule": "paper"}),
                           ("constant", {"fedora.lambda-rule": "constant", "fedora.lambda-constant": 10.0})):
            cfg = {"num-clients": 6, "num-server-rounds": 4, "local-epochs": 2, "run-name": f"{name}-{seed}"} | rule
            _, clients, rows = e2e.run_synthetic(tmp_path, "fedora", seed, **cfg)
            last = [r for r in rows if r["phase"] == "evaluate"][-1]
            acc = np.array([clients[k]["accuracy"] for k in range(6)])
            local = np.array([clients[k]["local_accuracy"] for k in range(6)])
            assert last["r_acc"] == pytest.approx(np.mean((acc - local) / local))
            r_acc[name] = last["r_acc"]
            active = [r["lambda_active_mean"] for r in rows if r["phase"] == "fit"]
            if name == "constant":
                assert all(a == 1.0 for a in active)
            else:  # theta_hat_k validates worse than theta_k: Eq. 8 leaves the pull off
                assert np.mean(active) < 0.1, active
        assert abs(r_acc["adaptive"]) < 0.005, r_acc
        assert r_acc["adaptive"] - r_acc["constant"] > 0.15, r_acc
