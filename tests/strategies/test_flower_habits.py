"""Flower users' habits on every strategy: FedAvg's constructor arguments with Flower's meaning.

Each argument must have its visible effect, on the base and on at least one strategy of each
family (baselines, pFedFDA, FEDORA, FMTL, FedDAR, FedGP/FedDA): the per-round config reaches the
clients and its ``learning-rate`` changes what they train (a near-zero rate leaves the model
unchanged, a larger one matches a replay at that rate); ``evaluate_fn`` is called every round
with the current global arrays and its metrics land in the results; the aggregation functions see
the accepted replies; ``accept_failures=False`` leaves a round with a failure unaggregated;
``min_available_clients`` is what the strategy waits for; ``initial_parameters`` is
``initial_arrays``. Algorithms that cannot honour one refuse it with the reason, and so do
defaults that would silently change an algorithm (pFedFDA without ``num_rounds``).
"""

from __future__ import annotations

import copy
import re
import inspect
import logging
import types
from dataclasses import replace

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.logger import FLOWER_LOGGER
from flwr.server import Server
from flwr.server.strategy import FedAvg as FlowerFedAvg
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_pfl.clients import FedAvgClient, FedRepClient
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.errors import ConfigError
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.strategies import (
    FEDORA,
    FedAvg,
    FedDA,
    FedDAR,
    FedFMTL,
    FedGP,
    FedPer,
    FedRep,
    Finetune,
    Local,
    PFedFDA,
    PFLStrategy,
    SourceOnly,
    TargetOnly,
)
from flwr_pfl.strategies.base import SERVER_EVALUATE
from flwr_pfl.strategies.feddar import FedAvgMultiHead, ReweightedFedAvg, SeparateFedAvg
from flwr_pfl.training import OptimizerConfig, get_arrays, set_arrays, train

from fakes import (
    FakeProxy,
    NumPyProxy,
    arrays_of,
    client_manager,
    fit_res,
    load_test_module,
    manager,
    pfedfda_strategy,
    pfedfda_wire,
)
from fakes import assert_arrays_close as close

feddar_layer = load_test_module("strategies/test_feddar_flower_layer.py", "habits_feddar_layer")
fedora_layer = load_test_module("strategies/test_fedora_flower_layer.py", "habits_fedora_layer")
fedgp_layer = load_test_module("strategies/test_fedgp_flower_layer.py", "habits_fedgp_layer")
fmtl_layer = load_test_module("strategies/test_fmtl_flower_layer.py", "habits_fmtl_layer")
pfedfda_layer = load_test_module("strategies/test_pfedfda_flower_layer.py", "habits_pfedfda_layer")

CPU = torch.device("cpu")
OWN_LR = 0.3
ALL_CLASSES = [FedAvg, Finetune, FedRep, FedPer, Local, PFedFDA, FedFMTL, FedDAR, ReweightedFedAvg,
               FedAvgMultiHead, SeparateFedAvg, FEDORA, FedGP, FedDA, TargetOnly, SourceOnly]
NO_GLOBAL_MODEL = {Local: "local training has no global model", FEDORA: "FEDORA has no global model"}
EVERY_CLIENT_EVERY_ROUND = {FEDORA, FedGP, FedDA, TargetOnly, SourceOnly}


# ------------------------------------------------------------------------------------ helpers
def make_model(seed: int = 0) -> EncoderHeadModel:
    torch.manual_seed(seed)
    return EncoderHeadModel(nn.Sequential(nn.Linear(5, 4), nn.Tanh()), 4, 3)


def make_data(n: int, seed: int) -> LocalData:
    g = torch.Generator().manual_seed(100 + seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 5, generator=g) + y[:, None].float()
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)
    return LocalData(loader, DataLoader(TensorDataset(x + 0.3, y), batch_size=8, shuffle=False))


def context(pid: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})


def own_config(lr: float = OWN_LR, epochs: int = 2) -> TrainConfig:
    return TrainConfig(local_epochs=epochs, batch_size=8, optimizer=OptimizerConfig("sgd", lr), device="cpu")


def fedavg_federation(sizes=(12, 28, 20)) -> tuple:
    """FedAvg clients (own learning rate OWN_LR) behind proxies, unequal training sets."""
    proxies = [NumPyProxy(str(700 + 3 * pid), pid, FedAvgClient(context(pid), make_model(), make_data(n, pid), own_config()))
               for pid, n in enumerate(sizes)]
    return client_manager(proxies), proxies


def replayed(start, data: LocalData, lr: float, epochs: int = 2, groups=("all",)) -> list[np.ndarray]:
    model = make_model(9)
    set_arrays(model, start, "all")
    train(model, data.train, optimizer=OptimizerConfig("sgd", lr), device=CPU, epochs=epochs, groups=groups)
    return get_arrays(model, "all")


def fit_round(s: PFLStrategy, server_round: int, cm) -> tuple:
    """One fit round by hand, as Flower's server loop runs it."""
    params = ndarrays_to_parameters(s.global_arrays if s.global_arrays is not None else arrays_of(0))
    instructions = s.configure_fit(server_round, params, cm)
    results = [(proxy, proxy.fit(ins, None, server_round)) for proxy, ins in instructions]
    return instructions, results, s.aggregate_fit(server_round, results, [])


class Recorder:
    """An on_round callback keeping every row."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, str, dict, dict]] = []

    def __call__(self, rnd, phase, metrics, clients) -> None:
        self.rows.append((rnd, phase, dict(metrics), dict(clients)))

    def phase(self, phase: str) -> list[tuple[int, dict]]:
        return [(r, m) for r, p, m, _ in self.rows if p == phase]


# ------------------------------------------------------------------------------------ the arguments
def test_the_base_takes_every_argument_of_flowers_fedavg():
    flower = set(inspect.signature(FlowerFedAvg.__init__).parameters) - {"self"}
    ours = set(inspect.signature(PFLStrategy.__init__).parameters)
    assert flower <= ours, sorted(flower - ours)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_every_strategy_takes_fedavgs_arguments_and_keeps_them(cls):
    """Every subclass passes FedAvg's arguments through to the one copy in the base."""
    initial = [] if cls is Local else pfedfda_wire() if cls is PFedFDA else arrays_of(0)
    kwargs = {
        "on_fit_config_fn": lambda r: {"learning-rate": 0.1},
        "on_evaluate_config_fn": lambda r: {"eval-key": r},
        "fit_metrics_aggregation_fn": lambda pairs: {},
        "evaluate_metrics_aggregation_fn": lambda pairs: {},
        "accept_failures": False,
        "min_evaluate_clients": 2,
        "min_available_clients": 4 if cls in EVERY_CLIENT_EVERY_ROUND else 3,
        "inplace": False,
    }
    if cls not in NO_GLOBAL_MODEL:
        kwargs["evaluate_fn"] = lambda rnd, arrays, config: None
    own = {"t1_rounds": 3} if cls is FedFMTL else {}  # FMTL's phase 1 must end within the 6 rounds
    s = cls(num_clients=4, num_rounds=6, initial_parameters=ndarrays_to_parameters(initial), **kwargs, **own)
    for name, value in kwargs.items():
        assert getattr(s, name) == value, name
    close(s.global_arrays, initial)
    assert s.num_rounds == 6


def test_initial_parameters_are_initial_arrays():
    arrays = arrays_of(3)
    a = FedAvg(num_clients=2, initial_parameters=ndarrays_to_parameters(arrays))
    b = FedAvg(num_clients=2, initial_arrays=arrays)
    close(a.global_arrays, arrays, atol=0)
    for s in (a, b):  # Flower's server asks for them once
        close(parameters_to_ndarrays(s.initialize_parameters(manager(2))), arrays, atol=0)
    with pytest.raises(ConfigError, match="not both"):
        FedAvg(num_clients=2, initial_parameters=ndarrays_to_parameters(arrays), initial_arrays=arrays)
    with pytest.raises(TypeError, match="Parameters"):
        FedAvg(num_clients=2, initial_parameters=arrays)


@pytest.mark.parametrize("cls", [Local, FEDORA], ids=lambda c: c.__name__)
def test_algorithms_without_a_global_model_refuse_evaluate_fn(cls):
    reason = NO_GLOBAL_MODEL[cls]
    with pytest.raises(ConfigError, match=f"cannot take evaluate_fn: {reason}"):
        cls(num_clients=3, evaluate_fn=lambda rnd, arrays, config: (0.0, {}))
    s = cls(num_clients=3)
    with pytest.raises(ConfigError, match=reason):
        s.evaluate_fn = lambda rnd, arrays, config: (0.0, {})  # the attribute is checked too
    assert s.evaluate_fn is None


def test_local_refuses_initial_arrays():
    with pytest.raises(ConfigError, match="sends no model"):
        Local(num_clients=3, initial_parameters=ndarrays_to_parameters(arrays_of(0)))


@pytest.mark.parametrize("cls", [FEDORA, FedGP, SourceOnly], ids=lambda c: c.__name__)
def test_algorithms_that_need_every_client_refuse_starting_without_them(cls):
    with pytest.raises(ConfigError, match="min_available_clients=2 < num_clients=4 is not allowed"):
        cls(num_clients=4, min_available_clients=2)


def test_min_available_clients_above_the_federation_is_refused():
    with pytest.raises(ConfigError, match=r"min_available_clients=6 must be in \[1, num_clients=5\]"):
        FedAvg(num_clients=5, min_available_clients=6)


def test_pfedfda_refuses_a_minimum_under_bernoulli_participation():
    with pytest.raises(ConfigError, match="min_fit_clients=3 does not apply to pFedFDA's Bernoulli"):
        pfedfda_strategy(min_fit_clients=3)
    assert pfedfda_strategy(min_fit_clients=3, sampling="fixed").min_fit_clients == 3


# ------------------------------------------------------------------------------------ attributes
def test_a_hook_set_as_an_attribute_is_used():
    s = FedAvg(num_clients=3, initial_arrays=arrays_of(0))
    s.on_fit_config_fn = lambda r: {"learning-rate": 0.01 * r}
    instructions = s.configure_fit(4, ndarrays_to_parameters(arrays_of(0)), manager(3))
    assert all(ins.config["learning-rate"] == pytest.approx(0.04) for _, ins in instructions)


def test_an_unknown_hook_attribute_is_refused_not_ignored():
    s = FedAvg(num_clients=3)
    with pytest.raises(AttributeError, match="no hook 'on_fit_config'.*did you mean on_fit_config_fn"):
        s.on_fit_config = lambda r: {}
    with pytest.raises(AttributeError, match="no hook 'evaluation_fn'"):
        s.evaluation_fn = lambda *a: None
    with pytest.raises(TypeError, match="on_fit_config_fn must be a callable"):
        s.on_fit_config_fn = {"learning-rate": 0.1}
    s.accept_failures = False  # a plain attribute of FedAvg's stays settable
    assert s.refuses_failures(1)


# ------------------------------------------------------------------------------------ configs
def _user_fns(calls: list):
    def fit_fn(rnd):
        calls.append(("fit", rnd))
        return {"learning-rate": 0.125, "user-tag": f"fit-{rnd}"}

    def eval_fn(rnd):
        calls.append(("evaluate", rnd))
        return {"user-tag": f"eval-{rnd}", "batch-size": 64}

    return {"on_fit_config_fn": fit_fn, "on_evaluate_config_fn": eval_fn}


def _plain(cls, hooks, arrays=None, cm=None, **kw):
    arrays = arrays_of(0) if arrays is None else arrays
    s = cls(num_clients=4 if cm is None else len(cm.all()), initial_arrays=arrays, **hooks, **kw)
    cm, params = cm or manager(4), ndarrays_to_parameters(arrays)
    return [i.config for _, i in s.configure_fit(2, params, cm)], [i.config for _, i in s.configure_evaluate(2, params, cm)]


def _pfedfda(hooks):
    s = pfedfda_strategy(num_rounds=10, fraction_fit=0.5, **hooks)
    cm, params = manager(10), ndarrays_to_parameters(pfedfda_wire())
    return [i.config for _, i in s.configure_fit(2, params, cm)], [i.config for _, i in s.configure_evaluate(2, params, cm)]


def _fedora(hooks):
    s, cm, _, _ = fedora_layer.strategy_and_manager(**hooks)
    params = ndarrays_to_parameters(fedora_layer.LAYOUT)
    return [i.config for _, i in s.configure_fit(2, params, cm)], [i.config for _, i in s.configure_evaluate(2, params, cm)]


def _feddar(hooks):
    s = feddar_layer.strategy(aggregation="wa", **hooks)
    cm, proxies = feddar_layer.federation(with_hessians=False)
    params = ndarrays_to_parameters(feddar_layer.global_arrays())
    rep = [i.config for _, i in s.configure_fit(2, params, cm)]
    heads = [p.configs[-1] for p in proxies]
    assert {c["feddar-phase"] for c in heads} == {"head"} and {c["feddar-phase"] for c in rep} == {"rep"}
    return heads + rep, [i.config for _, i in s.configure_evaluate(2, params, cm)]


FAMILIES = {
    "fedavg": lambda hooks: _plain(FedAvg, hooks),
    "fedrep": lambda hooks: _plain(FedRep, hooks),
    "fmtl": lambda hooks: _plain(FedFMTL, hooks),
    "fedgp": lambda hooks: _plain(FedGP, hooks),
    "fedda": lambda hooks: _plain(FedDA, hooks, evaluate_sources=False),
    "pfedfda": _pfedfda,
    "fedora": _fedora,
    "feddar": _feddar,
    "fedavg-rw": lambda hooks: _plain(ReweightedFedAvg, hooks, feddar_layer.global_arrays(),
                                      feddar_layer.federation(with_hessians=False)[0]),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_configs_reach_every_instruction_once_per_round(family):
    """The user's keys ride with every fit and evaluate instruction of the round, beside the
    algorithm's own; each hook is called once per round with the round number (FedDAR's two
    exchanges in one round included)."""
    calls: list = []
    fit, ev = FAMILIES[family](_user_fns(calls))
    assert fit and ev
    for config in fit:
        assert config["learning-rate"] == 0.125 and config["user-tag"] == "fit-2" and config["server-round"] == 2
    for config in ev:
        assert config["user-tag"] == "eval-2" and config["batch-size"] == 64 and config["server-round"] == 2
    assert sorted(calls) == [("evaluate", 2), ("fit", 2)]


def test_round_numbers_count_the_rounds_before_a_resume():
    calls: list = []
    s = FedAvg(num_clients=3, initial_arrays=arrays_of(0), **_user_fns(calls))
    s.load_state_dict(s.state_dict(), rounds_done=5)
    instructions = s.configure_fit(2, ndarrays_to_parameters(arrays_of(0)), manager(3))
    assert calls == [("fit", 7)] and instructions[0][1].config["user-tag"] == "fit-7"


def test_fit_config_still_works_and_the_round_config_wins_over_it():
    s = FedAvg(num_clients=2, initial_arrays=arrays_of(0), fit_config={"a": 1, "learning-rate": 0.5},
               on_fit_config_fn=lambda r: {"learning-rate": 0.05})
    (_, ins), _ = s.configure_fit(1, ndarrays_to_parameters(arrays_of(0)), manager(2))
    assert ins.config == {"a": 1, "learning-rate": 0.05, "server-round": 1}


@pytest.mark.parametrize(("family", "key"), [("fedavg", "server-round"), ("feddar", "feddar-phase"), ("fedora", "fedora-phase")])
def test_a_round_config_may_not_reuse_the_algorithms_keys(family, key):
    hooks = {"on_fit_config_fn": lambda r: {key: "mine"}}
    with pytest.raises(ConfigError, match=f"on_fit_config_fn set \\['{key}'\\], which .* sets itself"):
        FAMILIES[family](hooks)


@pytest.mark.parametrize(("answer", "match"), [([("lr", 0.1)], "must return a dict"), ({"lr": [0.1]}, "Flower scalars")])
def test_a_round_config_must_be_a_dict_of_flower_scalars(answer, match):
    s = FedAvg(num_clients=2, initial_arrays=arrays_of(0), on_fit_config_fn=lambda r: answer)
    with pytest.raises(TypeError, match=match):
        s.configure_fit(1, ndarrays_to_parameters(arrays_of(0)), manager(2))


# ------------------------------------------------------------------------------------ learning rate
def test_the_round_learning_rate_drives_the_clients_optimizer():
    """Round 1 sends learning-rate 1e-30: no client moves (float32 cannot hold the step); round 2
    sends 0.5: each client's reply is its data replayed at 0.5, not at its own rate."""
    lrs = {1: 1e-30, 2: 0.5}
    cm, proxies = fedavg_federation()
    s = FedAvg(num_clients=3, initial_arrays=arrays_of(0), on_fit_config_fn=lambda r: {"learning-rate": lrs[r]})
    start = arrays_of(0)
    _, results, _ = fit_round(s, 1, cm)
    for _, res in results:
        close(parameters_to_ndarrays(res.parameters), start, atol=0)
    close(s.global_arrays, start, atol=1e-7)
    sent = [a.copy() for a in s.global_arrays]
    _, results, _ = fit_round(s, 2, cm)
    for proxy, res in results:
        got = parameters_to_ndarrays(res.parameters)
        close(got, replayed(sent, proxy.client.data, 0.5))
        assert not np.allclose(got[0], replayed(sent, proxy.client.data, OWN_LR)[0], atol=1e-4)
        assert proxy.client.train_config.optimizer.learning_rate == OWN_LR  # restored after the message


def test_fedrep_client_trains_both_phases_at_the_round_rate():
    data = make_data(20, 1)
    client = FedRepClient(context(0), make_model(), data, own_config(), head_epochs=3)
    received = [a + 0.1 for a in get_arrays(client.model, "body")]
    reference = copy.deepcopy(client.model)
    set_arrays(reference, received, "body")
    for groups, epochs in ((("heads",), 3), (("body",), 2)):
        train(reference, data.train, optimizer=OptimizerConfig("sgd", 0.07), device=CPU, epochs=epochs, groups=groups)
    arrays, _, _ = client.fit(received, {"server-round": 1, "learning-rate": 0.07})
    close(arrays, get_arrays(reference, "body"))


def test_fedgp_client_scales_the_round_rate():
    """The round rate replaces the run's, then the server's lr-scale applies (0.2 x 0.3)."""
    glob = arrays_of(1)
    arrays, _, metrics = fedgp_layer.make_client(0).fit(glob, fedgp_layer.fda_instructions() | {"learning-rate": 0.2})
    expected, _ = fedgp_layer.reference(glob, 0.2 * 0.3, 3, target=False)
    close(arrays, expected)
    assert metrics["lr"] == pytest.approx(0.06)


def test_feddar_head_phase_scales_the_round_rate():
    client = feddar_layer.make_client()
    x, y, d = client.data.train.dataset.tensors
    received = get_arrays(client.model, "all")
    expected = feddar_layer.reference_heads(client.model, x, y, d, lr=0.1 * 0.5, epochs=4)
    arrays, _, _ = client.fit(received, feddar_layer.head_config(**{"learning-rate": 0.1}))
    np.testing.assert_allclose(arrays[0], expected.numpy(), rtol=1e-5, atol=1e-6)


def _fmtl():
    return fmtl_layer.make_client(), (arrays_of(1), fmtl_layer.config(1))


def _pfedfda_client():
    client = pfedfda_layer.make_client(config=pfedfda_layer.fixed(0.5))
    return client, (pfedfda_layer.message(client), {"server-round": 1})


def _fedora_client():
    return fedora_layer.make_client(), (arrays_of(11), fedora_layer.fit_config(fedora_layer.rule_config("paper")))


@pytest.mark.parametrize("build", [_fmtl, _pfedfda_client, _fedora_client], ids=["fmtl", "pfedfda", "fedora"])
def test_a_round_rate_trains_as_the_same_rate_set_on_the_client(build):
    """Client with its own rate 0.02 and no key == client with another rate and the key 0.02;
    both differ from the client's own rate without the key."""
    def run(lr_own: float, extra: dict):
        client, (arrays, config) = build()
        tc = client.train_config
        client.train_config = replace(tc, optimizer=replace(tc.optimizer, learning_rate=lr_own))
        out, _, _ = client.fit([a.copy() for a in arrays], {**config, **extra})
        return out

    by_key = run(0.4, {"learning-rate": 0.02})
    close(by_key, run(0.02, {}), atol=0)
    assert any(not np.allclose(a, b, atol=1e-6) for a, b in zip(by_key, run(0.4, {})))


def test_a_bad_round_rate_names_the_client():
    client = FedAvgClient(context(4), make_model(), make_data(8, 0), own_config())
    with pytest.raises(ConfigError, match="partition 4: the strategy sent learning-rate=0 .* must be a number > 0"):
        client.fit(get_arrays(client.model, "all"), {"server-round": 1, "learning-rate": 0})


def _fedavg_fit(lr_own: float, extra: dict) -> list[np.ndarray]:
    client = FedAvgClient(context(2), make_model(), make_data(8, 0), own_config())
    tc = client.train_config
    client.train_config = replace(tc, optimizer=replace(tc.optimizer, learning_rate=lr_own))
    out, _, _ = client.fit(get_arrays(client.model, "all"), {"server-round": 1, **extra})
    return out


def test_flowers_lr_key_sets_the_round_rate_as_learning_rate_does():
    """Flower's PyTorch examples send {"lr": ...}: it trains exactly as learning-rate (and as the
    client's own rate), and differently from the client's own rate without it."""
    by_lr = _fedavg_fit(0.4, {"lr": 0.02})
    close(by_lr, _fedavg_fit(0.4, {"learning-rate": 0.02}), atol=0)
    close(by_lr, _fedavg_fit(0.02, {}), atol=0)
    close(by_lr, _fedavg_fit(0.4, {"lr": 0.02, "learning-rate": 0.02}), atol=0)  # both, equal: fine
    assert any(not np.allclose(a, b, atol=1e-6) for a, b in zip(by_lr, _fedavg_fit(0.4, {})))


@pytest.mark.parametrize("extra, match", [
    ({"lr": 0.1, "learning-rate": 0.2}, r"partition 2: .*learning rate twice with different values \(learning-rate=0.2, lr=0.1\)"),
    ({"lr": -1.0}, r"partition 2: the strategy sent lr=-1.0 .* must be a number > 0"),
    ({"lr": "0.1"}, r"partition 2: the strategy sent lr='0.1'"),
])
def test_a_conflicting_or_bad_lr_is_refused_naming_the_keys(extra, match):
    with pytest.raises(ConfigError, match=match):
        _fedavg_fit(0.4, extra)


def test_user_config_keys_the_clients_do_not_read_are_reported_once():
    """Flower's examples send local_epochs / batch_size in the train config; the clients read only
    the learning rate, so the others are named once at INFO (a key named for fit is not named
    again for evaluate)."""
    s = FedAvg(num_clients=2, initial_arrays=arrays_of(0), fit_config={"local_epochs": 3},
               on_fit_config_fn=lambda r: {"lr": 0.1, "batch_size": 8},
               on_evaluate_config_fn=lambda r: {"batch_size": 8, "tag": "x"})
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    FLOWER_LOGGER.addHandler(handler)
    level = FLOWER_LOGGER.level
    FLOWER_LOGGER.setLevel(logging.INFO)  # an in-process compare.main() earlier in the session may have raised it
    try:
        for rnd in (1, 2):
            s.fit_config(rnd)
            s.evaluate_config(rnd)
    finally:
        FLOWER_LOGGER.removeHandler(handler)
        FLOWER_LOGGER.setLevel(level)
    caplog = types.SimpleNamespace(records=records)
    reports = [r.getMessage() for r in caplog.records if "read only" in r.getMessage()]
    assert reports == [
        "FedAvg: fit_config / on_fit_config_fn sends ['batch_size', 'local_epochs'] to the clients; flwr_pfl's "
        "clients read only ['learning-rate', 'lr'] from it (set the rest through the clients' options, e.g. the run "
        "config's local-epochs and batch-size)",
        "FedAvg: on_evaluate_config_fn sends ['tag'] to the clients; flwr_pfl's clients read only "
        "['learning-rate', 'lr'] from it (set the rest through the clients' options, e.g. the run config's "
        "local-epochs and batch-size)",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records if "read only" in r.getMessage())


# ------------------------------------------------------------------------------------ evaluate_fn
def test_evaluate_fn_runs_every_round_on_the_current_global_arrays_in_flowers_loop():
    """Flower's own server loop: evaluate_fn(round, arrays, {}) before round 1 and after each
    round, on the arrays the round aggregated; its metrics go to on_round and Flower's history."""
    seen: list = []
    recorder = Recorder()
    globals_after: dict = {}

    def evaluate_fn(rnd, arrays, config):
        seen.append((rnd, [a.copy() for a in arrays], config))
        arrays[0][...] = 1e6  # a careless user: the strategy's arrays must not change
        return float(rnd) + 0.5, {"server_acc": 0.1 * rnd}

    def on_round(rnd, phase, metrics, clients):
        recorder(rnd, phase, metrics, clients)
        if phase == "fit":
            globals_after[rnd] = [a.copy() for a in s.global_arrays]

    cm, _ = fedavg_federation()
    s = FedAvg(num_clients=3, initial_arrays=arrays_of(0), evaluate_fn=evaluate_fn, on_round=on_round)
    history, _ = Server(client_manager=cm, strategy=s).fit(num_rounds=2, timeout=None)
    assert [r for r, _, _ in seen] == [0, 1, 2] and all(c == {} for _, _, c in seen)
    close(s.global_arrays, globals_after[2], atol=0)  # evaluate_fn got a copy (what gets checkpointed)
    close(seen[0][1], arrays_of(0), atol=0)
    for rnd in (1, 2):
        close(seen[rnd][1], globals_after[rnd], atol=0)
    assert recorder.phase(SERVER_EVALUATE) == [(r, {"loss": r + 0.5, "server_acc": 0.1 * r}) for r in (0, 1, 2)]
    assert history.losses_centralized == [(0, 0.5), (1, 1.5), (2, 2.5)]
    assert history.metrics_centralized["server_acc"] == [(0, 0.0), (1, 0.1), (2, 0.2)]


@pytest.mark.parametrize("family", ["pfedfda", "feddar", "fmtl", "source-only"])
def test_evaluate_fn_sees_each_algorithms_global_arrays(family):
    """pFedFDA's round 0 is the client's backbone with the server's initial statistics (what
    round 1 sends); after an aggregation every family evaluates its new global arrays."""
    seen = []
    fn = lambda rnd, arrays, config: seen.append(arrays) or (0.0, {})  # noqa: E731
    if family == "pfedfda":
        s = pfedfda_strategy(evaluate_fn=fn)
        s.evaluate(0, ndarrays_to_parameters(pfedfda_wire()))
        first = s.configure_fit(1, ndarrays_to_parameters(pfedfda_wire()), manager(10))
        close(seen[0], parameters_to_ndarrays(first[0][1].parameters), atol=0)
        assert not np.allclose(seen[0][-2], 0.0)  # the server's mu_g^0, not the client's zeros
        return
    if family == "feddar":
        initial = feddar_layer.global_arrays()
        s = feddar_layer.strategy(aggregation="wa", evaluate_fn=fn)
        cm, proxies = feddar_layer.federation(with_hessians=False)
        s.configure_fit(1, ndarrays_to_parameters(initial), cm)
        e = feddar_layer.encoder_count()
        encoders = [[np.full_like(a, float(i + 1)) for a in initial[:e]] for i in range(3)]
        results = [(p, fit_res(enc, int(n), p.pid)) for p, enc, n in zip(proxies, encoders, feddar_layer.COUNTS.sum(1))]
    elif family == "fmtl":
        initial = arrays_of(0)
        s = FedFMTL(num_clients=2, initial_arrays=initial, evaluate_fn=fn)
        s.configure_fit(1, ndarrays_to_parameters(initial), manager(2))
        results = [(FakeProxy(str(i), i), fit_res(arrays_of(10 + i) + [np.array([4 + i, 1, 0])], 5 + i, i)) for i in range(2)]
    else:  # Source Only: the sources' FedAvg; the target replies without training
        initial = arrays_of(0)
        s = SourceOnly(num_clients=2, initial_arrays=initial, evaluate_fn=fn)
        s.configure_fit(1, ndarrays_to_parameters(initial), manager(2))
        results = [(FakeProxy("0", 0), fit_res(arrays_of(10), 5, 0, {"is_target": 0, "num_steps": 3, "lr": 0.1})),
                   (FakeProxy("1", 1), fit_res([], 3, 1, {"is_target": 1, "skipped": 1}))]
    params, _ = s.aggregate_fit(1, results, [])
    assert params is not None
    s.evaluate(1, params)
    close(seen[-1], s.global_arrays, atol=0)
    assert any(not np.allclose(a, b) for a, b in zip(seen[-1], initial))


def test_evaluate_fn_after_a_resume_counts_rounds_and_skips_round_zero():
    seen = []
    s = FedAvg(num_clients=2, initial_arrays=arrays_of(0), evaluate_fn=lambda r, a, c: seen.append(r) or (1.0, {}))
    s.load_state_dict({"global_arrays": arrays_of(1), "round_offset": 3}, rounds_done=3)
    assert s.evaluate(0, ndarrays_to_parameters(arrays_of(1))) is None
    assert s.evaluate(1, ndarrays_to_parameters(arrays_of(1))) == (1.0, {})
    assert seen == [4]


def test_evaluate_fn_must_answer_loss_and_metrics():
    s = FedAvg(num_clients=2, initial_arrays=arrays_of(0), evaluate_fn=lambda r, a, c: 0.3)
    with pytest.raises(TypeError, match=r"\(loss, metrics dict\)"):
        s.evaluate(1, ndarrays_to_parameters(arrays_of(0)))


# ------------------------------------------------------------------------------------ metric aggregation
def _weighted_tag(pairs):
    return {"user_fit": sum(n * float(m["tag"]) for n, m in pairs), "user_pids": ",".join(str(m["partition_id"]) for _, m in pairs)}


@pytest.mark.parametrize("family", ["fedavg", "pfedfda", "fmtl"])
def test_fit_metrics_aggregation_fn_sees_the_accepted_replies(family):
    """Flower's [(num_examples, metrics)] of the accepted replies, in partition order; a rejected
    reply (NaN) is not among them; the answer is in the returned and the recorded metrics."""
    recorder = Recorder()
    kw = {"fit_metrics_aggregation_fn": _weighted_tag, "on_round": recorder}
    if family == "pfedfda":
        s = pfedfda_strategy(**kw)
        s.configure_fit(1, ndarrays_to_parameters(pfedfda_wire()), manager(10))
        make = lambda v: pfedfda_wire(v)  # noqa: E731
    else:
        s = (FedAvg if family == "fedavg" else FedFMTL)(num_clients=3, initial_arrays=arrays_of(0), **kw)
        s.configure_fit(1, ndarrays_to_parameters(arrays_of(0)), manager(3))
        make = lambda v: [a + v for a in arrays_of(0)]  # noqa: E731
    extra = (lambda n: [np.array([n, 0, 0], dtype=np.int64)]) if family == "fmtl" else (lambda n: [])
    bad = make(0.0)
    bad[0] = np.full_like(bad[0], np.nan)
    results = [
        (FakeProxy("c2", 2), fit_res(make(0.2) + extra(30), 30, 2, {"tag": 2.0})),
        (FakeProxy("c0", 0), fit_res(make(0.1) + extra(10), 10, 0, {"tag": 0.5})),
        (FakeProxy("c1", 1), fit_res(bad + extra(20), 20, 1, {"tag": 100.0})),
    ]
    _, metrics = s.aggregate_fit(1, results, [])
    assert metrics["user_fit"] == pytest.approx(10 * 0.5 + 30 * 2.0) and metrics["user_pids"] == "0,2"
    assert recorder.phase("fit")[-1][1]["user_fit"] == pytest.approx(65.0)


def test_evaluate_metrics_aggregation_fn_sees_the_valid_evaluations():
    from flwr.common import Code, EvaluateRes, Status

    recorder = Recorder()
    s = FedAvg(num_clients=3, on_round=recorder,
               evaluate_metrics_aggregation_fn=lambda pairs: {"acc_min_n": min(n for n, _ in pairs),
                                                              "acc_sum": sum(n * m["accuracy"] for n, m in pairs)})
    res = lambda loss, n, acc, pid: EvaluateRes(Status(Code.OK, ""), loss, n, {"accuracy": acc, "partition_id": pid})  # noqa: E731
    results = [(FakeProxy("a", 0), res(0.5, 4, 0.25, 0)), (FakeProxy("b", 1), res(0.1, 16, 0.75, 1)),
               (FakeProxy("c", 2), res(float("nan"), 8, 1.0, 2))]
    loss, metrics = s.aggregate_evaluate(1, results, [])
    assert loss == pytest.approx((0.5 * 4 + 0.1 * 16) / 20)  # the suite's own loss is kept
    assert metrics["acc_min_n"] == 4 and metrics["acc_sum"] == pytest.approx(4 * 0.25 + 16 * 0.75)
    assert recorder.phase("evaluate")[-1][1]["acc_sum"] == pytest.approx(13.0)


# ------------------------------------------------------------------------------------ accept_failures
@pytest.mark.parametrize("family", ["fedavg", "pfedfda", "fmtl"])
@pytest.mark.parametrize("accept", [True, False])
def test_accept_failures_false_leaves_a_round_with_a_failure_unaggregated(family, accept):
    recorder = Recorder()
    kw = {"accept_failures": accept, "on_round": recorder}
    if family == "pfedfda":
        s = pfedfda_strategy(**kw)
        s.configure_fit(1, ndarrays_to_parameters(pfedfda_wire()), manager(10))
        reply = fit_res(pfedfda_wire(0.5), 12, 0)
    else:
        s = (FedAvg if family == "fedavg" else FedFMTL)(num_clients=3, initial_arrays=arrays_of(0), **kw)
        s.configure_fit(1, ndarrays_to_parameters(arrays_of(0)), manager(3))
        counts = [np.array([12, 0, 0], dtype=np.int64)] if family == "fmtl" else []
        reply = fit_res(arrays_of(5) + counts, 12, 0)
    before = [a.copy() for a in s.global_arrays]
    params, metrics = s.aggregate_fit(1, [(FakeProxy("a", 0), reply)], [RuntimeError("client lost")])
    assert metrics["num_failures"] == 1.0 and recorder.phase("fit")[-1][1]["num_failures"] == 1.0
    if accept:
        assert params is not None and any(not np.allclose(a, b) for a, b in zip(s.global_arrays, before))
    else:
        assert params is None
        close(s.global_arrays, before, atol=0)


def test_accept_failures_false_counts_a_rejected_reply_as_a_failure():
    s = FedAvg(num_clients=2, initial_arrays=arrays_of(0), accept_failures=False)
    wrong = fit_res(arrays_of(5)[:-1], 10, 1)  # an array short
    params, metrics = s.aggregate_fit(1, [(FakeProxy("a", 0), fit_res(arrays_of(5), 10, 0)), (FakeProxy("b", 1), wrong)], [])
    assert params is None and metrics["num_rejected"] == 1.0
    close(s.global_arrays, arrays_of(0), atol=0)


def test_accept_failures_false_applies_to_evaluation():
    from flwr.common import Code, EvaluateRes, Status

    s = FedAvg(num_clients=2, accept_failures=False)
    ok = (FakeProxy("a", 0), EvaluateRes(Status(Code.OK, ""), 0.4, 10, {"accuracy": 0.5, "partition_id": 0}))
    assert s.aggregate_evaluate(1, [ok], [RuntimeError("gone")]) == (None, {"num_failures": 1.0})
    assert s.aggregate_evaluate(1, [ok], [])[0] == pytest.approx(0.4)


class FailingHeadProxy(feddar_layer.HeadProxy):
    def fit(self, ins, timeout, group_id):
        if ins.config.get("feddar-phase") == "head":
            raise RuntimeError("head phase failed")
        return super().fit(ins, timeout, group_id)


def test_feddar_with_accept_failures_false_skips_the_whole_round():
    """A head-phase failure: no head aggregation and no representation phase. A
    representation-phase failure: the heads the head phase aggregated are undone."""
    s = feddar_layer.strategy(aggregation="wa", accept_failures=False)
    proxies = [feddar_layer.HeadProxy(str(100 + i), i, False) for i in range(2)] + [FailingHeadProxy("102", 2, False)]
    params = ndarrays_to_parameters(feddar_layer.global_arrays())
    assert s.configure_fit(1, params, client_manager(proxies)) == []
    close(s.global_arrays, feddar_layer.global_arrays(), atol=0)

    s = feddar_layer.strategy(aggregation="wa", accept_failures=False)
    cm, proxies = feddar_layer.federation(with_hessians=False)
    instructions = s.configure_fit(1, params, cm)
    assert len(instructions) == 3
    assert any(not np.allclose(a, b) for a, b in zip(s.global_arrays, feddar_layer.global_arrays()))  # heads moved
    e = feddar_layer.encoder_count()
    ok = [(p, fit_res(feddar_layer.global_arrays()[:e], int(feddar_layer.COUNTS[p.pid].sum()), p.pid)) for p in proxies[:2]]
    assert s.aggregate_fit(1, ok, [RuntimeError("rep phase failed")]) == (None, {"num_failures": 1.0, "num_rejected": 0.0})
    close(s.global_arrays, feddar_layer.global_arrays(), atol=0)


class BrokenSubspaceProxy(FakeProxy):
    def fit(self, ins, timeout, group_id):
        raise RuntimeError("no subspace")


def test_fedora_with_accept_failures_false_retries_the_setup():
    s, cm, proxies, _ = fedora_layer.strategy_and_manager(accept_failures=False)
    params = ndarrays_to_parameters(fedora_layer.LAYOUT)
    broken = client_manager([BrokenSubspaceProxy("c0", 0)] + [proxies[k] for k in range(1, fedora_layer.K)])
    assert s.configure_fit(1, params, broken) == [] and s.graph is None
    assert len(s.configure_fit(2, params, cm)) == fedora_layer.K and s.graph is not None
    tolerant, _, _, _ = fedora_layer.strategy_and_manager()
    assert len(tolerant.configure_fit(1, params, broken)) == fedora_layer.K  # isolated, as before


def test_fedda_target_placement_skips_the_target_round_after_an_unaggregated_sources_round():
    from flwr_pfl.core.fedgp import FDAConfig, Placement, Rule

    s = FedDA(num_clients=3, initial_arrays=arrays_of(0), accept_failures=False,
              config=FDAConfig(rule=Rule.FEDDA, warmup_rounds=0, placement=Placement.TARGET))
    s.target_cid = "2"
    cm = manager(3, first_cid=0, cid_step=1)
    params = ndarrays_to_parameters(arrays_of(0))
    sources = s.configure_fit(1, params, cm)
    assert sorted(p.cid for p, _ in sources) == ["0", "1"]
    reply = fit_res(arrays_of(4), 10, 0, {"is_target": 0, "num_steps": 2, "lr": 0.1})
    assert s.aggregate_fit(1, [(sources[0][0], reply)], [RuntimeError("source lost")])[0] is None
    assert s.configure_fit(2, params, cm) == []  # the target's half of this FDA round is skipped
    assert sorted(p.cid for p, _ in s.configure_fit(3, params, cm)) == ["0", "1"]  # the next FDA round


def test_fedda_target_placement_accepting_failures_goes_on_to_the_target():
    from flwr_pfl.core.fedgp import FDAConfig, Placement, Rule

    s = FedDA(num_clients=3, initial_arrays=arrays_of(0),
              config=FDAConfig(rule=Rule.FEDDA, warmup_rounds=0, placement=Placement.TARGET))
    s.target_cid = "2"
    cm = manager(3, first_cid=0, cid_step=1)
    params = ndarrays_to_parameters(arrays_of(0))
    sources = s.configure_fit(1, params, cm)
    reply = fit_res(arrays_of(4), 10, 0, {"is_target": 0, "num_steps": 2, "lr": 0.1})
    s.aggregate_fit(1, [(sources[0][0], reply)], [RuntimeError("source lost")])
    assert [p.cid for p, _ in s.configure_fit(2, params, cm)] == ["2"]


# ------------------------------------------------------------------------------------ min_available_clients
class CountingManager:
    """A client manager that records what the strategy waits for."""

    def __init__(self, inner) -> None:
        self.inner, self.waited = inner, []

    def wait_for(self, num_clients, timeout):
        self.waited.append(num_clients)
        return self.inner.wait_for(num_clients, timeout)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("cls", [FedAvg, FedRep, PFedFDA, FedFMTL], ids=lambda c: c.__name__)
def test_min_available_clients_is_what_the_strategy_waits_for(cls):
    """3 of 5 clients connected: min_available_clients=3 goes ahead with those three; the default
    (the whole federation) gives up after wait_timeout with the numbers."""
    initial = pfedfda_wire() if cls is PFedFDA else arrays_of(0)
    kw = {"num_rounds": 10} if cls is PFedFDA else {}
    cm = CountingManager(manager(3))
    s = cls(num_clients=5, min_available_clients=3, initial_arrays=initial, wait_timeout=0, fraction_fit=1.0, **kw)
    instructions = s.configure_fit(1, ndarrays_to_parameters(initial), cm)
    assert cm.waited and set(cm.waited) == {3} and len(instructions) == 3
    strict = cls(num_clients=5, initial_arrays=initial, wait_timeout=0, fraction_fit=1.0, **kw)
    with pytest.raises(RuntimeError, match="only 3 of num-clients=5 clients connected"):
        strict.configure_fit(1, ndarrays_to_parameters(initial), manager(3))


def test_with_fewer_clients_connected_a_round_samples_its_fraction_of_those_connected():
    """6 of 10 clients connected, min_available_clients=4: fraction_fit=0.5 samples 3 of the 6
    connected (not half of the federation), distinct and all connected; min_fit_clients raises the
    count; more min_fit_clients than connected skips the round's training (none sampled), as
    Flower's FedAvg does; fraction 1 takes all 6."""
    connected = {str(5000 + 7 * pid) for pid in range(6)}

    def picked(**kw) -> list[str]:
        s = FedAvg(num_clients=10, min_available_clients=4, initial_arrays=arrays_of(0), wait_timeout=0, **kw)
        return [p.cid for p, _ in s.configure_fit(1, ndarrays_to_parameters(arrays_of(0)), manager(6))]

    for kw, count in (({"fraction_fit": 0.5}, 3), ({"fraction_fit": 0.5, "min_fit_clients": 5}, 5),
                      ({"fraction_fit": 0.5, "min_fit_clients": 8}, 0), ({"fraction_fit": 1.0}, 6)):
        cids = picked(**kw)
        assert len(cids) == len(set(cids)) == count and set(cids) <= connected, kw
    s = FedAvg(num_clients=10, min_available_clients=4, fraction_evaluate=0.5, min_evaluate_clients=1, wait_timeout=0)
    assert len(s.configure_evaluate(1, ndarrays_to_parameters(arrays_of(0)), manager(6))) == 3


def test_only_evaluations_with_examples_and_a_finite_loss_count():
    """An evaluation with no examples, an infinite or a NaN loss is rejected (counted in
    num_failures with the failed ones); the round's loss is the example-weighted mean of the rest.
    An evaluation teaches the strategy its node's partition id, unless that id is outside the
    federation."""
    from flwr.common import Code, EvaluateRes, Status

    recorder = Recorder()
    s = FedAvg(num_clients=4, on_round=recorder)
    res = lambda loss, n, pid: EvaluateRes(Status(Code.OK, ""), loss, n, {"accuracy": 0.5, "partition_id": pid})  # noqa: E731
    results = [(FakeProxy("a", 0), res(0.5, 4, 0)), (FakeProxy("b", 1), res(0.2, 12, 1)), (FakeProxy("c", 2), res(0.0, 0, 2)),
               (FakeProxy("d", 3), res(float("inf"), 8, 3)), (FakeProxy("e", 4), res(float("nan"), 8, 4))]
    loss, metrics = s.aggregate_evaluate(1, results, [RuntimeError("gone")])
    assert loss == pytest.approx((0.5 * 4 + 0.2 * 12) / 16, rel=1e-12)
    assert metrics["num_failures"] == 4.0 and metrics["num_clients"] == 2.0
    row = recorder.phase("evaluate")[-1][1]
    assert (row["participants"], row["participant_ids"]) == (2.0, "0 1")
    assert s.partition_of == {"a": 0, "b": 1, "c": 2, "d": 3}  # "e" says partition 4 of a federation of 4


def test_the_last_round_config_goes_to_the_runs_last_round_only():
    """``last_round_config`` reaches the evaluate instructions of round num_rounds and of no other
    round; after a resume the rounds done count; without num_rounds no round is the last."""
    params = ndarrays_to_parameters(arrays_of(0))

    def marked(s, rounds) -> list[int]:
        s.last_round_config = {"export-model": "final"}
        out = []
        for r in rounds:
            configs = [ins.config for _, ins in s.configure_evaluate(r, params, manager(2))]
            assert configs and all(c["server-round"] == s.round_offset + r for c in configs)
            if any("export-model" in c for c in configs):
                assert all(c["export-model"] == "final" for c in configs)
                out.append(r)
        return out

    assert marked(FedAvg(num_clients=2, num_rounds=3), range(1, 5)) == [3, 4]  # a round past the last is last too
    resumed = FedAvg(num_clients=2, num_rounds=3)
    resumed.round_offset = 1
    assert marked(resumed, (1, 2)) == [2]
    assert marked(FedAvg(num_clients=2), range(1, 5)) == []
    assert not FedAvg(num_clients=2, num_rounds=3).is_last_round(2) and FedAvg(num_clients=2, num_rounds=3).is_last_round(3)


# ------------------------------------------------------------------------------------ num_rounds and seed
def test_pfedfda_refuses_to_guess_the_last_round():
    with pytest.raises(ConfigError, match=r"full_last_round=True .* needs the run's total number of rounds.*num_rounds="):
        PFedFDA(num_clients=4)
    with pytest.raises(ConfigError, match="eval_every=0 .* needs the run's total number of rounds"):
        PFedFDA(num_clients=4, full_last_round=False, eval_every=0)
    assert PFedFDA(num_clients=4, full_last_round=False).num_rounds == 0  # nothing depends on it
    s = pfedfda_strategy(num_rounds=3)
    s.configure_fit(1, ndarrays_to_parameters(pfedfda_wire()), manager(10))
    assert len(s.configure_fit(3, ndarrays_to_parameters(pfedfda_wire()), manager(10))) == 10  # the full last round


def test_fedora_refuses_sparse_evaluation_without_num_rounds():
    with pytest.raises(ConfigError, match="eval_every=10 .* needs the run's total number of rounds"):
        FEDORA(num_clients=3, eval_every=10)
    assert FEDORA(num_clients=3, eval_every=10, num_rounds=25).num_rounds == 25


def test_the_app_gives_every_strategy_the_runs_rounds():
    from flwr_pfl.app.config import parse_experiment
    from flwr_pfl.app.server_app import build_strategy

    strategy = build_strategy(parse_experiment({"algorithm": "pfedfda", "num-server-rounds": 7, "num-clients": 10}))
    assert isinstance(strategy, PFedFDA) and strategy.num_rounds == 7


def test_an_unseeded_strategy_draws_a_seed_and_says_which():
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    FLOWER_LOGGER.addHandler(handler)
    try:
        a = FedAvg(num_clients=10, fraction_fit=0.3, seed=None)
        b = FedAvg(num_clients=10, fraction_fit=0.3, seed=None)
    finally:
        FLOWER_LOGGER.removeHandler(handler)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING and "unseeded" in r.getMessage()]
    assert len(warnings) == 2 and f"pass seed={a.seed} to repeat it" in warnings[0]
    assert isinstance(a.seed, int) and a.seed != b.seed
    again = FedAvg(num_clients=10, fraction_fit=0.3, seed=a.seed)  # the logged seed repeats the run
    for rnd in (1, 2, 3):
        picked = [[p.cid for p, _ in s.configure_fit(rnd, ndarrays_to_parameters(arrays_of(0)), manager(10))] for s in (a, again)]
        assert picked[0] == picked[1]
    with pytest.raises(TypeError, match="seed must be an int"):
        FedAvg(num_clients=3, seed=True)


# ------------------------------------------------------------------------------------ eval_every
@pytest.mark.parametrize("cls", [FedAvg, Finetune, FedRep, Local, FEDORA])
def test_eval_every_evaluates_on_its_rounds_and_after_the_last(cls: type) -> None:
    """eval_every = 3 over 7 rounds: evaluations in rounds 3, 6 and 7 only, each to every client;
    after a resume at round 4 the schedule counts the run's rounds, not the process's."""
    params = ndarrays_to_parameters([np.zeros(2, np.float32)])
    s = cls(num_clients=4, num_rounds=7, eval_every=3)
    due = [r for r in range(1, 8) if s.configure_evaluate(r, params, manager(4))]
    assert due == [3, 6, 7]
    assert len(s.configure_evaluate(3, params, manager(4))) == 4
    resumed = cls(num_clients=4, num_rounds=7, eval_every=3)
    resumed.round_offset = 4
    assert [r for r in range(1, 4) if resumed.configure_evaluate(r, params, manager(4))] == [2, 3]  # run rounds 6, 7
    only_last = cls(num_clients=4, num_rounds=7, eval_every=0)
    assert [r for r in range(1, 8) if only_last.configure_evaluate(r, params, manager(4))] == [7]
    every = cls(num_clients=4, eval_every=1)  # the default needs no num_rounds
    assert all(every.configure_evaluate(r, params, manager(4)) for r in range(1, 8))


@pytest.mark.parametrize("bad", [-1, 2.0, True, "3"])
def test_eval_every_is_checked(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"eval_every must be an int >= 0 .*got " + re.escape(repr(bad))):
        FedAvg(num_clients=2, num_rounds=5, eval_every=bad)
    with pytest.raises(ConfigError, match="eval_every=4 .* needs the run's total number of rounds"):
        FedAvg(num_clients=2, eval_every=4)
