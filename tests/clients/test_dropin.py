"""Every personalized client takes a user's own model (quickstart's Net, its head named) and the
user's own data (tuple or dict batches), in a real in-process federation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.client import ClientApp
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from torch.utils.data import DataLoader

from fakes import DictImages, QuickNet, image_tensors, split_loaders
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.clients import LocalData, TrainConfig
from flwr_pfl.core.pfedfda import split_wire
from flwr_pfl.errors import ConfigError
from flwr_pfl.models import HeadSplit, split_model
from flwr_pfl.training import BatchKeys, OptimizerConfig, get_arrays

NUM_CLIENTS = 3
#: every personalized algorithm, the FedGP family's two and FedProx (alone and fine-tuned), with
#: options that keep runs short
OPTIONS = {
    "fedrep": {"head_epochs": 2},
    "fedper": {},
    "finetune": {"epochs": 1},
    "pfedfda": {},
    "fedora": {},
    "fmtl": {"t1_rounds": 1},
    "fedgp": {"warmup_rounds": 1},
    "fedda": {"warmup_rounds": 1},
    "feddar": {"head_epochs": 1},
    "ifca": {"num_clusters": 2, "share_body": True},
    "fedamp": {"alpha_k": 0.1},
    "fedfomo": {"num_models": 1, "epsilon": 0.5},
    "ditto": {},
    "apfl": {},
    "pfedme": {"k": 2},
    "per-fedavg": {},
    "fedbn": {},
    "fedrod": {},
    "fedpac": {},
    "knn-per": {},
    "fedbabu": {},
    "lg-fedavg": {},
    "fedprox": {},
    "fedprox-ft": {},
    "pfedhn": {},
}
BODY = ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def _sizes(pid: int) -> tuple[int, int]:
    """Unequal clients: (train, test) samples of partition ``pid``."""
    return 24 + 9 * pid, 12


def tuple_data(pid: int) -> LocalData:
    n, m = _sizes(pid)
    x, y, d = image_tensors(n + 2 * m, seed=100 + pid)
    return split_loaders(x, y, d, n, m)


def dict_data(pid: int, keys: tuple[str, str, str] = ("img", "label", "domain")) -> LocalData:
    """The same samples as :func:`tuple_data`, as dict batches under ``keys``."""
    source = tuple_data(pid)
    batch_keys = BatchKeys() if keys == ("img", "label", "domain") else BatchKeys(*keys)

    def as_dicts(loader: DataLoader, shuffle: bool) -> DataLoader:
        x, y, d = loader.dataset.tensors
        return DataLoader(DictImages(x, y, d, *keys), batch_size=loader.batch_size, shuffle=shuffle)

    return LocalData(train=as_dicts(source.train, True), val=as_dicts(source.val, False),
                     test=as_dicts(source.test, False), num_domains=2, batch_keys=batch_keys)


def _train_config() -> TrainConfig:
    return TrainConfig(batch_size=8, device="cpu", optimizer=OptimizerConfig(learning_rate=0.05), seed=1)


def run(name: str, data=tuple_data, rounds: int = 2, head="fc3", wrap=lambda net: net):
    """``rounds`` rounds of ``name`` on NUM_CLIENTS in-process clients, each built from a fresh
    QuickNet (handed over as ``wrap(net)``) with ``head``. Returns (server rows, grid, built
    clients as (net, initial state, client)); a client that raised fails the test with its error."""
    spec = ALGORITHMS[name]
    options = dataclasses.replace(spec.options(), **OPTIONS.get(name, {}))
    rows, built, errors = [], [], []

    def client_fn(context: Context):
        try:
            torch.manual_seed(0)  # the same initial model on every client
            net = QuickNet()
            initial = {k: v.clone() for k, v in net.state_dict().items()}
            pid = int(context.node_config["partition-id"])
            client = spec.client(context, wrap(net), data(pid), _train_config(), head=head, **spec.client_kwargs(options))
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)
            raise
        built.append((net, initial, client))
        return client.to_client()

    def server_fn(context: Context):
        strategy = spec.strategy(num_clients=NUM_CLIENTS, seed=0, on_round=lambda *row: rows.append(row),
                                 num_rounds=rounds, **spec.strategy_kwargs(options))
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))

    grid = run_inprocess(ServerApp(server_fn=server_fn), ClientApp(client_fn=client_fn), NUM_CLIENTS, {})
    assert not errors, errors
    return rows, grid, built


def _failures(rows) -> list:
    return [(r, phase, m.get("num_failures"), m.get("num_rejected")) for r, phase, m, _ in rows
            if m.get("num_failures", 0) or m.get("num_rejected", 0)]


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_a_plain_module_with_a_named_head_trains_in_process(name):
    rows, _, built = run(name)
    assert not _failures(rows), _failures(rows)
    assert {phase for _, phase, _, _ in rows} >= {"fit", "evaluate"}
    assert max(r for r, _, _, _ in rows) == 2
    evaluated = [m for _, phase, m, _ in rows if phase == "evaluate"]
    assert all(np.isfinite(m["loss_wmean"]) for m in evaluated)
    for net, _, client in built:
        assert isinstance(client.model, HeadSplit) and client.model.module is net
        assert client.model.heads[0] is net.fc3  # the user's own head module, not a new one
    assert _trained(built)


def _trained(built) -> bool:
    """Whether some client's user model (the net the user handed over) left its message with
    weights other than its initial ones: training reached the user's own tensors."""
    return any(any(not torch.equal(net.state_dict()[k], initial[k]) for k in initial if initial[k].is_floating_point())
               for net, initial, _ in built)


@pytest.mark.parametrize("name, head, wrap", [
    ("fedavg", None, None), ("fedavg-rw", None, None), ("separate-fedavg", None, None),
    ("fedavg-mh", None, lambda net: split_model(net, "fc3", num_heads=2)),
])
def test_baselines_train_a_plain_module_in_process(name, head, wrap):
    """FedAvg and FedDAR's baselines move whole models: no head needed (FedAvg + multi-head
    takes a model whose head was copied per domain with split_model)."""
    rows, _, built = run(name, head=head, wrap=wrap or (lambda net: net))
    assert not _failures(rows), _failures(rows)
    assert {phase for _, phase, _, _ in rows} >= {"fit", "evaluate"}
    for net, _, client in built:
        assert client.model.module is net
    assert _trained(built) or name == "separate-fedavg"  # that one trains a copy of the model per domain


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_the_client_keeps_the_users_head_module_and_initial_weights(name):
    torch.manual_seed(3)
    net = QuickNet()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    fc3 = net.fc3
    spec = ALGORITHMS[name]
    options = dataclasses.replace(spec.options(), **OPTIONS[name])
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 1, "num-partitions": NUM_CLIENTS},
                      state=RecordDict(), run_config={})
    client = spec.client(context, net, tuple_data(1), _train_config(), head="fc3", **spec.client_kwargs(options))
    assert client.model.module is net and net.fc3 is fc3 and client.model.heads[0] is fc3
    after = client.model.user_state_dict()
    assert list(after) == list(before)
    for key in before:
        assert torch.equal(after[key], before[key]), key
    for copy in list(client.model.heads)[1:]:  # FedDAR's further heads: copies of the user's head
        assert copy is not fc3
        assert torch.equal(copy.weight, fc3.weight) and torch.equal(copy.bias, fc3.bias)
    assert client.model.num_heads == (2 if name == "feddar" else 1)


def _fit(name: str, head, pid: int = 1):
    """One direct fit of ``name``'s client on QuickNet (seed 5) from its own initial arrays."""
    torch.manual_seed(5)
    net = QuickNet()
    spec = ALGORITHMS[name]
    options = dataclasses.replace(spec.options(), **OPTIONS[name])
    context = Context(run_id=1, node_id=1, node_config={"partition-id": pid, "num-partitions": NUM_CLIENTS},
                      state=RecordDict(), run_config={})
    client = spec.client(context, net, tuple_data(pid), _train_config(), head=head, **spec.client_kwargs(options))
    sent = client.get_parameters({})
    arrays, n, _ = client.fit(sent, {"server-round": 1})
    return net, sent, arrays, n, context


@pytest.mark.parametrize("name", ["fedrep", "fedper"])
@pytest.mark.parametrize("head, personal", [("fc3", ["fc3"]), (["fc2", "fc3"], ["fc2", "fc3"])])
def test_fedrep_and_fedper_share_exactly_the_body_and_keep_exactly_the_named_head(name, head, personal):
    net, sent, arrays, n, context = _fit(name, head)
    state = net.state_dict()
    body = [k for k in state if k.split(".")[0] not in personal]
    head_keys = [k for k in state if k.split(".")[0] in personal]
    assert n == _sizes(1)[0]
    assert len(arrays) == len(body) == len(sent)
    for key, array in zip(body, arrays):  # the wire carries the trained body, in the user's order
        np.testing.assert_array_equal(array, state[key].numpy())
    kept = context.state["personal"].to_numpy_ndarrays()
    assert len(kept) == len(head_keys)
    for key, array in zip(head_keys, kept):  # context.state holds the trained head
        np.testing.assert_array_equal(array, state[key].numpy())


def test_pfedfda_shares_the_body_and_writes_its_lda_head_into_the_users_fc3():
    net, sent, arrays, _, _ = _fit("pfedfda", "fc3")
    backbone, means, cov = split_wire(arrays)
    state = net.state_dict()
    assert [a.shape for a in backbone] == [tuple(state[k].shape) for k in BODY]
    for key, array in zip(BODY, backbone):
        np.testing.assert_array_equal(array, state[key].numpy())
    assert means.shape == (3, 12) and cov.shape == (12, 12)  # C classes x fc3's 12 input features


def test_feddar_shares_the_body_and_keeps_one_copy_of_fc3_per_domain_at_the_end_of_the_wire():
    torch.manual_seed(5)
    net = QuickNet()
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 3},
                      state=RecordDict(), run_config={})
    client = ALGORITHMS["feddar"].client(context, net, tuple_data(0), _train_config(), head="fc3")
    wire = client.get_parameters({})
    assert [a.shape for a in wire] == [tuple(net.state_dict()[k].shape) for k in BODY] + [(3, 12), (3,)] * 2
    u = np.ones(2)
    arrays, _, _ = client.fit(wire + [u], {"feddar-phase": "rep", "epochs": 1, "server-round": 1})
    assert len(arrays) == len(BODY)  # the representation phase sends the body only
    for key, array in zip(BODY, arrays):
        np.testing.assert_array_equal(array, net.state_dict()[key].numpy())


# ---------------------------------------------------------------- dict batches


def _state_arrays(grid) -> dict:
    return {(node, key): [a.copy() for a in record.to_numpy_ndarrays()]
            for node, context in grid.contexts.items()
            for key, record in context.state.array_records.items()}


def _numbers(rows) -> list:
    drop = ("seconds",)
    return [(r, phase, {k: v for k, v in m.items() if not any(d in k for d in drop)}, clients and {
        pid: {k: v for k, v in c.items() if not any(d in k for d in drop)} for pid, c in clients.items()})
        for r, phase, m, clients in rows]


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_dict_batches_give_the_same_numbers_as_tuple_batches(name):
    """flwr-datasets' keys by default, and custom keys through BatchKeys: the same metrics and
    the same arrays, byte for byte, as the equivalent TensorDataset loaders."""
    reference_rows, reference_grid, _ = run(name, tuple_data)
    for data in (dict_data, lambda pid: dict_data(pid, ("pixels", "y", "site"))):
        rows, grid, _ = run(name, data)
        assert _numbers(rows) == _numbers(reference_rows)
        expected, got = _state_arrays(reference_grid), _state_arrays(grid)
        assert expected.keys() == got.keys()
        for key in expected:
            for a, b in zip(expected[key], got[key]):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), key


def test_unreadable_dict_batches_fail_the_client_with_the_keys_it_found():
    data = dict_data(0, ("pixels", "y", "site"))
    data = dataclasses.replace(data, batch_keys=BatchKeys())  # the keys were not named
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 3},
                      state=RecordDict(), run_config={})
    client = ALGORITHMS["fedrep"].client(context, QuickNet(), data, _train_config(), head="fc3", head_epochs=1)
    with pytest.raises(ConfigError, match=r"keys \['pixels', 'y', 'site'\].*no input key \(looked for 'img', "
                                          r"'image'\); no target key .*batch_keys=BatchKeys\("):
        client.fit(client.get_parameters({}), {"server-round": 1})


# ---------------------------------------------------------------- clear refusals


def _context() -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 3},
                   state=RecordDict(), run_config={})


@pytest.mark.parametrize("name", ["fedrep", "fedper", "pfedfda", "fedora", "fmtl", "feddar"])
def test_algorithms_that_need_a_head_refuse_a_model_without_one_and_list_its_modules(name):
    spec = ALGORITHMS[name]
    with pytest.raises(ConfigError, match=r"needs to know which part of the model is its head.*"
                                          r"QuickNet's modules: conv1, conv2, fc1, fc2, fc3\)"):
        spec.client(_context(), QuickNet(), tuple_data(0), _train_config(), **spec.client_kwargs(spec.options()))


@pytest.mark.parametrize("name", ["fedavg", "finetune", "local", "fedgp"])
def test_algorithms_that_move_the_whole_model_take_a_plain_module_without_a_head(name):
    spec = ALGORITHMS[name]
    net = QuickNet()
    client = spec.client(_context(), net, tuple_data(0), _train_config(), **spec.client_kwargs(spec.options()))
    arrays, n, _ = client.fit(client.get_parameters({}), {"server-round": 1})
    if client.shared_group is not None:
        assert [a.shape for a in arrays] == [tuple(v.shape) for v in net.state_dict().values()]
    assert n == _sizes(0)[0]


@pytest.mark.parametrize("name", ["pfedfda", "fedora", "fmtl", "feddar"])
def test_algorithms_that_need_the_head_as_one_module_refuse_a_head_spread_over_modules(name):
    spec = ALGORITHMS[name]
    with pytest.raises(ConfigError, match=r"needs the model's head as one module.*\['fc2', 'fc3'\]"):
        spec.client(_context(), QuickNet(), tuple_data(0), _train_config(), head=["fc2", "fc3"],
                    **spec.client_kwargs(spec.options()))


def test_pfedfda_refuses_a_head_that_is_not_a_linear_layer_with_a_bias():
    class NoBias(QuickNet):
        def __init__(self) -> None:
            super().__init__()
            self.fc3 = torch.nn.Linear(12, 3, bias=False)

    with pytest.raises(ConfigError, match=r"pFedFDA needs one linear head with a bias.*a head without a bias"
                                         r".*head='fc3'"):
        ALGORITHMS["pfedfda"].client(_context(), NoBias(), tuple_data(0), _train_config(), head="fc3")
    net = QuickNet()
    net.fc3 = torch.nn.Sequential(torch.nn.Linear(12, 3))
    with pytest.raises(ConfigError, match=r"a head of type Sequential \(need torch.nn.Linear\)"):
        ALGORITHMS["pfedfda"].client(_context(), net, tuple_data(0), _train_config(), head="fc3")


def test_feddar_refuses_a_head_that_is_not_linear():
    net = QuickNet()
    net.fc3 = torch.nn.Sequential(torch.nn.Linear(12, 3))
    with pytest.raises(ConfigError, match=r"FedDAR needs linear heads.*head is a Sequential"):
        ALGORITHMS["feddar"].client(_context(), net, tuple_data(0), _train_config(), head="fc3")


def test_an_unknown_head_name_lists_the_models_modules():
    with pytest.raises(ConfigError, match=r"head='fc4' is not a module of QuickNet \(did you mean 'fc3'.*\); its "
                                          r"modules with parameters are: conv1, conv2, fc1, fc2, fc3$"):
        ALGORITHMS["fedrep"].client(_context(), QuickNet(), tuple_data(0), _train_config(), head="fc4")
