"""FEDORA end to end through the real Strategy and NumPyClient, in one process (no Ray).

The federation is the spec's synthetic benchmark (7.4): rotated class prototypes with heavy
noise (``noise_sigma = 2``), client k rotated by ``360 k / K`` degrees, softmax regression
(785 x 10), SGD lr 5e-3 with momentum 0.9 and weight decay 5e-5, batch 64, E = 5 local epochs.
Scaled to run in CI: K = 18 clients at 20 degree steps, 25 rounds. The server is the app's real
ServerApp (config parsing, the registry, results files); the ClientApp builds the registered
client on this federation's data.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np
import pytest
import torch
from flwr.client import ClientApp
from torch import nn

from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.clients.base import LocalData
from flwr_pfl.data.synthetic.fedora import RotatedPrototypeConfig, make_rotated_prototype_clients
from flwr_pfl.data.types import ArraySplit
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.training import seed_everything

NUM_CLIENTS = 18
NOISE = 2.0


@functools.lru_cache(maxsize=8)
def federation(seed: int, num_clients: int = NUM_CLIENTS, noise: float = NOISE):
    cfg = RotatedPrototypeConfig(num_clients=num_clients, noise_sigma=noise, seed=seed)
    return make_rotated_prototype_clients(cfg)


def _split(x: np.ndarray, y: np.ndarray) -> ArraySplit:
    return ArraySplit(torch.from_numpy(x), torch.from_numpy(y), torch.zeros(len(y), dtype=torch.long))


def softmax_regression() -> EncoderHeadModel:
    model = EncoderHeadModel(nn.Flatten(), 784, 10)
    with torch.no_grad():  # N(0, 0.01^2), shared by all (the spec's initialisation)
        model.heads[0].weight.normal_(0.0, 0.01)
        model.heads[0].bias.zero_()
    return model


def make_client(context, hook=None):
    experiment = parse_experiment(context.run_config)
    clients = federation(int(context.run_config.get("seed", 0)), int(context.run_config["num-clients"]), NOISE)
    pid = int(context.node_config["partition-id"])
    c = clients[pid]
    seed_everything(experiment.run.seed)
    model = softmax_regression()
    data = LocalData(
        train=_split(c.x_train, c.y_train).loader(64, shuffle=True),
        test=_split(c.x_test, c.y_test).loader(512, shuffle=False),
        val=_split(c.x_val, c.y_val).loader(512, shuffle=False),
    )
    spec = experiment.algorithm
    client = spec.client(context, model, data, experiment.train_config, **spec.client_kwargs(experiment.options))
    if hook is not None:
        hook(client, pid)
    return client


synthetic_client_app = ClientApp(client_fn=lambda context: make_client(context).to_client())


def synthetic_config(tmp_path, algorithm: str, seed: int = 0, **overrides) -> dict:
    base = {
        "algorithm": algorithm,
        "num-clients": NUM_CLIENTS,
        "num-server-rounds": 25,
        "local-epochs": 5,
        "batch-size": 64,
        "learning-rate": 5e-3,
        "momentum": 0.9,
        "weight-decay": 5e-5,
        "seed": seed,
        "output-dir": str(tmp_path),
        "run-name": f"{algorithm}-{seed}",
    }
    return base | overrides


def run_synthetic(tmp_path, algorithm: str, seed: int = 0, client_app=synthetic_client_app, **overrides):
    """(grid, per-client results of the last evaluation, metric rows)."""
    cfg = synthetic_config(tmp_path, algorithm, seed, **overrides)
    grid = run_inprocess(server_app, client_app, int(cfg["num-clients"]), cfg)
    out = tmp_path / cfg["run-name"]
    clients = {c["partition_id"]: c for c in json.loads((out / "clients.json").read_text())}
    rows = json.loads((out / "metrics.json").read_text())
    return grid, clients, rows


def small(tmp_path, name: str, client_app=synthetic_client_app, **overrides):
    """A 6-client, 1-epoch federation for functional checks (a few seconds)."""
    cfg = {"num-clients": 6, "num-server-rounds": 3, "local-epochs": 1, "run-name": name} | overrides
    return run_synthetic(tmp_path, "fedora", 0, client_app=client_app, **cfg)


def hooked_app(hook) -> ClientApp:
    return ClientApp(client_fn=lambda context: make_client(context, hook).to_client())


def checkpoint(tmp_path, name: str) -> dict[str, np.ndarray]:
    with np.load(tmp_path / name / "checkpoint.npz") as ckpt:
        return {k: ckpt[k] for k in ckpt.files}


def flat(arrays) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.float32).reshape(-1) for a in arrays])


# ------------------------------------------------------------------------------ wire and state
def test_wire_layout_and_client_state(tmp_path):
    """Setup: one (d_x + C) x p array up per client; each round one model down and one up per
    client (FedAvg's cost); evaluation sends nothing. The models live in context.state."""
    k, rounds, p_params = 6, 3, 784 * 10 + 10
    grid, clients, rows = small(tmp_path, "wire")
    header = 128  # the .npy header of every serialized array
    model_bytes = p_params * 4 + 2 * header
    setup_bytes = (784 + 10) * 1 * 4 + header
    # + one initial get_parameters reply (the shared theta^0)
    assert grid.bytes_received == model_bytes + k * setup_bytes + rounds * k * model_bytes
    assert grid.bytes_sent == rounds * k * model_bytes
    for ctx in grid.contexts.values():
        personal = ctx.state["personal"].to_numpy_ndarrays()
        local = ctx.state["fedora-local"].to_numpy_ndarrays()
        assert [a.shape for a in personal] == [(10, 784), (10,)] == [a.shape for a in local]
    fits = [r for r in rows if r["phase"] == "fit"]
    assert [r["num_clients"] for r in fits] == [k] * rounds
    assert all(r["num_rejected"] == 0 for r in fits)
    for c in clients.values():  # per-client figures in the results files
        assert {"accuracy", "local_accuracy", "val_accuracy", "r_acc", "trained"} <= set(c)
    last = [r for r in rows if r["phase"] == "evaluate"][-1]
    assert {"r_acc", "ptr", "ptr_strict", "accuracy_local_mean", "best_val_round", "r_acc_bestval",
            "reported_accuracy", "reported_r_acc", "reported_ptr"} <= set(last)
    ck = checkpoint(tmp_path, "wire")
    theta, theta_hat, m = ck["state_fedora_theta"], ck["state_fedora_theta_hat"], ck["state_fedora_propagation"]
    assert theta.dtype == np.float32 and theta.shape == (k, p_params) == theta_hat.shape
    np.testing.assert_allclose(theta_hat, m.astype(np.float32) @ theta, atol=1e-6)  # Eq. 6
    for pid, ctx in enumerate(grid.contexts.values()):  # the server row is the client's last upload
        np.testing.assert_array_equal(theta[pid], flat(ctx.state["personal"].to_numpy_ndarrays()))


def test_shadow_local_equals_the_local_algorithm(tmp_path):
    """The LOCAL shadow model is LOCAL on the same splits: identical per-client accuracy."""
    _, fedora, _ = small(tmp_path, "fedora-shadow")
    _, local, _ = run_synthetic(tmp_path, "local", 0, **{"num-clients": 6, "num-server-rounds": 3,
                                                         "local-epochs": 1, "run-name": "local"})
    for pid in range(6):
        assert fedora[pid]["local_accuracy"] == pytest.approx(local[pid]["accuracy"], abs=1e-9)


def test_partial_participation_keeps_last_models(tmp_path):
    """Clients not sampled keep their last theta_k on the server; Eq. 6 mixes all K rows."""
    grid, clients, rows = small(tmp_path, "partial", **{"fraction-fit": 0.5, "num-server-rounds": 4})
    fits = [r for r in rows if r["phase"] == "fit"]
    assert [r["num_clients"] for r in fits] == [3] * 4
    ck = checkpoint(tmp_path, "partial")
    theta, theta_hat, m = ck["state_fedora_theta"], ck["state_fedora_theta_hat"], ck["state_fedora_propagation"]
    theta0 = flat([ck["global_0"], ck["global_1"]])
    trained = [pid for pid, ctx in enumerate(grid.contexts.values()) if "personal" in ctx.state]
    assert 3 <= len(trained) <= 6
    for pid, ctx in enumerate(grid.contexts.values()):
        if pid in trained:
            np.testing.assert_array_equal(theta[pid], flat(ctx.state["personal"].to_numpy_ndarrays()))
        else:
            np.testing.assert_array_equal(theta[pid], theta0)
    np.testing.assert_allclose(theta_hat, m.astype(np.float32) @ theta, atol=1e-6)
    assert sorted(clients) == list(range(6))  # everyone is evaluated (never-trained: theta^0)


def test_checkpoint_round_trip_and_resume(tmp_path):
    """state_dict -> checkpoint.npz -> load_state_dict restores buffers and graph; a resumed run
    ends where an uninterrupted one does."""
    from flwr.app import Context, RecordDict

    from flwr_pfl.app.config import parse_experiment as parse
    from flwr_pfl.app.inprocess import InProcessGrid
    from flwr_pfl.app.server_app import build_strategy, load_checkpoint

    _, straight, _ = small(tmp_path, "straight", **{"num-server-rounds": 4})
    cfg = synthetic_config(tmp_path, "fedora", 0, **{"num-clients": 6, "num-server-rounds": 2,
                                                      "local-epochs": 1, "run-name": "resumed"})
    grid = InProcessGrid(synthetic_client_app, 6, cfg)
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg))
    ck = checkpoint(tmp_path, "resumed")
    strategy = build_strategy(parse(cfg))
    assert load_checkpoint(strategy, tmp_path / "resumed" / "checkpoint.npz") == 2
    np.testing.assert_array_equal(strategy.theta, ck["state_fedora_theta"])
    np.testing.assert_array_equal(strategy.theta_hat, ck["state_fedora_theta_hat"])
    np.testing.assert_array_equal(strategy.graph.propagation, ck["state_fedora_propagation"])
    state = strategy.state_dict()["arrays"]
    assert state["fedora_theta"] is strategy.theta  # no copy of the K x P buffers
    cfg2 = cfg | {"num-server-rounds": 4, "resume": True}
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg2))
    resumed = {c["partition_id"]: c for c in json.loads((tmp_path / "resumed" / "clients.json").read_text())}
    for pid in range(6):
        assert resumed[pid]["round"] == 4
        assert resumed[pid]["accuracy"] == pytest.approx(straight[pid]["accuracy"], abs=1e-9)


# ------------------------------------------------------------------------------ bad input
def _setup_behaviour(kind: str, victim: int):
    def hook(client, pid):
        if pid != victim:
            return
        original = client.fit

        def fit(parameters, config):
            if config.get("fedora-phase") == "setup":
                if kind == "skip":
                    return [], 1, {"partition_id": pid}
                if kind == "raise":
                    raise RuntimeError("setup crashed")
                if kind == "nan":
                    return [np.full((794, 1), np.nan, dtype=np.float32)], 1, {"partition_id": pid}
            return original(parameters, config)

        client.fit = fit

    return hook


@pytest.mark.parametrize("kind", ["skip", "raise", "nan"])
def test_client_without_valid_setup_upload_trains_alone(tmp_path, kind):
    """No upload, a crash or a NaN subspace: the client is isolated (theta_hat_k = theta_k) and
    still trains and is evaluated; the others propagate as usual."""
    grid, clients, rows = small(tmp_path, f"setup-{kind}", client_app=hooked_app(_setup_behaviour(kind, 2)))
    ck = checkpoint(tmp_path, f"setup-{kind}")
    assert ck["state_fedora_present"].tolist() == [True, True, False, True, True, True]
    m = ck["state_fedora_propagation"]
    np.testing.assert_allclose(m[2], np.eye(6)[2], atol=1e-12)
    assert m[:, 2].sum() == pytest.approx(1.0)  # nobody takes client 2 as a neighbour
    np.testing.assert_array_equal(ck["state_fedora_theta_hat"][2], ck["state_fedora_theta"][2])
    assert sorted(clients) == list(range(6)) and clients[2]["trained"] == 1.0
    assert all(r["num_failures"] == 0 for r in rows if r["phase"] == "fit")


def _zero_data(client, pid):
    if pid == 1:
        c = federation(0, 6, NOISE)[1]
        zeros = np.zeros_like(c.x_train)
        client.data = dataclasses.replace(client.data, train=_split(zeros, c.y_train).loader(64, shuffle=True))


@pytest.mark.parametrize("use_labels", [True, False])
def test_all_zero_data(tmp_path, use_labels):
    """All-zero training inputs: with labels the subspace is the label direction (valid); without
    labels the client reports why it has none and trains alone."""
    name = f"zero-{use_labels}"
    grid, clients, rows = small(tmp_path, name, client_app=hooked_app(_zero_data), **{"fedora.use-labels": use_labels})
    ck = checkpoint(tmp_path, name)
    assert bool(ck["state_fedora_present"][1]) is use_labels
    assert sorted(clients) == list(range(6)) and np.isfinite(clients[1]["accuracy"])


def _nan_validation(client, pid):
    if pid == 3:
        client.validation_error = lambda model, options: float("nan")


def test_nan_validation_loss_no_transfer(tmp_path):
    """NaN validation losses (default on-nonfinite = no_transfer): lambda takes the rule's floor,
    the client trains alone that round and says so; nothing fails."""
    grid, clients, rows = small(tmp_path, "nan-val", client_app=hooked_app(_nan_validation),
                                **{"fedora.preset": "official"})
    fits = [r for r in rows if r["phase"] == "fit"]
    assert all(r["num_failures"] == 0 for r in fits)
    assert all(r["lambda_nonfinite_max"] == 1.0 for r in fits)
    assert all(r["lambda_nonfinite_mean"] == pytest.approx(1 / 6) for r in fits)


def test_nan_validation_loss_raise_fails_the_client(tmp_path):
    """With on-nonfinite = raise the client's round fails: counted as a failure, its theta_hat is
    kept, the others go on."""
    grid, clients, rows = small(tmp_path, "nan-raise", client_app=hooked_app(_nan_validation),
                                **{"fedora.on-nonfinite": "raise"})
    fits = [r for r in rows if r["phase"] == "fit"]
    assert [r["num_failures"] for r in fits] == [1.0] * 3 and [r["num_clients"] for r in fits] == [5.0] * 3
    ck = checkpoint(tmp_path, "nan-raise")
    theta0 = flat([ck["global_0"], ck["global_1"]])
    np.testing.assert_array_equal(ck["state_fedora_theta"][3], theta0)  # never uploaded
    np.testing.assert_array_equal(ck["state_fedora_theta_hat"][3], theta0)  # frozen


def _bad_reply(client, pid):
    if pid != 4:
        return
    original = client.fit

    def fit(parameters, config):
        arrays, n, metrics = original(parameters, config)
        if config.get("fedora-phase") == "train" and int(config["server-round"]) == 2:
            arrays[0][0, 0] = np.nan
        if config.get("fedora-phase") == "train" and int(config["server-round"]) == 3:
            arrays = arrays[:1]
        return arrays, n, metrics

    client.fit = fit


def test_bad_replies_are_rejected(tmp_path):
    """A NaN upload and a wrong array count are rejected with the client named; its server row
    keeps its last valid model and the round goes on."""
    grid, clients, rows = small(tmp_path, "bad-reply", client_app=hooked_app(_bad_reply))
    fits = [r for r in rows if r["phase"] == "fit"]
    assert [r["num_rejected"] for r in fits] == [0.0, 1.0, 1.0]
    assert [r["num_clients"] for r in fits] == [6.0, 5.0, 5.0]
    ck = checkpoint(tmp_path, "bad-reply")
    assert np.all(np.isfinite(ck["state_fedora_theta"])) and np.all(np.isfinite(ck["state_fedora_theta_hat"]))
    theta4 = ck["state_fedora_theta"][4]
    assert not np.array_equal(theta4, flat(list(grid.contexts.values())[4].state["personal"].to_numpy_ndarrays()))


# ------------------------------------------------------------------------------ options
def test_options_presets_and_errors():
    from flwr_pfl.app.entries.fedora import FedoraOptions
    from flwr_pfl.core.fedora import FedoraConfig, fedora_preset
    from flwr_pfl.errors import ConfigError

    def raising(cfg):  # the core's default NaN policy; the Flower default is no_transfer
        return dataclasses.replace(cfg, selection=dataclasses.replace(cfg.selection, on_nonfinite="raise"))

    assert raising(FedoraOptions().core_config()) == FedoraConfig()
    assert raising(FedoraOptions(preset="paper").core_config()) == fedora_preset("paper")
    assert raising(FedoraOptions(preset="official").core_config()) == fedora_preset("official")
    cfg = FedoraOptions(preset="official", kappa=0.5, top_k=0, self_loops="on", lambda_rule="paper").core_config()
    assert cfg.propagation.kappa == 0.5 and cfg.graph.top_k is None and cfg.graph.self_loops
    assert cfg.selection.rule == "paper" and cfg.prox.mode == "post_step"
    assert FedoraOptions(alpha=4.0).core_config().propagation.kappa == pytest.approx(0.8)
    for kwargs, key in (({"preset": "code"}, "fedora.preset"), ({"kappa": 1.0}, "fedora.kappa"),
                        ({"lambda_rule": "exp"}, "fedora.lambda-rule"), ({"top_k": -2}, "fedora.top-k"),
                        ({"alpha": 1.0, "kappa": 0.8}, "fedora.alpha"), ({"prox_mode": "x"}, "fedora.prox-mode"),
                        ({"epsilon": 0.0}, "fedora.epsilon"), ({"report_round": "best"}, "fedora.report-round")):
        with pytest.raises(ConfigError, match=key):
            FedoraOptions(**kwargs)


# ------------------------------------------------------------------------------ spec 7.4
def test_synthetic_benchmark_relations(tmp_path):
    """Spec 7.4 through the real Strategy and NumPyClient, official preset, scaled to CI (K = 18
    at 20 degree steps, 25 rounds; FedAvg 10 rounds). Measured (seeds 0/1): FEDORA 0.292/0.307
    vs LOCAL 0.294/0.307 (R-Acc -0.006/+0.001, PTR 0.94/1.00), FedAvg R-Acc -0.47/-0.46.

    At this scale FEDORA's gain over LOCAL is within noise (the spec's 60-round, K = 36 numpy
    reference gives +0.05); the asserted relations are those that hold with margin: FEDORA no
    worse than LOCAL for >= 90 % of clients with the proximal pull active in some rounds, and
    FedAvg's strong negative transfer.
    """
    _, fedora, rows = run_synthetic(tmp_path, "fedora", 1, **{"fedora.preset": "official", "fedora.eval-every": 25})
    _, fedavg, _ = run_synthetic(tmp_path, "fedavg", 1, **{"num-server-rounds": 10})
    last = [r for r in rows if r["phase"] == "evaluate"][-1]
    acc = np.array([fedora[k]["accuracy"] for k in range(NUM_CLIENTS)])
    local = np.array([fedora[k]["local_accuracy"] for k in range(NUM_CLIENTS)])
    avg = np.array([fedavg[k]["accuracy"] for k in range(NUM_CLIENTS)])
    assert last["r_acc"] == pytest.approx(np.mean((acc - local) / local))
    assert acc.mean() >= local.mean() - 0.005, (acc.mean(), local.mean())
    assert last["r_acc"] > -0.01 and last["ptr"] >= 0.9, last
    assert np.mean((avg - local) / local) < -0.3  # FedAvg: strong negative transfer
    fits = [r for r in rows if r["phase"] == "fit"]
    assert 0.0 < np.mean([r["lambda_active_mean"] for r in fits]) < 1.0  # not degenerate LOCAL
