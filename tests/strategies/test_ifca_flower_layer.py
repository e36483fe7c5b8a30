"""IFCA (Ghosh, Chung, Yin and Ramchandran, NeurIPS 2020) in the Flower layer: four clients of
unequal sizes whose labels lean to class 0 or class 2, a user's model with BatchNorm and its head
named, shuffled training batches, and three cluster models whose heads favour class 0, 1 and 2,
so that every client's pick can be worked out by hand (the losses written out with the model's
arithmetic, not the model) and cluster 1 is picked by nobody. Checked: each client's pick is the
argmin of its training losses and it trains that model exactly as FedAvg's client would; the
server's per-cluster example-weighted means, the unpicked cluster kept bit for bit, the shared
body with ``share_body``; the assignment in the fit metrics and the rows (sizes, assignment);
the starting clusters; k = 1 against FedAvg, bit for bit, through the app in both API flavours;
the checkpoint and a killed-and-resumed run; the Message-API flavour started from a user's
``state_dict``; refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flwr_pfl.app.entries.ifca  # noqa: F401  (registers "ifca")
from app.test_resume import DOMAINS, EXTRA, check_killed_and_resumed, dataset  # noqa: F401 - a fixture
from app.test_reruns import base_config, domain_dataset  # noqa: F401 - a fixture
from fakes import FakeProxy, NumPyProxy, client_manager, fit_res
from fakes import assert_arrays_close as close
from flwr_pfl import serverapp
from flwr_pfl.app.checkpoint import CHECKPOINT_NAME, read_checkpoint, write_checkpoint
from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.export import EXTRAS_FILE, MODEL_FILE
from flwr_pfl.app.inprocess import InProcessGrid, run_inprocess
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.clientapp import register_handlers
from flwr_pfl.clients import FedAvgClient
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.clients.ifca import IFCAClient
from flwr_pfl.core.ifca import cluster_init_seed
from flwr_pfl.errors import ConfigError
from flwr_pfl.models.reinit import redrawn_arrays
from flwr_pfl.strategies.ifca import IFCA
from flwr_pfl.training import OptimizerConfig, group_keys

K, LR = 3, 0.4
#: per client: training labels (unequal sizes); clients 0 and 2 lean to class 0, 1 and 3 to class 2
LABELS = ([0] * 8 + [1] * 2 + [2] * 2, [2] * 11 + [0] * 3 + [1] * 3, [0] * 6 + [2] * 2, [2] * 9 + [1] * 4)
NAMES = ["fc.weight", "fc.bias", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked",
         "head.weight", "head.bias"]


class Net(nn.Module):
    """A user's model: fc (5 -> 4), BatchNorm1d, tanh, then the head ``head`` (4 -> 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.bn(self.fc(x))))


def net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def arrays_of(model: nn.Module) -> list[np.ndarray]:
    return [v.detach().numpy().copy() for v in model.state_dict().values()]


def samples(pid: int) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.tensor(LABELS[pid])
    g = torch.Generator().manual_seed(60 + pid)
    return torch.randn(len(y), 5, generator=g) + y[:, None].float() * torch.tensor([0.8, -0.4, 0.2, 0.5, 0.0]), y


def make_data(pid: int) -> LocalData:
    x, y = samples(pid)
    test = TensorDataset(x[::2] + 0.1, y[::2])
    # shuffled mini-batches: the picks do not depend on them (losses over the whole split), the
    # training does, so a cluster estimate that drew from torch's generator would show
    return LocalData(DataLoader(TensorDataset(x, y), batch_size=5, shuffle=True), DataLoader(test, batch_size=len(test)))


def context(pid: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})


def train_config() -> TrainConfig:
    return TrainConfig(local_epochs=2, batch_size=32, optimizer=OptimizerConfig("sgd", LR), device="cpu", seed=4)


def client(pid: int, ctx: Context | None = None, **options) -> IFCAClient:
    options = {"num_clusters": K} | options
    return IFCAClient(ctx or context(pid), net(20 + pid), make_data(pid), train_config(), head="head", **options)


def cluster_models() -> list[list[np.ndarray]]:
    """Cluster j: its own body (a model built under seed j) whose BatchNorm has seen data, and a
    head whose bias favours class j by 3."""
    out = []
    for j in range(K):
        arrays = arrays_of(net(j))
        arrays[4] = np.linspace(-0.2, 0.3, 4, dtype=np.float32) * (j + 1)  # running_mean
        arrays[5] = np.linspace(0.5, 1.5, 4, dtype=np.float32)  # running_var
        arrays[6] = np.array(5 * j + 3, np.int64)  # num_batches_tracked
        arrays[8] = np.where(np.arange(3) == j, 3.0, 0.0).astype(np.float32)
        out.append(arrays)
    return out


def wire(models: list[list[np.ndarray]], share: bool = False) -> list[np.ndarray]:
    """The global layout: cluster 0's model, then each further cluster's part (the head alone with a shared body)."""
    return [*models[0], *(a for m in models[1:] for a in (m[7:] if share else m))]


def hand_loss(arrays: list[np.ndarray], x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean negative log-likelihood of the model ``arrays`` (in NAMES' order) on (x, y), with
    BatchNorm's running statistics, written out (not the module)."""
    w, b, gamma, beta, mean, var, _, hw, hb = (torch.as_tensor(a).double() for a in arrays)
    z = torch.tanh((x.double() @ w.T + b - mean) / torch.sqrt(var + 1e-5) * gamma + beta)
    logits = z @ hw.T + hb
    return float((torch.logsumexp(logits, 1) - logits[torch.arange(len(y)), y]).mean())


def cluster_of(models: list[list[np.ndarray]], j: int, share: bool) -> list[np.ndarray]:
    """Cluster j's whole model (with a shared body: cluster 0's body and j's head)."""
    return [*models[0][:7], *models[j][7:]] if share else models[j]


def hand_pick(models: list[list[np.ndarray]], pid: int, share: bool = False) -> int:
    losses = [hand_loss(cluster_of(models, j, share), *samples(pid)) for j in range(K)]
    best = 0
    for j in range(1, K):
        if losses[j] < losses[best]:
            best = j
    return best


def strategy(n: int = 4, share: bool = False, rows: list | None = None, **kwargs) -> IFCA:
    on_round = (lambda *row: rows.append(row)) if rows is not None else None
    return IFCA(num_clients=n, num_clusters=K, share_body=share, seed=0, on_round=on_round, **kwargs)


def one_round(share: bool, rows: list | None = None) -> tuple[IFCA, list, list[np.ndarray], list[np.ndarray]]:
    """One fit round of the four clients through proxies: (strategy, fit results, the global
    arrays before, after)."""
    start = wire(cluster_models(), share)
    s = strategy(share=share, rows=rows, initial_arrays=[a.copy() for a in start])
    proxies = [NumPyProxy(str(80 + pid), pid, client(pid, share_body=share)) for pid in range(4)]
    cm = client_manager(proxies)
    results = [(p, p.fit(ins, None, 1)) for p, ins in s.configure_fit(1, ndarrays_to_parameters(start), cm)]
    params, metrics = s.aggregate_fit(1, results, [])
    assert metrics["num_rejected"] == 0 and metrics["num_failures"] == 0
    return s, results, start, parameters_to_ndarrays(params)


# ------------------------------------------------------------------------------ the client
@pytest.mark.parametrize("share", [False, True])
def test_each_client_picks_the_argmin_of_its_training_losses_and_trains_it_as_fedavg(share):
    models = cluster_models()
    picks = [hand_pick(models, pid, share) for pid in range(4)]
    assert picks == [0, 2, 0, 2]  # the scenario: cluster 1 is nobody's
    for pid in range(4):
        arrays, n, metrics = client(pid, share_body=share).fit(wire(models, share), {"server-round": 2})
        assert metrics["ifca_cluster"] == picks[pid] and n == len(LABELS[pid])
        # the reply: the picked cluster's model trained exactly as FedAvg's client trains it
        fedavg = FedAvgClient(context(pid), net(20 + pid), make_data(pid), train_config(), head="head")
        expected, _, fedavg_metrics = fedavg.fit([a.copy() for a in cluster_of(models, picks[pid], share)], {"server-round": 2})
        close(arrays, expected, atol=0)
        assert metrics["train_loss"] == fedavg_metrics["train_loss"]
        # evaluation picks the same way and evaluates that model
        loss, _, eval_metrics = client(pid, share_body=share).evaluate(wire(models, share), {"server-round": 2})
        assert eval_metrics["ifca_cluster"] == picks[pid]
        reference = FedAvgClient(context(pid), net(20 + pid), make_data(pid), train_config(), head="head")
        assert loss == reference.evaluate([a.copy() for a in cluster_of(models, picks[pid], share)], {"server-round": 2})[0]


def test_ties_go_to_the_lowest_cluster_and_a_lower_loss_anywhere_wins():
    models = cluster_models()
    same = [models[2], models[2], models[2]]  # three identical clusters: cluster 0
    assert client(1).fit(wire(same), {"server-round": 1})[2]["ifca_cluster"] == 0
    last = [models[1], models[1], models[2]]  # client 1 leans to class 2: the last cluster
    assert client(1).fit(wire(last), {"server-round": 1})[2]["ifca_cluster"] == 2


def test_the_wire_names_the_users_tensors_then_each_further_clusters_part():
    assert client(0).user_wire_names() == [*NAMES, *(f"ifca:cluster{j}.{n}" for j in (1, 2) for n in NAMES)]
    assert client(0, share_body=True).user_wire_names() == [
        *NAMES, "ifca:cluster1.head.weight", "ifca:cluster1.head.bias", "ifca:cluster2.head.weight", "ifca:cluster2.head.bias"]
    assert client(0, num_clusters=1).user_wire_names() == NAMES
    for options in ({}, {"share_body": True}, {"num_clusters": 1}):
        c = client(0, **options)  # the layout's shapes are those of the arrays a client starts the run from
        assert c.wire_layout() == [(n, list(a.shape)) for n, a in zip(c.wire_names(), c.get_parameters({}), strict=True)]


@pytest.mark.parametrize("share", [False, True])
def test_the_starting_clusters_differ_and_are_drawn_from_the_runs_seed_the_same_on_every_client(share):
    first, other = client(0, share_body=share), client(3, share_body=share)  # another model, data and partition
    start = first.get_parameters({})
    keys = group_keys(first.model, "heads" if share else "all")
    model = first.model
    assert len(start) == 9 + 2 * len(keys)
    close(start[:9], arrays_of(net(20)), atol=0)  # cluster 0: the client's own model
    extras = start[9:]
    for j in (1, 2):
        close(extras[(j - 1) * len(keys):j * len(keys)], redrawn_arrays(model, keys, cluster_init_seed(4, j)), atol=0)
    close(other.get_parameters({})[9:], extras, atol=0)  # the same on another client
    assert not np.array_equal(extras[0], start[9 - len(keys)])  # cluster 1 is not cluster 0 ...
    assert not np.array_equal(extras[0], extras[len(keys)])  # ... nor cluster 2
    reseeded = IFCAClient(context(0), net(20), make_data(0), TrainConfig(device="cpu", seed=5), head="head",
                          num_clusters=K, share_body=share)
    assert not np.array_equal(reseeded.get_parameters({})[9], extras[0])  # another run seed, other clusters


# ------------------------------------------------------------------------------ the server
def test_each_cluster_is_the_example_weighted_mean_of_its_members_and_the_unpicked_one_is_kept():
    rows: list = []
    s, results, start, out = one_round(share=False, rows=rows)
    replies = {proxy.pid: (parameters_to_ndarrays(res.parameters), res.num_examples, res.metrics) for proxy, res in results}
    picks = {pid: m["ifca_cluster"] for pid, (_, _, m) in replies.items()}
    assert picks == {0: 0, 1: 2, 2: 0, 3: 2}
    for j in (0, 2):
        members = [pid for pid in sorted(replies) if picks[pid] == j]
        total = sum(replies[pid][1] for pid in members)
        for i in range(9):
            mean = sum(replies[pid][1] * replies[pid][0][i].astype(np.float64) for pid in members) / total
            got = out[9 * j + i]
            if got.dtype.kind in "iu":
                assert got.dtype == np.int64 and int(got) == int(np.rint(mean))
            else:
                assert got.dtype == np.float32
                np.testing.assert_allclose(got, mean, rtol=1e-6, atol=1e-7)
    for i in range(9):  # cluster 1, picked by nobody: unchanged, bit for bit
        assert out[9 + i].tobytes() == start[9 + i].tobytes() and out[9 + i].dtype == start[9 + i].dtype
    close(s.global_arrays, out, atol=0)
    # the assignment: each client's pick in its per-client row, the cluster sizes in the round's row
    (fit_row,) = [row for row in rows if row[1] == "fit"]
    _, _, metrics, clients = fit_row
    assert {pid: c["ifca_cluster"] for pid, c in clients.items()} == picks
    assert [metrics[f"ifca_cluster_size_{j}"] for j in range(K)] == [2.0, 0.0, 2.0]
    assert metrics["ifca_assignment"] == "0:0 1:2 2:0 3:2"
    assert not [k for k in metrics if k.startswith("ifca_cluster_") and not k.startswith("ifca_cluster_size_")]


def test_with_a_shared_body_the_body_is_averaged_over_everyone_and_each_head_over_its_cluster():
    s, results, start, out = one_round(share=True)
    replies = [(parameters_to_ndarrays(res.parameters), res.num_examples, res.metrics["ifca_cluster"]) for _, res in results]
    assert len(out) == 9 + 2 * 2 and all(len(r) == 9 for r, _, _ in replies)
    assert sorted(c for _, _, c in replies) == [0, 0, 2, 2]
    total = sum(n for _, n, _ in replies)
    for i in range(7):  # the body (BatchNorm's statistics included): every reply
        mean = sum(n * r[i].astype(np.float64) for r, n, _ in replies) / total
        if out[i].dtype.kind in "iu":
            assert int(out[i]) == int(np.rint(mean))
        else:
            np.testing.assert_allclose(out[i], mean, rtol=1e-6, atol=1e-7)
    heads = {0: out[7:9], 1: out[9:11], 2: out[11:13]}
    for j in (0, 2):
        members = [(r, n) for r, n, c in replies if c == j]
        expected = [sum(n * r[i].astype(np.float64) for r, n in members) / sum(n for _, n in members) for i in (7, 8)]
        close(heads[j], expected, atol=1e-7)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(heads[1], start[9:11]))  # nobody's head: kept
    assert s.model_arrays == 9


def test_evaluation_rows_carry_each_clients_pick_and_the_cluster_sizes():
    rows: list = []
    s, _, _, out = one_round(share=False, rows=rows)
    proxies = [NumPyProxy(str(80 + pid), pid, client(pid)) for pid in range(4)]
    instructions = s.configure_evaluate(1, ndarrays_to_parameters(out), client_manager(proxies))
    for p, ins in instructions:
        assert ins.config["server-round"] == 1
        close(parameters_to_ndarrays(ins.parameters), out, atol=0)  # every client gets all k models
    results = [(p, p.evaluate(ins, None, 1)) for p, ins in instructions]
    _, metrics = s.aggregate_evaluate(1, results, [])
    models = [out[:9], out[9:18], out[18:]]
    picks = {pid: hand_pick(models, pid) for pid in range(4)}
    (_, _, row, clients) = [row for row in rows if row[1] == "evaluate"][0]
    assert {pid: c["ifca_cluster"] for pid, c in clients.items()} == picks
    sizes = [float(sum(1 for p in picks.values() if p == j)) for j in range(K)]
    assert [row[f"ifca_cluster_size_{j}"] for j in range(K)] == sizes == [metrics[f"ifca_cluster_size_{j}"] for j in range(K)]
    assert "ifca_cluster_wmean" not in row and "ifca_cluster_mean" not in metrics


def test_bad_replies_are_rejected_and_the_round_goes_on():
    s = strategy(initial_arrays=wire(cluster_models()))
    good = cluster_models()[2]
    results = [
        (FakeProxy("0", 0), fit_res(good, 5, 0, {"ifca_cluster": 2})),
        (FakeProxy("1", 1), fit_res(good, 5, 1, {"ifca_cluster": 3})),
        (FakeProxy("2", 2), fit_res(good, 5, 2, {"ifca_cluster": 1.5})),
        (FakeProxy("3", 3), fit_res(good, 5, 3, {})),
        (FakeProxy("4", 4), fit_res(good[:-1], 5, 4, {"ifca_cluster": 0})),
        (FakeProxy("5", 5), fit_res(wire(cluster_models()), 5, 5, {"ifca_cluster": 0})),
    ]
    _, metrics = s.aggregate_fit(1, results, [])
    assert metrics["num_rejected"] == 5 and metrics["ifca_cluster_size_2"] == 1.0
    close(s.global_arrays[18:], good, atol=0)
    with pytest.raises(ConfigError, match="cannot be used"):
        strategy(clip_update_norm=1.0)


def test_a_shared_body_learns_the_models_size_from_the_first_reply_and_keeps_it():
    start = wire(cluster_models(), share=True)
    s = strategy(share=True, initial_arrays=start, stop_if_nothing_trains=False)  # round 1 is all rejected here
    assert s.expected_model_arrays() is None
    head_only = [FakeProxy("0", 0), fit_res(start[7:9], 3, 0, {"ifca_cluster": 0})]  # 2 arrays: no fit (P > M)
    _, metrics = s.aggregate_fit(1, [tuple(head_only)], [])
    assert metrics["num_rejected"] == 1 and s.model_arrays is None
    _, metrics = s.aggregate_fit(1, [(FakeProxy("1", 1), fit_res(start[:9], 3, 1, {"ifca_cluster": 1}))], [])
    assert metrics["num_rejected"] == 0 and s.model_arrays == 9
    out = s.global_arrays
    close(out[:7], start[:7], atol=1e-7)  # the body: the one reply's
    assert all(a.tobytes() == b.tobytes() for a, b in zip(out[7:9], start[7:9]))  # cluster 0's head: nobody's, kept
    close(out[9:11], start[7:9], atol=1e-7)  # cluster 1's head: the reply's
    assert all(a.tobytes() == b.tobytes() for a, b in zip(out[11:13], start[11:13]))  # cluster 2's: kept


@pytest.mark.parametrize("share", [False, True])
def test_the_checkpoint_holds_every_cluster_and_resumes_exactly(tmp_path, share):
    s, _, _, out = one_round(share)
    saved = read_checkpoint(write_checkpoint(tmp_path, 1, {"algorithm": "ifca"}, {}, s.state_dict()))
    resumed = strategy(share=share)
    resumed.load_state_dict(saved.state, saved.rounds_done)
    assert resumed.round_offset == 1 and resumed.model_arrays == s.model_arrays
    close(resumed.global_arrays, out, atol=0)
    # the next round from the resumed strategy equals the next round of the original
    def next_round(st: IFCA) -> list[np.ndarray]:
        proxies = [NumPyProxy(str(90 + pid), pid, client(pid, share_body=share)) for pid in range(4)]
        current = ndarrays_to_parameters(st.global_arrays)
        results = [(p, p.fit(ins, None, 2)) for p, ins in st.configure_fit(1 if st is resumed else 2, current, client_manager(proxies))]
        return parameters_to_ndarrays(st.aggregate_fit(2, results, [])[0])

    close(next_round(resumed), next_round(s), atol=0)


# ------------------------------------------------------------------------------ through the app
def app_run(tmp_path: Path, dataset: str, algorithm: str, name: str, **overrides) -> dict:
    cfg = base_config(tmp_path, dataset, algorithm, name, **overrides)
    run_inprocess(server_app, client_app, cfg["num-clients"], cfg)
    out = tmp_path / name
    return {
        "metrics": json.loads((out / "metrics.json").read_text()),
        "clients": json.loads((out / "clients.json").read_text()),
        "model": torch.load(out / MODEL_FILE, weights_only=True),
        "extras": torch.load(out / EXTRAS_FILE, weights_only=True) if (out / EXTRAS_FILE).exists() else {},
        "checkpoint": read_checkpoint(out / CHECKPOINT_NAME),
    }


def without_ifca(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("ifca_") and "seconds" not in k and k != "algorithm"}
            for row in rows]


@pytest.mark.parametrize("api", ["numpyclient", "message"])
@pytest.mark.parametrize("share", [False, True])
def test_one_cluster_is_fedavg_to_the_bit(tmp_path, domain_dataset, api, share):  # noqa: F811
    fedavg = app_run(tmp_path, domain_dataset, "fedavg", "fedavg", api=api)
    ifca = app_run(tmp_path, domain_dataset, "ifca", "ifca", api=api, **{"ifca.num-clusters": 1, "ifca.share-body": share})
    assert without_ifca(ifca["metrics"]) == without_ifca(fedavg["metrics"])
    assert without_ifca(ifca["clients"]) == without_ifca(fedavg["clients"])
    assert list(ifca["model"]) == list(fedavg["model"]) and not ifca["extras"]
    for key, tensor in fedavg["model"].items():
        assert torch.equal(ifca["model"][key], tensor), key
    for a, b in zip(ifca["checkpoint"].state["global_arrays"], fedavg["checkpoint"].state["global_arrays"], strict=True):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    fits = [row for row in ifca["metrics"] if row["phase"] == "fit"]
    assert fits and all(row["ifca_cluster_size_0"] == row["participants"] for row in fits)


def test_the_run_records_every_clients_pick_and_exports_every_cluster(tmp_path, domain_dataset):  # noqa: F811
    run = app_run(tmp_path, domain_dataset, "ifca", "ifca", **{"ifca.num-clusters": 3, "fraction-fit": 1.0})
    for phase in ("fit", "evaluate"):
        rows = [row for row in run["metrics"] if row["phase"] == phase]
        assert rows
        for row in rows:
            pairs = [pair.split(":") for pair in row["ifca_assignment"].split()]
            assert [pid for pid, _ in pairs] == row["participant_ids"].split()
            picks = [int(cluster) for _, cluster in pairs]
            assert [row[f"ifca_cluster_size_{j}"] for j in range(3)] == [float(picks.count(j)) for j in range(3)]
    last = [row for row in run["metrics"] if row["phase"] == "evaluate"][-1]
    assert last["ifca_assignment"].split() == [f"{c['partition_id']}:{c['ifca_cluster']}" for c in run["clients"]
                                               if c["round"] == last["round"]]
    names = list(run["model"]) + list(run["extras"])
    assert len(names) == len(run["checkpoint"].state["global_arrays"]) == 3 * len(run["model"])
    assert list(run["extras"])[0].startswith("ifca:cluster1.")


@pytest.mark.parametrize("share", [False, True])
def test_a_run_killed_mid_round_and_resumed_equals_the_uninterrupted_run(tmp_path, dataset, monkeypatch, share):  # noqa: F811
    """Fresh nodes after the kill: IFCA's clients keep nothing; every cluster (and, with a
    shared body, the model's size learned from the first reply) is in the checkpoint."""
    monkeypatch.setitem(EXTRA, "ifca", DOMAINS | {"ifca.num-clusters": 3, "ifca.share-body": share})
    check_killed_and_resumed(tmp_path, dataset, monkeypatch, "ifca", 0.5, False, 3, "fit", 2)


def test_the_message_flavour_starts_from_a_users_state_dict_and_draws_the_other_clusters_on_a_client():
    def build(ctx: Context) -> IFCAClient:
        pid = int(ctx.node_config["partition-id"])
        return IFCAClient(ctx, net(20), make_data(pid), train_config(), head="head", num_clusters=K)

    handlers = register_handlers(ClientApp(), build)
    sent: list = []

    def app(message, ctx):
        if message.metadata.message_type == "train":
            sent.append(message.content.array_records["arrays"])
        return handlers(message, ctx)

    grid = InProcessGrid(app, 3, {})  # type: ignore[arg-type]
    initial = ArrayRecord({k: Array(v.numpy()) for k, v in net(20).state_dict().items()})  # no ifca: arrays
    strategy_ = serverapp.IFCA(num_clients=3, num_clusters=K, num_rounds=1)
    result = strategy_.start(grid=grid, initial_arrays=initial, num_rounds=1, timeout=60)
    # handed back: cluster 0 as the user's model; clusters 1 and 2 apart (no place in the user's model)
    assert list(result.arrays.keys()) == NAMES and len(strategy_.extra_arrays) == 18
    assert all(name.startswith("ifca:cluster") for name in strategy_.extra_arrays.keys())
    first = sent[0]
    assert list(first.keys()) == build(context(0)).user_wire_names()
    close(first.to_numpy_ndarrays()[:9], arrays_of(net(20)), atol=0)  # the user's model is cluster 0
    model = build(context(0)).model
    drawn = [a for j in (1, 2) for a in redrawn_arrays(model, group_keys(model, "all"), cluster_init_seed(4, j))]
    close(first.to_numpy_ndarrays()[9:], drawn, atol=0)  # the others as a client draws them


def test_options_reach_the_client_and_strategy_and_bad_values_name_the_key(tmp_path):
    spec = ALGORITHMS["ifca"]
    cfg = {"algorithm": "ifca", "dataset": "feddar-synthetic", "output-dir": str(tmp_path)}
    experiment = parse_experiment(cfg | {"ifca.num-clusters": 4, "ifca.share-body": True})
    assert spec.client_kwargs(experiment.options) == {"num_clusters": 4, "share_body": True}
    assert spec.strategy_kwargs(experiment.options) == {"num_clusters": 4, "share_body": True}
    with pytest.raises(ConfigError, match="ifca.num-clusters must be an integer >= 1"):
        parse_experiment(cfg | {"ifca.num-clusters": 0})
    with pytest.raises(ConfigError, match="IFCA's num_clusters"):
        IFCA(num_clients=2, num_clusters=0)
    with pytest.raises(ConfigError, match="IFCA's share_body"):
        client(0, share_body=1)
    with pytest.raises(ConfigError, match="head"):  # weight sharing needs the head named
        IFCAClient(context(0), net(1), make_data(0), train_config(), num_clusters=2, share_body=True)
    with pytest.raises(ValueError, match="IFCA's instruction has 9 arrays; with 3 clusters this model needs 27"):
        client(0).fit(cluster_models()[0], {"server-round": 1})
