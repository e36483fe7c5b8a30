"""FEDORA end to end through the real Strategy and NumPyClient, in one process (no Ray).

The federation is the spec's synthetic benchmark (7.4): rotated class prototypes plus noise,
client k rotated by ``360 k / K`` degrees, 128 / 64 / 277 train / validation / test samples,
softmax regression (785 x 10, N(0, 0.01^2) initialisation), SGD lr 5e-3 with momentum 0.9 and
weight decay 5e-5, batch 64, E = 5 local epochs, full participation. The benchmark test uses
the spec's K = 36 clients (10 degree steps) for 15 rounds; the functional tests use 6 clients.
Noise is ``noise_sigma = 1.0`` instead of the spec's 2.0: at 2.0 the clients' one-dimensional
data subspaces are dominated by noise and recover the adjacent angles as top-2 neighbours for
only 0-33 % of the clients (so FEDORA's graph is close to random), against 75-94 % at 1.0
(``tests/core/test_fedora.py::test_e2e_noise_level_recovers_the_ring``). The server is the
app's real ServerApp (config parsing, the registry, results files); the ClientApp builds the
registered client on this federation's data.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.client import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.clients.base import LocalData
from flwr_pfl.data.synthetic.fedora import RotatedPrototypeConfig, make_rotated_prototype_clients
from flwr_pfl.data.types import ArraySplit
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.training import seed_everything, set_arrays

NUM_CLIENTS = 36
NOISE = 1.0


@functools.lru_cache(maxsize=8)
def federation(seed: int, num_clients: int = NUM_CLIENTS, noise: float = NOISE):
    cfg = RotatedPrototypeConfig(num_clients=num_clients, noise_sigma=noise, seed=seed)
    return make_rotated_prototype_clients(cfg)


def _split(x: np.ndarray, y: np.ndarray) -> ArraySplit:
    return ArraySplit(torch.from_numpy(x), torch.from_numpy(y), torch.zeros(len(y), dtype=torch.long))


class _BatchedTensors(TensorDataset):
    """A TensorDataset that a DataLoader reads one batch at a time (``__getitems__``).

    The batches are exactly those of ``ArraySplit.loader`` (same sampler, same global-generator
    shuffle), without the per-sample indexing and stacking that dominate a softmax-regression
    client's time.
    """

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        index = torch.as_tensor(indices)
        return tuple(t[index] for t in self.tensors)


def _loader(x: np.ndarray, y: np.ndarray, batch_size: int, shuffle: bool) -> DataLoader:
    split = _split(x, y)
    dataset = _BatchedTensors(split.x, split.y, split.domain)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, collate_fn=lambda batch: batch)


@functools.lru_cache(maxsize=64)
def _experiment(items: tuple):
    """``parse_experiment`` once per run config (the ClientApp builds a client per message)."""
    return parse_experiment(dict(items))


def softmax_regression() -> EncoderHeadModel:
    model = EncoderHeadModel(nn.Flatten(), 784, 10)
    with torch.no_grad():  # N(0, 0.01^2), shared by all (the spec's initialisation)
        model.heads[0].weight.normal_(0.0, 0.01)
        model.heads[0].bias.zero_()
    return model


def make_client(context, hook=None, stride: int = 1, noise: float = NOISE):
    """The registered client on this federation's data; with ``stride`` s the federation is
    generated for ``s K`` clients and partition k holds generated client ``s k`` (the others are
    held out, e.g. as new clients for Algorithm 2)."""
    experiment = _experiment(tuple(sorted(context.run_config.items())))
    num_clients = int(context.run_config["num-clients"])
    clients = federation(int(context.run_config.get("seed", 0)), stride * num_clients, noise)
    pid = int(context.node_config["partition-id"])
    c = clients[stride * pid]
    seed_everything(experiment.run.seed)
    model = softmax_regression()
    data = LocalData(
        train=_loader(c.x_train, c.y_train, 64, shuffle=True),
        test=_loader(c.x_test, c.y_test, 512, shuffle=False),
        val=_loader(c.x_val, c.y_val, 512, shuffle=False),
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
    """The checkpoint's arrays, plus ``state_fedora_theta_hat`` as a resume rebuilds it (the
    checkpoint stores Theta and recomputes Theta_hat; see FEDORA.state_dict)."""
    from flwr_pfl.app.server_app import build_strategy, load_checkpoint

    path = tmp_path / name / "checkpoint.npz"
    with np.load(path, allow_pickle=False) as ckpt:
        arrays = {k: ckpt[k] for k in ckpt.files}
    if "state_fedora_theta" in arrays:
        strategy = build_strategy(parse_experiment(json.loads((tmp_path / name / "config.json").read_text())))
        load_checkpoint(strategy, path)
        arrays["state_fedora_theta_hat"] = strategy.theta_hat
    return arrays


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
                if kind == "complex":
                    return [np.full((794, 1), 1j, dtype=np.complex64)], 1, {"partition_id": pid}
            return original(parameters, config)

        client.fit = fit

    return hook


@pytest.mark.parametrize("kind", ["skip", "raise", "nan", "complex"])
def test_client_without_valid_setup_upload_trains_alone(tmp_path, kind):
    """No upload, a crash, a NaN or a complex subspace: the client is isolated (theta_hat_k = theta_k) and
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
        client.data = dataclasses.replace(client.data, train=_loader(zeros, c.y_train, 64, shuffle=True))


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
BENCHMARK = {"num-server-rounds": 15, "fedora.preset": "official", "fedora.val-metric": "error_rate",
             "fedora.eval-every": 15}


def benchmark(out_dir, seed: int = 0, fedavg_rounds: int = 5, **overrides) -> dict:
    """FEDORA (``BENCHMARK`` settings, then ``overrides``) and FedAvg on the K = 36 federation.

    Returns per-client accuracies (``fedora``, ``local`` = the in-run LOCAL shadow models on the
    same splits, ``fedavg``), FEDORA's last evaluation row and the fraction of client-rounds with
    an active proximal pull. To reproduce the figures quoted below, e.g. seed 1 or the official
    preset unchanged (cross-entropy Delta)::

        python -c "import sys, tempfile; sys.path.insert(0, 'tests/app'); import test_fedora_e2e as t;
        print(t.summary(t.benchmark(tempfile.mkdtemp(), seed=1, **{'fedora.val-metric': 'loss'})))"
    """
    out_dir = Path(out_dir)
    _, fedora, rows = run_synthetic(out_dir, "fedora", seed, **(BENCHMARK | overrides))
    _, fedavg, _ = run_synthetic(out_dir, "fedavg", seed, **{"num-server-rounds": fedavg_rounds})
    fits = [r for r in rows if r["phase"] == "fit"]
    return {
        "fedora": np.array([fedora[k]["accuracy"] for k in range(NUM_CLIENTS)]),
        "local": np.array([fedora[k]["local_accuracy"] for k in range(NUM_CLIENTS)]),
        "fedavg": np.array([fedavg[k]["accuracy"] for k in range(NUM_CLIENTS)]),
        "last": [r for r in rows if r["phase"] == "evaluate"][-1],
        "lambda_active": float(np.mean([r["lambda_active_mean"] for r in fits])),
    }


def summary(result: dict) -> str:
    """One line: mean accuracies, R-Acc and PTR of FEDORA and FedAvg against LOCAL."""
    acc, local, avg, last = result["fedora"], result["local"], result["fedavg"], result["last"]
    return (f"FEDORA {acc.mean():.4f} LOCAL {local.mean():.4f} R-Acc {last['r_acc']:+.4f} PTR {last['ptr']:.3f} "
            f"lambda active {result['lambda_active']:.3f}; FedAvg {avg.mean():.4f} "
            f"R-Acc {np.mean((avg - local) / local):+.4f}")


def test_synthetic_benchmark_relations(tmp_path):
    """Spec 7.4 through the real Strategy and NumPyClient: FEDORA above LOCAL, FedAvg far below.

    FEDORA runs the ``official`` preset (top-2 graph of exp(10 s), kappa = 0.8, lambda =
    exp(Delta / 2) or 0, post-step proximal correction) with one option changed: Delta compares
    validation *error rates* (``fedora.val-metric = "error_rate"``), the paper's "prediction
    error" (Eq. 8; spec 9.7), instead of the code's cross-entropy. With cross-entropy the
    propagated model, an average of differently rotated models with a smaller logit scale, had
    the higher validation loss in every round after the first although it was the more accurate
    one, so lambda stayed 0 and the official preset tied LOCAL: R-Acc -0.0001 / 0.0000 / 0.0000,
    lambda active only in round 1 (seeds 0 / 1 / 2).

    Measured with these settings (K = 36, noise 1.0, 15 rounds), seeds 0 / 1 / 2 / 3 / 4:
    FEDORA 0.787 / 0.855 / 0.830 / 0.873 / 0.787 vs LOCAL 0.764 / 0.837 / 0.812 / 0.846 / 0.753,
    R-Acc +0.031 / +0.021 / +0.022 / +0.033 / +0.045, PTR 1.00 / 0.97 / 0.97 / 0.97 / 1.00,
    lambda active in 61 / 47 / 48 / 70 / 70 % of client-rounds. FedAvg after 5 rounds: R-Acc
    -0.69 / -0.69 / -0.63 / -0.73 / -0.64 (spec 7.4: -0.566). Seeds 5 / 6 / 7: FEDORA 0.863 /
    0.871 / 0.882 vs LOCAL 0.843 / 0.845 / 0.853, R-Acc +0.024 / +0.030 / +0.034, PTR 0.97 /
    1.00 / 1.00, lambda active in 59 / 68 / 71 %, FedAvg R-Acc -0.70 / -0.71 / -0.70. Every
    assertion below holds on all eight seeds 0-7 (R-Acc min +0.021, PTR min 0.97, FedAvg R-Acc
    max -0.63); seed 0 runs here.
    """
    result = benchmark(tmp_path, seed=0)
    print("\n" + summary(result))
    acc, local, avg, last = result["fedora"], result["local"], result["fedavg"], result["last"]
    assert last["r_acc"] == pytest.approx(np.mean((acc - local) / local))
    assert last["ptr"] == pytest.approx(np.mean(acc >= local))
    assert acc.mean() > local.mean(), (acc.mean(), local.mean())
    assert last["r_acc"] > 0 and last["ptr"] >= 0.9, last
    assert np.mean((avg - local) / local) < -0.2  # FedAvg: strong negative transfer
    assert 0.0 < result["lambda_active"] < 1.0  # not degenerate LOCAL


# ------------------------------------------------------------------------------ Algorithm 2
def _accuracy(arrays, x: np.ndarray, y: np.ndarray) -> float:
    model = softmax_regression()
    set_arrays(model, arrays, "all")
    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def test_new_client_gets_the_one_hop_propagated_model(tmp_path):
    """Algorithm 2, unlabeled new client (spec 3.5): after training, a client that never took
    part uploads its feature-only subspace and receives ``theta_hat_new = sum_k P_new,k
    theta_hat_k`` (one hop from the new node, its similarity row through exp(10 s) and top-2),
    which it uses as its model. Its accuracy on its own test data beats the FedAvg model's, the
    relation the paper states for unlabeled new clients.

    The federation is generated for 24 clients (15 degree steps, noise 0.5); the 12 even ones
    train (30 degree steps) and the odd ones are the new clients, each halfway between two old
    ones. Feature-only subspaces (``fedora.use-labels = false``) for everyone, as Algorithm 2
    requires for unlabeled clients.
    """
    from flwr_pfl.app.config import parse_experiment as parse
    from flwr_pfl.app.server_app import build_strategy, load_checkpoint
    from flwr_pfl.core import fedora as core

    k_old, seed, noise = 12, 0, 0.5
    stride_app = ClientApp(client_fn=lambda context: make_client(context, stride=2, noise=noise).to_client())
    overrides = {"num-clients": k_old, "num-server-rounds": 5, "fedora.use-labels": False,
                 "fedora.local-baseline": False, "fedora.eval-every": 5}
    run_synthetic(tmp_path, "fedora", seed, client_app=stride_app, **overrides, **{"run-name": "old"})
    run_synthetic(tmp_path, "fedavg", seed, client_app=stride_app, **overrides, **{"run-name": "avg"})
    generated = federation(seed, 2 * k_old, noise)
    strategy = build_strategy(parse(synthetic_config(tmp_path, "fedora", seed, **overrides)))
    load_checkpoint(strategy, tmp_path / "old" / "checkpoint.npz")
    global_model = [checkpoint(tmp_path, "avg")[f"global_{i}"] for i in range(2)]
    options = core.SubspaceOptions(use_labels=False)
    old = [core.client_subspace(generated[2 * k].x_train, options=options) for k in range(k_old)]
    fedora_acc, fedavg_acc = [], []
    for new in (1, 7, 13, 19):  # 15, 105, 195, 285 degrees
        c = generated[new]
        u_new = core.client_subspace(c.x_train, options=options)
        arrays = strategy.new_client_model(u_new, old)
        # the same model from the definition: cosines to the old clients, their top 2, softmax of 10 s
        s = np.array([abs(float(u_new[:, 0] @ u[:, 0])) for u in old])
        top2 = np.argsort(-s)[:2]
        assert set(top2.tolist()) == {new // 2, (new // 2 + 1) % k_old}  # the two adjacent angles
        w = np.exp(10 * (s[top2] - s[top2].max()))
        expected = (w / w.sum()) @ strategy.theta_hat[top2].astype(np.float64)
        np.testing.assert_allclose(flat(arrays), expected, rtol=1e-5, atol=1e-6)
        fedora_acc.append(_accuracy(arrays, c.x_test, c.y_test))
        fedavg_acc.append(_accuracy(global_model, c.x_test, c.y_test))
    print(f"\nnew clients: FEDORA one-hop {np.round(fedora_acc, 3).tolist()}, FedAvg {np.round(fedavg_acc, 3).tolist()}")
    # run seeds 0-7 by hand: the top-2 neighbours are the adjacent angles on every seed; mean gap
    # FEDORA - FedAvg 0.496 (seed 2) .. 0.673 (seed 3); every new client better on every seed
    assert np.mean(fedora_acc) > np.mean(fedavg_acc) + 0.1, (fedora_acc, fedavg_acc)
    assert all(a > b for a, b in zip(fedora_acc, fedavg_acc)), (fedora_acc, fedavg_acc)
