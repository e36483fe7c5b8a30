"""FedGP / FedDA's NumPyClient and Strategy message by message, against closed forms.

Client: a Linear(5, 4) + tanh body and a 3-class head (no buffers, so every tensor is aggregated);
sources train on two unshuffled batches, the target on its whole split in one batch per step, so
that a round is replayed by a hand-written SGD loop. Checked: the learning rate (run lr x the
server's lr-scale, x target-lr-ratio for the target), who trains in which round, the target's
per-step updates (parameters after step j minus after step j - 1; grouped to max-step-updates
rows), the one-float summary S_T, and the target-placement aggregation.

Strategy: fake replies of sources with unequal sizes, step counts and learning rates: warm-up is
FedAvg over the sources by sample count; an FDA round is h + sum_i w_i [(1 - beta) Delta_T +
beta P_i] with FedDA's P_i = Delta_i and FedGP's per-tensor cosine-scaled projection (App. C.9)
written out here; the auto-weighted rounds equal the core's ``fda_round`` on the same inputs
(step matrix or summary); the instructions carry the schedule; under the target placement the
sources' statistics come back under their partition ids.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Context, RecordDict
from flwr.common import Parameters, ndarrays_to_parameters, parameters_to_ndarrays
from torch.utils.data import DataLoader, TensorDataset

from flwr_pfl.clients import FedGPClient
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.core.fedgp import (
    FDAConfig,
    SourceUpdate,
    TargetUpdate,
    fda_round,
    model_delta,
    summarize_step_updates,
    tensor_roles,
)
from flwr_pfl.strategies import FedDA, FedGP
from flwr_pfl.strategies.fedgp import TargetOnly
from flwr_pfl.training import OptimizerConfig, get_arrays, set_arrays

from fakes import FakeProxy, arrays_of, fit_res, load_test_module, register_shift_dataset, tiny_model
from fakes import assert_arrays_close as close

LR = 0.4
BATCH = 6
N_TARGET = 8


def flat(arrays) -> np.ndarray:
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])


G = torch.Generator().manual_seed(5)
X_SRC, Y_SRC = torch.randn(12, 5, generator=G), torch.randint(0, 3, (12,), generator=G)
X_TGT, Y_TGT = torch.randn(N_TARGET, 5, generator=G), torch.randint(0, 3, (N_TARGET,), generator=G)


def make_client(pid: int, epochs: int = 3, ratio: float = 0.5) -> FedGPClient:
    """Partition 3 is the target (the last of 4); the target trains full batch."""
    x, y = (X_TGT, Y_TGT) if pid == 3 else (X_SRC, Y_SRC)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    context = Context(run_id=1, node_id=1, node_config={"partition-id": pid, "num-partitions": 4},
                      state=RecordDict(), run_config={})
    config = TrainConfig(local_epochs=epochs, batch_size=BATCH, optimizer=OptimizerConfig("sgd", LR), device="cpu")
    return FedGPClient(context, tiny_model(99), LocalData(train=loader, test=loader), config,
                       target_partition=3, target_lr_ratio=ratio, target_batch_size=N_TARGET)


def reference(start, lr: float, epochs: int, target: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """SGD from ``start`` (the target: full batch; a source: its two batches in order); returns
    the final arrays and the flattened parameters after every step."""
    x, y = (X_TGT, Y_TGT) if target else (X_SRC, Y_SRC)
    bs = N_TARGET if target else BATCH
    model = tiny_model()
    set_arrays(model, start)
    params = list(model.parameters())
    trajectory = [flat(get_arrays(model))]
    for _ in range(epochs):
        for b in range(0, len(y), bs):
            loss = F.cross_entropy(model(x[b:b + bs]), y[b:b + bs])
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p -= lr * g
            trajectory.append(flat(get_arrays(model)))
    return get_arrays(model), trajectory


def fda_instructions(**overrides) -> dict:
    base = {"server-round": 4, "fedgp.phase": "fda", "fedgp.stage": "all", "fedgp.seed-round": 4,
            "fedgp.lr-scale": 0.3, "fedgp.sources-train": True, "fedgp.target-trains": True,
            "fedgp.record-steps": True, "fedgp.step-upload": "matrix", "fedgp.buffer-role": "fedavg",
            "fedgp.scalar-role": "fedavg", "fedgp.max-step-updates": 0}
    return base | overrides


# ------------------------------------------------------------------------------ client
def test_source_trains_with_the_scaled_learning_rate():
    glob = arrays_of(1)
    arrays, n, metrics = make_client(0).fit(glob, fda_instructions())
    expected, _ = reference(glob, LR * 0.3, 3, target=False)
    close(arrays, expected)
    assert n == 12 and metrics["is_target"] == 0 and metrics["num_steps"] == 6
    assert metrics["lr"] == pytest.approx(LR * 0.3)
    assert metrics["buffer_mask"] == "0000"


@pytest.mark.parametrize("max_rows", [0, 2])
def test_target_records_each_steps_own_update(max_rows):
    """Auto mode: the target trains at lr x lr-scale x target-lr-ratio and uploads, after its
    model, the B x m matrix of per-step updates g^j = theta_j - theta_(j-1) (Algorithm 1 step
    4), consecutive steps averaged into max-step-updates rows when set; the rows telescope to
    the round's update."""
    glob = arrays_of(2)
    arrays, n, metrics = make_client(3, epochs=4).fit(glob, fda_instructions(**{"fedgp.max-step-updates": max_rows}))
    lr = LR * 0.3 * 0.5
    expected, trajectory = reference(glob, lr, 4, target=True)
    assert metrics["is_target"] == 1 and metrics["num_steps"] == 4 and n == N_TARGET
    assert metrics["lr"] == pytest.approx(lr)
    close(arrays[:4], expected)
    steps = np.diff(np.stack(trajectory), axis=0)  # (4, m)
    if max_rows:
        steps = np.stack([steps[:2].mean(0), steps[2:].mean(0)])
    g = arrays[4]
    assert g.dtype == np.float32 and g.shape == steps.shape
    np.testing.assert_allclose(g, steps, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(g.sum(0) * (2 if max_rows else 1), flat(expected) - flat(glob), rtol=1e-4, atol=1e-6)


def test_target_summary_upload_is_the_sample_variance():
    """FedDA's one-float upload: step_var = S_T = sum_j ||g^j - g_bar||^2 / ((B - 1) m) of the
    per-step updates, step_rows = B; no extra array."""
    glob = arrays_of(3)
    arrays, _, metrics = make_client(3, epochs=4).fit(glob, fda_instructions(**{"fedgp.step-upload": "summary"}))
    _, trajectory = reference(glob, LR * 0.3 * 0.5, 4, target=True)
    steps = np.diff(np.stack(trajectory), axis=0)
    centred = steps - steps.mean(0)
    expected = float((centred ** 2).sum() / ((len(steps) - 1) * steps.shape[1]))
    assert len(arrays) == 4 and metrics["step_rows"] == 4
    assert metrics["step_var"] == pytest.approx(expected, rel=1e-4)


def test_who_trains_in_warm_up_and_in_target_only():
    """Warm-up: the sources train, the target replies with nothing (skipped); Target Only: the
    sources are skipped."""
    glob = arrays_of(4)
    warmup = fda_instructions(**{"fedgp.phase": "warmup", "fedgp.target-trains": False, "fedgp.record-steps": False,
                                 "fedgp.lr-scale": 1.0})
    arrays, _, metrics = make_client(3).fit(glob, warmup)
    assert arrays == [] and metrics["skipped"] == 1
    arrays, _, metrics = make_client(0).fit(glob, warmup)
    assert len(arrays) == 4 and "skipped" not in metrics
    target_only = fda_instructions(**{"fedgp.sources-train": False, "fedgp.record-steps": False})
    arrays, _, metrics = make_client(0).fit(glob, target_only)
    assert arrays == [] and metrics["skipped"] == 1


def test_target_placement_aggregates_like_the_server():
    """Stage ``target``: the target receives the global model and the sources' models (with
    their n, lr and steps), trains, and returns fda_round of its own update and step matrix and
    the sources' updates."""
    glob = arrays_of(5)
    sources = [arrays_of(30 + i) for i in range(3)]
    meta = [{"n": 10, "lr": 0.2, "steps": 2}, {"n": 40, "lr": 0.1, "steps": 5}, {"n": 25, "lr": 0.1, "steps": 9}]
    cfg = FDAConfig(rule="fedgp", auto_weight=True, warmup_rounds=1, placement="target")
    config = fda_instructions(**{"fedgp.stage": "target", "fedgp.sources": json.dumps(meta)},
                              **{f"fedgp.cfg.{k}": v for k, v in cfg.to_scalars().items()})
    payload = glob + [a for s in sources for a in s]
    arrays, _, metrics = make_client(3, epochs=4).fit(payload, config)
    lr = LR * 0.3 * 0.5
    trained, trajectory = reference(glob, lr, 4, target=True)
    steps = np.diff(np.stack(trajectory), axis=0).astype(np.float32)
    roles = tensor_roles(glob, cfg, [False] * 4)
    expected = fda_round(
        glob, TargetUpdate(model_delta(trained, glob), lr=lr, steps=4, step_matrix=steps),
        [SourceUpdate(model_delta(s, glob), m["n"], m["lr"], m["steps"]) for s, m in zip(sources, meta)], cfg, roles)
    close(arrays, expected.new_global, atol=1e-5)
    for j in range(3):
        assert metrics[f"fda.beta_s{j}"] == pytest.approx(float(expected.aggregate.betas[j]), rel=1e-3, abs=1e-6)
    assert len(set(np.round(expected.aggregate.betas, 6))) == 3  # the sources are told apart


# ------------------------------------------------------------------------------ strategy
GLOBAL = arrays_of(0)
SOURCES = {0: (10, 2, 0.1), 1: (40, 5, 0.1), 2: (25, 9, 0.1)}  # pid: (n_i, K_i, lr_S)
TARGET = (3, N_TARGET, 4, 0.02)  # pid, n_T, B, lr_T


def source_uploads() -> dict[int, list[np.ndarray]]:
    return {pid: arrays_of(10 + pid) for pid in SOURCES}


def target_upload() -> list[np.ndarray]:
    # a target update correlated with source 0 and opposed to source 1 on some tensors
    up = source_uploads()
    return [g + 0.5 * (a - g) - 0.3 * (b - g) + 0.05 * c for g, a, b, c in zip(GLOBAL, up[0], up[1], arrays_of(77))]


def step_matrix(rows: int = 4) -> np.ndarray:
    rng = np.random.default_rng(0)
    delta = flat(target_upload()) - flat(GLOBAL)
    g = delta / rows + 0.02 * rng.standard_normal((rows, delta.size))
    return g.astype(np.float32)


def replies(*, warmup: bool = False, extra: list[np.ndarray] | None = None, target_metrics: dict | None = None):
    out = []
    for pid, (n, k, lr) in SOURCES.items():
        metrics = {"partition_id": pid, "is_target": 0, "num_steps": k, "lr": lr, "buffer_mask": "0000"}
        out.append((FakeProxy(f"c{pid}"), fit_res(source_uploads()[pid], n, metrics=metrics)))
    pid, n, b, lr = TARGET
    if warmup:
        metrics, arrays = {"partition_id": pid, "is_target": 1, "skipped": 1}, []
    else:
        metrics = {"partition_id": pid, "is_target": 1, "num_steps": b, "lr": lr, "n_model_arrays": 4} | (target_metrics or {})
        arrays = target_upload() + (extra or [])
    out.append((FakeProxy(f"c{pid}"), fit_res(arrays, n, metrics=metrics)))
    return out


def run_round(strategy, server_round: int, **kwargs):
    """Instructions (the strategy records what it asked for), then the replies' aggregation;
    returns the new global arrays and the round's fit metrics."""
    recorded = {}
    strategy.on_round = lambda r, phase, metrics, clients: recorded.update(metrics) if phase == "fit" else None
    params = ndarrays_to_parameters(strategy.global_arrays)
    ins = strategy.fit_instructions(server_round, params, [FakeProxy(f"c{p}") for p in (0, 1, 2, 3)])
    strategy.aggregate_fit(server_round, replies(**kwargs), [])
    return strategy.global_arrays, recorded, {p.cid: i.config for p, i in ins}


def make(cls, **config):
    base = {"rule": "fedgp" if cls is FedGP else "fedda", "warmup_rounds": 1}
    return cls(num_clients=4, config=FDAConfig(**(base | config)), initial_arrays=[a.copy() for a in GLOBAL])


def deltas():
    up = source_uploads()
    return [flat(up[p]) - flat(GLOBAL) for p in SOURCES], flat(target_upload()) - flat(GLOBAL)


def weights() -> np.ndarray:
    n = np.array([SOURCES[p][0] for p in SOURCES], dtype=np.float64)
    return n / n.sum()


def test_warm_up_is_fedavg_over_the_sources_by_sample_count():
    new, metrics, config = run_round(make(FedGP), 1, warmup=True)
    expected = flat(GLOBAL) + sum(w * d for w, d in zip(weights(), deltas()[0]))
    np.testing.assert_allclose(flat(new), expected, atol=1e-6)
    assert config["c3"]["fedgp.target-trains"] is False and config["c0"]["fedgp.sources-train"] is True
    assert metrics["num_sources"] == 3.0


def test_fedda_round_is_the_convex_combination():
    """Definition 4.1: h + (1 - beta) Delta_T + beta sum_i w_i Delta_i with w_i = n_i / sum n."""
    beta = 0.3
    new, metrics, _ = run_round(make(FedDA, beta=beta), 2)
    d_src, d_t = deltas()
    expected = flat(GLOBAL) + (1 - beta) * d_t + beta * sum(w * d for w, d in zip(weights(), d_src))
    np.testing.assert_allclose(flat(new), expected, atol=1e-6)
    assert metrics["beta_p1"] == pytest.approx(beta)


def test_fedgp_round_projects_each_tensor_onto_the_target_update():
    """App. C.9, per tensor l: source i contributes 1[c > 0] c a_i Delta_i^l with c =
    cos(Delta_T^l, Delta_i^l) and a_i = (lr_T / lr_S,i)(B / K_i); the target keeps (1 - beta)
    Delta_T^l; every term weighted by w_i = n_i / sum n."""
    beta = 0.6
    new, metrics, _ = run_round(make(FedGP, beta=beta), 2)
    up = source_uploads()
    _, n_t, b, lr_t = TARGET
    w = weights()
    expected, filtered = [], 0
    for l, g in enumerate(GLOBAL):
        dt = target_upload()[l].astype(np.float64) - g
        acc = (1 - beta) * dt
        for i, (pid, (n, k, lr)) in enumerate(SOURCES.items()):
            ds = up[pid][l].astype(np.float64) - g
            c = float((dt * ds).sum() / (np.linalg.norm(dt) * np.linalg.norm(ds)))
            a = (lr_t / lr) * (b / k)
            if c > 0:
                acc = acc + w[i] * beta * c * a * ds
            else:
                filtered += 1
        expected.append(g + acc)
    assert 0 < filtered < 3 * len(GLOBAL)  # some components are filtered out, some are not
    close(new, expected, atol=1e-6)


@pytest.mark.parametrize("rule,upload", [("fedgp", "matrix"), ("fedda", "matrix"), ("fedda", "summary")])
def test_auto_weighted_round_uses_the_targets_step_statistics(rule, upload):
    """Auto mode: beta_i from the App. A.5 estimators on the target's step matrix (or, FedDA, its
    one-float summary): the result is the core's fda_round on the same inputs, and the betas
    differ from the fixed fallback."""
    cls = FedGP if rule == "fedgp" else FedDA
    strategy = cls(num_clients=4, config=FDAConfig(rule=rule, auto_weight=True, warmup_rounds=1),
                   initial_arrays=[a.copy() for a in GLOBAL], step_upload=upload)
    g = step_matrix()
    if upload == "matrix":
        new, metrics, config = run_round(strategy, 2, extra=[g])
        target = TargetUpdate(model_delta(target_upload(), GLOBAL), lr=TARGET[3], steps=TARGET[2], step_matrix=g)
    else:
        s_t = float(summarize_step_updates(g).sample_target_var)
        new, metrics, config = run_round(strategy, 2, target_metrics={"step_var": s_t, "step_rows": 4})
        target = TargetUpdate(model_delta(target_upload(), GLOBAL), lr=TARGET[3], steps=TARGET[2], step_var=s_t, step_rows=4)
    assert config["c3"]["fedgp.record-steps"] is True
    up = source_uploads()
    sources = [SourceUpdate(model_delta(up[p], GLOBAL), n, lr, k) for p, (n, k, lr) in SOURCES.items()]
    expected = fda_round(GLOBAL, target, sources, strategy.config, tensor_roles(GLOBAL, strategy.config, [False] * 4))
    close(new, expected.new_global)
    betas = [metrics[f"beta_p{p}"] for p in SOURCES]
    np.testing.assert_allclose(betas, expected.aggregate.betas, rtol=1e-9)
    assert expected.stats is not None and not np.allclose(betas, strategy.config.beta)


def test_instructions_follow_the_schedule():
    """Warm-up rounds at lr-scale 1, FDA rounds at lr_decay_after_warmup; steps are recorded only
    in auto FDA rounds; Target Only keeps the sources idle."""
    strategy = make(FedGP, auto_weight=True, lr_decay_after_warmup=0.1, max_step_updates=3)
    params = Parameters(tensors=[], tensor_type="numpy.ndarray")
    proxies = [FakeProxy("c0"), FakeProxy("c3")]
    first = strategy.fit_instructions(1, params, proxies)[0][1].config
    second = strategy.fit_instructions(2, params, proxies)[0][1].config
    assert (first["fedgp.lr-scale"], second["fedgp.lr-scale"]) == (1.0, pytest.approx(0.1))
    assert (first["fedgp.record-steps"], second["fedgp.record-steps"]) == (False, True)
    assert second["fedgp.max-step-updates"] == 3
    assert (first["fedgp.target-trains"], second["fedgp.target-trains"]) == (False, True)
    only = TargetOnly(num_clients=4, initial_arrays=GLOBAL).fit_instructions(2, params, proxies)[0][1].config
    assert only["fedgp.sources-train"] is False and only["fedgp.target-trains"] is True


def test_target_placement_forwards_the_sources_and_maps_their_statistics_back():
    """Target placement, FDA round 1 = server rounds 2 (sources) and 3 (target): the sources'
    models are forwarded to the target in a shuffled order with matching n / lr / steps, and the
    target's per-position statistics ``fda.<name>_s<j>`` are recorded under the partition ids."""
    pids = {0: 4, 1: 5, 2: 6}  # partition ids that differ from any position
    strategy = FedGP(num_clients=8, config=FDAConfig(rule="fedgp", warmup_rounds=1, placement="target"),
                     initial_arrays=[a.copy() for a in GLOBAL])
    params = ndarrays_to_parameters(GLOBAL)
    up = source_uploads()
    strategy.fit_instructions(1, params, [FakeProxy(f"c{p}") for p in (0, 1, 2, 3)])
    warmup = replies(warmup=True)
    for proxy, res in warmup[: len(SOURCES)]:  # each node keeps its partition id for the whole run
        res.metrics["partition_id"] = pids[int(proxy.cid[1:])]
    strategy.aggregate_fit(1, warmup, [])  # warm-up: the server learns who the target is
    strategy.global_arrays = [a.copy() for a in GLOBAL]
    strategy.fit_instructions(2, params, [FakeProxy(f"c{p}") for p in SOURCES])
    results = []
    for p, (n, k, lr) in SOURCES.items():
        metrics = {"partition_id": pids[p], "is_target": 0, "num_steps": k, "lr": lr}
        results.append((FakeProxy(f"c{p}"), fit_res(up[p], n, metrics=metrics)))
    strategy.aggregate_fit(2, results, [])
    close(strategy.global_arrays, GLOBAL, atol=0)  # unchanged until the target aggregates
    ins = strategy.fit_instructions(3, params, [FakeProxy("c3")])[0][1]
    arrays = parameters_to_ndarrays(ins.parameters)
    meta = json.loads(ins.config["fedgp.sources"])
    close(arrays[:4], GLOBAL, atol=0)
    order = []
    for j, m in enumerate(meta):
        block = arrays[4 + 4 * j: 8 + 4 * j]
        p = next(p for p in SOURCES if np.array_equal(flat(block), flat(up[p])))
        order.append(p)
        assert (m["n"], m["steps"], m["lr"]) == (SOURCES[p][0], SOURCES[p][1], SOURCES[p][2])
    assert sorted(order) == [0, 1, 2]
    recorded = {}
    strategy.on_round = lambda r, phase, metrics, clients: recorded.update(metrics) if phase == "fit" else None
    new_global = arrays_of(55)
    target_metrics = {"partition_id": TARGET[0], "is_target": 1, "num_steps": 4, "lr": 0.02}
    target_metrics |= {f"fda.beta_s{j}": 0.1 * (j + 1) for j in range(3)}
    res = fit_res(new_global, N_TARGET, metrics=target_metrics)
    strategy.aggregate_fit(3, [(FakeProxy("c3"), res)], [])
    close(strategy.global_arrays, new_global, atol=0)  # the target's reply is the new global model
    for j, p in enumerate(order):
        assert recorded[f"beta_p{pids[p]}"] == pytest.approx(0.1 * (j + 1))


# ------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def conflict_dataset() -> str:
    """'test-fda-conflict': the covariate-shift data of tests/app/test_fedgp_e2e.py (4 classes x
    4 domains, 500 samples each), but the sources (domains 0-2) label class c as (c + 1) mod 4:
    their updates pull the shared head toward a labelling the target (domain 3) contradicts."""
    return register_shift_dataset("test-fda-conflict", sources_relabelled=True)


def test_fedgp_filters_the_conflicting_sources_that_fedda_averages_in(tmp_path, conflict_dataset):
    """End to end (in process, the registered app, fixed beta = 0.5, 1 warm-up round, 8 rounds):
    with sources whose labels contradict the target's, FedDA's convex combination keeps adding
    their updates and the target's accuracy stays near chance, while FedGP keeps only the source
    components that agree in direction with the target's update (App. C.9 filter) and recovers.

    Measured over seeds 0-7 (last-5 mean of the target's test accuracy): FedGP 0.430-0.603,
    FedDA 0.214-0.292, gap (FedGP - FedDA) 0.232 / 0.333 / 0.242 / 0.291 / 0.321 / 0.276 /
    0.156 / 0.257, min 0.156 (seed 6), max 0.333 (seed 1). Seeds 0 and 1 run here, with the
    margin 0.08, half the smallest gap. FedGP filters some source components in every FDA round
    (smallest per-round filtered fraction 0.39 over the eight seeds). (Target Only reaches 0.516-0.723 here: with such sources
    neither method beats it; the test tells the two rules apart.)"""
    from flwr_pfl.app.client_app import app as client_app
    from flwr_pfl.app.inprocess import run_inprocess
    from flwr_pfl.app.server_app import app as server_app

    e2e = load_test_module("app/test_fedgp_e2e.py", "_fedgp_e2e_helpers")
    for seed in (0, 1):
        acc = {}
        for algorithm in ("fedgp", "fedda"):
            name = f"{algorithm}-{seed}"
            run_inprocess(server_app, client_app, 4, e2e.fda_config(tmp_path, conflict_dataset, algorithm, name, seed))
            acc[algorithm] = e2e.final_target_accuracy(tmp_path, name)
        assert acc["fedgp"] - acc["fedda"] > 0.08, acc
        fits = [r for r in e2e.rows(tmp_path, f"fedgp-{seed}", "fit") if r.get("fda_round", 0) > 0]
        assert fits and all(r["filtered_frac_mean"] > 0 for r in fits)  # the filter is at work
