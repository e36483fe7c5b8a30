"""FedGP / FedDA end to end through the real Strategy and NumPyClient, in one process (no Ray).

The data: 4 Gaussian classes in 20 dimensions, 4 domains whose class centres are shifted by a
domain-specific offset; client k holds domain k, so clients 0-2 are sources and client 3 (the last
partition, the default target) is the target, with only a few labelled training samples.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.server_app import app as server_app

from fakes import register_shift_dataset

NUM_CLIENTS = 4


@pytest.fixture(scope="session")
def shift_dataset() -> str:
    """'test-fda-shift': 4 classes x 4 domains, 500 samples per domain; domain m's class centres
    are the shared centres plus a fixed random offset (0.8 per coordinate; a covariate shift),
    with noise of std 2 around them."""
    return register_shift_dataset("test-fda-shift")


def fda_config(tmp_path, dataset, algorithm, name="run", seed=0, **overrides):
    prefix = algorithm + "."
    base = {
        "algorithm": algorithm,
        "dataset": dataset,
        "model": "mlp",
        "num-clients": NUM_CLIENTS,
        "num-server-rounds": 8,
        "learning-rate": 0.05,
        "momentum": 0.0,
        "batch-size": 32,
        "partitioner": "one-domain-per-client",
        "test-fraction": 0.5,
        "seed": seed,
        "output-dir": str(tmp_path),
        "run-name": name,
        f"{prefix}target-train-samples": 16,
        f"{prefix}target-batch-size": 4,
        f"{prefix}target-lr-ratio": 1.0,
    }
    if algorithm in ("fedgp", "fedda"):
        base[f"{prefix}warmup-rounds"] = 1
    return base | {(k if "." in k else k.replace("_", "-")): v for k, v in overrides.items()}


def rows(tmp_path, name="run", phase=None):
    out = json.loads((tmp_path / name / "metrics.json").read_text())
    return [r for r in out if phase is None or r["phase"] == phase]


def final_target_accuracy(tmp_path, name):
    return rows(tmp_path, name, "evaluate")[-1]["target_accuracy_last5"]


def test_auto_fedgp_beats_target_only_on_the_target(tmp_path, shift_dataset):
    """Measured over seeds 0-7 (8 rounds, last-5 mean on the target's test split): Target Only
    0.516-0.723, FedGP_Auto 0.758-0.844, gaps (FedGP_Auto - Target Only) 0.119 / 0.134 / 0.055 /
    0.119 / 0.140 / 0.212 / 0.328 / 0.120, min 0.055 (seed 2), max 0.328 (seed 6). Seeds 0 and
    1 run here; the margin asserted, 0.04, lies below the smallest gap of all eight seeds (a
    margin of 0.06, half the smaller gap of seeds 0-1, would fail at seed 2)."""
    gaps = []
    for seed in (0, 1):
        for algorithm in ("target-only", "fedgp"):
            extra = {"fedgp.auto-weight": True} if algorithm == "fedgp" else {}
            run_inprocess(server_app, client_app, NUM_CLIENTS,
                          fda_config(tmp_path, shift_dataset, algorithm, f"{algorithm}-{seed}", seed, **extra))
        gaps.append(final_target_accuracy(tmp_path, f"fedgp-{seed}") - final_target_accuracy(tmp_path, f"target-only-{seed}"))
    assert min(gaps) > 0.04, gaps
    fits = [r for r in rows(tmp_path, "fedgp-0", "fit") if r.get("fda_round", 0) > 0]
    assert fits and all(0.0 <= r["beta_mean"] <= 1.0 for r in fits)
    assert all("sigma2" in r and "tau2d2_p0" in r and "beta_p2" in r for r in fits)
    last = rows(tmp_path, "fedgp-0", "evaluate")[-1]
    # evaluation is the target's test split, with the sources' own domains reported beside it
    assert "source_accuracy_wmean" in last and last["target_accuracy"] == pytest.approx(last["acc_d3"])


def _target_context(grid):
    return next(c for c in grid.contexts.values() if int(c.node_config["partition-id"]) == NUM_CLIENTS - 1)


def _global_arrays(tmp_path, name):
    with np.load(tmp_path / name / "checkpoint.npz") as ckpt:
        keys = sorted((k for k in ckpt.files if k.startswith("global_")), key=lambda k: int(k.split("_")[1]))
        return [ckpt[k] for k in keys]


def test_global_model_is_the_target_model_and_target_bytes(tmp_path, shift_dataset):
    """The global model is the target's model: the reported target accuracy and loss are those of
    the final global model on the target's own test split (no personal part anywhere), and with
    beta = 0 (no warm-up) the global model is exactly the model the target trains, i.e. Target
    Only's. The target returns the model plus B x m float32 step updates in auto mode (4 B m
    bytes more than with a fixed beta); FedDA's summary upload adds nothing."""
    from flwr_pfl.app.client_app import build_client

    received, grids = {}, {}
    for name, algorithm, extra in (
        ("fixed", "fedgp", {}),
        ("auto", "fedgp", {"fedgp.auto-weight": True}),
        ("fedda-summary", "fedda", {"fedda.auto-weight": True}),
        ("fedda-matrix", "fedda", {"fedda.auto-weight": True, "fedda.step-upload": "matrix"}),
    ):
        grid = run_inprocess(server_app, client_app, NUM_CLIENTS,
                             fda_config(tmp_path, shift_dataset, algorithm, name, num_server_rounds=3, **extra))
        received[name], grids[name] = grid.bytes_received, grid
    for name in ("fixed", "auto", "fedda-summary"):
        last = rows(tmp_path, name, "evaluate")[-1]
        target = build_client(_target_context(grids[name]))
        loss, _, metrics = target.evaluate(_global_arrays(tmp_path, name), {"server-round": 3})
        assert metrics["is_target"] == 1
        assert last["target_accuracy"] == pytest.approx(metrics["accuracy"], abs=1e-12)
        assert last["target_loss"] == pytest.approx(loss, rel=1e-6)
    # beta = 0: the sources train but contribute nothing; the global model is the target's
    for name, algorithm, extra in (("beta0", "fedgp", {"fedgp.beta": 0.0, "fedgp.warmup-rounds": 0}),
                                   ("target-only", "target-only", {})):
        run_inprocess(server_app, client_app, NUM_CLIENTS,
                      fda_config(tmp_path, shift_dataset, algorithm, name, num_server_rounds=2, **extra))
    beta0, alone = _global_arrays(tmp_path, "beta0"), _global_arrays(tmp_path, "target-only")
    assert len(beta0) == len(alone) > 0
    for a, b in zip(beta0, alone):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with np.load(tmp_path / "fixed" / "checkpoint.npz") as ckpt:
        m = sum(ckpt[k].size for k in ckpt.files if k.startswith("global_"))  # the MLP: no buffers
    steps = 16 // 4  # target-train-samples / target-batch-size, one epoch
    fda_rounds = 2  # 3 rounds, 1 warm-up
    extra_bytes = received["auto"] - received["fixed"]
    payload = fda_rounds * 4 * steps * m  # float32 B x m per FDA round
    assert 0 <= extra_bytes - payload <= fda_rounds * 256  # plus one .npy header per array
    assert received["fedda-summary"] == received["fixed"]
    assert received["fedda-matrix"] - received["fedda-summary"] == extra_bytes


def test_source_only_and_fedda_beta_one_agree(tmp_path, shift_dataset):
    """Source Only = FedDA with beta = 1 (spec 9 #25) on a model without buffers."""
    run_inprocess(server_app, client_app, NUM_CLIENTS, fda_config(tmp_path, shift_dataset, "source-only", "so", num_server_rounds=3))
    run_inprocess(server_app, client_app, NUM_CLIENTS,
                  fda_config(tmp_path, shift_dataset, "fedda", "b1", num_server_rounds=3, **{"fedda.beta": 1.0}))
    a = np.load(tmp_path / "so" / "checkpoint.npz")
    b = np.load(tmp_path / "b1" / "checkpoint.npz")
    for key in a.files:
        if key.startswith("global_"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("auto", [False, True], ids=["fixed-beta", "auto-beta"])
def test_target_placement_computes_the_server_placement_model(tmp_path, shift_dataset, auto):
    """App. C.1 / C.4: the target aggregates. With the same seeds both placements train the
    same models, so after 3 FDA rounds (W = 1) the global models agree up to the order of a
    float sum (the sources reach the target shuffled); the target placement takes 1 + 2 x 3
    server rounds, evaluates only after the target's half-rounds, and records every source's
    beta under its partition id."""
    extra = {"fedgp.auto-weight": auto, "fedgp.target-batch-size": 2}
    run_inprocess(server_app, client_app, NUM_CLIENTS,
                  fda_config(tmp_path, shift_dataset, "fedgp", "server", num_server_rounds=4, **extra))
    grid = run_inprocess(server_app, client_app, NUM_CLIENTS,
                         fda_config(tmp_path, shift_dataset, "fedgp", "target", num_server_rounds=7,
                                    **extra, **{"fedgp.placement": "target"}))
    a = np.load(tmp_path / "server" / "checkpoint.npz")
    b = np.load(tmp_path / "target" / "checkpoint.npz")
    keys = [k for k in a.files if k.startswith("global_")]
    assert keys
    for key in keys:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6)
    evals = rows(tmp_path, "target", "evaluate")
    assert [r["round"] for r in evals] == [1, 3, 5, 7]
    server_evals = rows(tmp_path, "server", "evaluate")
    assert [r["target_accuracy"] for r in evals] == pytest.approx([r["target_accuracy"] for r in server_evals], abs=1e-6)
    fits = {r["round"]: r for r in rows(tmp_path, "target", "fit")}
    server_fits = {r["round"]: r for r in rows(tmp_path, "server", "fit")}
    for k in (1, 2, 3):
        t, s = fits[1 + 2 * k], server_fits[1 + k]
        assert t["fda_round"] == s["fda_round"] == k
        for pid in (0, 1, 2):
            assert t[f"beta_p{pid}"] == pytest.approx(s[f"beta_p{pid}"], rel=1e-6)
            assert t[f"mean_cos_p{pid}"] == pytest.approx(s[f"mean_cos_p{pid}"], rel=1e-4, abs=1e-6)
        if auto:
            assert t["sigma2"] == pytest.approx(s["sigma2"], rel=1e-6)
            assert t["sigma2"] > 0.0 and 0.0 <= t["beta_mean"] <= 1.0
    assert grid.bytes_received > 0


def test_target_placement_moves_the_step_upload_to_a_download(tmp_path, shift_dataset):
    """Auto FedGP, per FDA round: the server placement receives the target's B x m float32
    step updates; the target placement receives none but sends the target the 3 sources'
    models (3 x m float32) once more."""
    sent, received = {}, {}
    for placement, rounds in (("server", 3), ("target", 5)):
        grid = run_inprocess(server_app, client_app, NUM_CLIENTS, fda_config(
            tmp_path, shift_dataset, "fedgp", placement, num_server_rounds=rounds,
            **{"fedgp.auto-weight": True, "fedgp.placement": placement}))
        sent[placement], received[placement] = grid.bytes_sent, grid.bytes_received
    with np.load(tmp_path / "server" / "checkpoint.npz") as ckpt:
        m = sum(ckpt[k].size for k in ckpt.files if k.startswith("global_"))
    steps, fda_rounds, header = 16 // 4, 2, 256
    # server placement: every client receives the model each round; target placement: the
    # target is not sent the model in the sources' half-round but gets model + 3 source models
    assert abs((received["server"] - received["target"]) - fda_rounds * 4 * steps * m) <= fda_rounds * 4 * header
    assert abs((sent["target"] - sent["server"]) - fda_rounds * 3 * 4 * m) <= fda_rounds * 16 * header
