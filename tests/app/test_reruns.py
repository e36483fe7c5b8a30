"""Identical reruns: the same config and seed give bit-identical results, for every algorithm.

Every registered algorithm runs twice with partial participation (a different subset of the
clients trains, and is evaluated, in each round) and the two runs' ``metrics.json`` and
``clients.json`` must be equal byte for byte. On the in-process engine the clients run one at a
time in threads whose order varies, so this also checks that no client's randomness leaks into
the server's sampling or into another client, and that replies are summed in an order that does
not depend on which client finished first.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from fakes import register_domain_blobs
from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.inprocess import InProcessGrid, run_inprocess
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.clients.base import PFLClient
from flwr_pfl.strategies.sampling import in_partition_order, sample_indices, sampling_rng

NUM_CLIENTS = 6


@pytest.fixture(scope="module")
def domain_dataset() -> str:
    """'test-rerun-domains': 4 classes x 3 domains (a covariate shift per domain), 1,440 samples."""
    return register_domain_blobs("test-rerun-domains", seed=99, center_scale=1.5)


#: per-algorithm settings on top of :func:`base_config` (what each algorithm needs to run)
EXTRA: dict[str, dict] = {
    "fmtl": {"partitioner": "pathological", "classes-per-client": 2, "fmtl.t1-rounds": 2},
    "pfedfda": {"pfedfda.eval-every": 1},
    "feddar": {"partitioner": "domain-mixture", "domain-alpha": 0.5, "samples-per-client": 120, "feddar.head-epochs": 1},
    "feddar-sa": {"partitioner": "domain-mixture", "domain-alpha": 0.5, "samples-per-client": 120, "feddar.head-epochs": 1},
    "feddar-wa": {"partitioner": "domain-mixture", "domain-alpha": 0.5, "samples-per-client": 120, "feddar.head-epochs": 1},
    "separate-fedavg": {"partitioner": "domain-mixture", "domain-alpha": 0.5, "samples-per-client": 120},
    "fedavg-rw": {"partitioner": "domain-mixture", "domain-alpha": 0.5, "samples-per-client": 120},
    "fedavg-mh": {"partitioner": "domain-mixture", "domain-alpha": 0.5, "samples-per-client": 120},
}
FDA = ("fedgp", "fedda", "target-only", "source-only")


def base_config(tmp_path, dataset: str, algorithm: str, name: str, **overrides) -> dict:
    cfg = {
        "algorithm": algorithm,
        "dataset": dataset,
        "model": "mlp",
        "num-clients": NUM_CLIENTS,
        "num-server-rounds": 4,
        "fraction-fit": 0.5,
        "fraction-evaluate": 0.5,
        "learning-rate": 0.05,
        "batch-size": 16,
        "partitioner": "iid",
        "test-fraction": 0.25,
        "seed": 3,
        "output-dir": str(tmp_path),
        "run-name": name,
    }
    if algorithm in FDA:
        prefix = algorithm + "."
        cfg |= {
            "partitioner": "one-domain-per-client", "num-clients": 3, "fraction-fit": 1.0,
            f"{prefix}target-train-samples": 16, f"{prefix}target-batch-size": 4,
        }
        if algorithm in ("fedgp", "fedda"):
            cfg |= {f"{prefix}warmup-rounds": 1, f"{prefix}auto-weight": True}
    return cfg | EXTRA.get(algorithm, {}) | overrides


def run_files(tmp_path, cfg: dict) -> dict[str, bytes]:
    run_inprocess(server_app, client_app, cfg["num-clients"], cfg)
    out = tmp_path / cfg["run-name"]
    return {name: (out / name).read_bytes() for name in ("metrics.json", "clients.json")}


def differences(a: dict[str, bytes], b: dict[str, bytes]) -> list[str]:
    """Where two runs' files differ: (file, row, key, value a, value b), the first ten."""
    out = []
    for name in a:
        for i, (row_a, row_b) in enumerate(zip(json.loads(a[name]), json.loads(b[name]))):
            out += [f"{name}[{i}] {k}: {row_a.get(k)!r} != {row_b.get(k)!r}" for k in row_a.keys() | row_b.keys()
                    if row_a.get(k) != row_b.get(k)]
            if list(row_a) != list(row_b):
                out.append(f"{name}[{i}]: keys in another order: {list(row_a)} != {list(row_b)}")
    return out[:10]


def shuffled(collect, rng: np.random.Generator):
    """``collect`` (Flower's fit_clients / evaluate_clients) with its results in a random order
    (seeded by the test, not by the run), as threads and Ray actors deliver them."""

    def run(*args, **kwargs):
        results, failures = collect(*args, **kwargs)
        return [results[i] for i in rng.permutation(len(results))], failures

    return run


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_rerun_gives_identical_metrics(tmp_path, domain_dataset, algorithm):
    """Two runs of one config and seed: the same bytes in metrics.json and clients.json."""
    first = run_files(tmp_path, base_config(tmp_path, domain_dataset, algorithm, "a"))
    second = run_files(tmp_path, base_config(tmp_path, domain_dataset, algorithm, "b"))
    rows = json.loads(first["metrics.json"])
    assert any(r["phase"] == "evaluate" for r in rows), "the run evaluated nothing"
    assert first == second, differences(first, second)


@pytest.mark.parametrize("algorithm", ["fedavg", "pfedfda", "fedora", "fmtl", "feddar-sa"])
def test_reply_order_does_not_change_the_numbers(tmp_path, domain_dataset, algorithm, monkeypatch):
    """Clients answering in a different order (as threads and Ray actors do) change nothing."""
    import flwr.server.server as legacy

    import flwr_pfl.strategies.feddar as feddar_strategy

    reference = run_files(tmp_path, base_config(tmp_path, domain_dataset, algorithm, "a"))
    rng = np.random.default_rng(12345)
    monkeypatch.setattr(legacy, "fit_clients", shuffled(legacy.fit_clients, rng))
    monkeypatch.setattr(legacy, "evaluate_clients", shuffled(legacy.evaluate_clients, rng))
    monkeypatch.setattr(feddar_strategy, "fit_clients", shuffled(feddar_strategy.fit_clients, rng))
    shuffled_run = run_files(tmp_path, base_config(tmp_path, domain_dataset, algorithm, "b"))
    assert reference == shuffled_run, differences(reference, shuffled_run)


def test_partial_participation_varies_by_round_and_seed(tmp_path, domain_dataset):
    """The sample is not fixed: rounds and seeds draw different subsets of the clients."""
    cfg = base_config(tmp_path, domain_dataset, "fedavg", "a", **{"num-server-rounds": 4})
    run_inprocess(server_app, client_app, NUM_CLIENTS, cfg)
    clients = json.loads((tmp_path / "a" / "clients.json").read_text())
    rounds = {c["round"] for c in clients}
    assert len(rounds) > 1, "the same clients were evaluated every round"
    draws = {tuple(sample_indices(10, 3, sampling_rng(seed, "fit", r))) for seed in (0, 1) for r in (1, 2, 3)}
    assert len(draws) > 3


def test_a_different_seed_gives_different_numbers(tmp_path, domain_dataset):
    a = run_files(tmp_path, base_config(tmp_path, domain_dataset, "fedavg", "a"))
    b = run_files(tmp_path, base_config(tmp_path, domain_dataset, "fedavg", "b", seed=4))
    assert a["metrics.json"] != b["metrics.json"]


def test_clients_leave_no_random_state_behind(tmp_path, domain_dataset):
    """A client's fit restores torch's generator, and never touches Python's or NumPy's."""
    import random

    from flwr.app import Context, RecordDict

    from flwr_pfl.app.client_app import build_client

    cfg = base_config(tmp_path, domain_dataset, "fedavg", "a")
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 1, "num-partitions": NUM_CLIENTS},
                      state=RecordDict(), run_config=cfg)
    client: PFLClient = build_client(context)
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    client.fit(client.get_parameters({}), {"server-round": 1})
    client.evaluate(client.get_parameters({}), {"server-round": 1})
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_client_seeds_its_messages(name):
    """Each registered client's fit and evaluate run inside the seeded scope."""
    client_class = ALGORITHMS[name].client
    for method in ("fit", "evaluate"):
        assert getattr(getattr(client_class, method), "seeded_message", False), f"{client_class.__name__}.{method}"


def test_client_numbers_do_not_depend_on_what_ran_before(tmp_path, domain_dataset):
    """The same client and message give the same reply whatever the process did before."""
    from flwr.app import Context, RecordDict

    from flwr_pfl.app.client_app import build_client

    cfg = base_config(tmp_path, domain_dataset, "fedrep", "a")

    def reply(noise: int):
        torch.manual_seed(noise)
        torch.rand(noise + 1)
        context = Context(run_id=1, node_id=1, node_config={"partition-id": 2, "num-partitions": NUM_CLIENTS},
                          state=RecordDict(), run_config=cfg)
        client = build_client(context)
        arrays, n, metrics = client.fit(client.get_parameters({}), {"server-round": 2})
        return arrays, metrics["train_loss"]

    (a, loss_a), (b, loss_b) = reply(1), reply(50)
    assert loss_a == loss_b
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_replies_are_summed_in_partition_order():
    class Proxy:
        def __init__(self, cid):
            self.cid = cid

    class Res:
        def __init__(self, pid):
            self.metrics = {"partition_id": pid} if pid is not None else {}

    pairs = [(Proxy("9"), Res(2)), (Proxy("3"), Res(0)), (Proxy("5"), Res(None)), (Proxy("1"), Res(1))]
    assert [p.cid for p, _ in in_partition_order(pairs)] == ["5", "3", "1", "9"]


def test_inprocess_grid_serialises_clients_across_threads(tmp_path, domain_dataset):
    """Two threads pushing at once still run clients one at a time (they share torch)."""
    cfg = base_config(tmp_path, domain_dataset, "fedavg", "a")
    grid = InProcessGrid(client_app, NUM_CLIENTS, cfg)
    active, peak = 0, 0
    original = grid._push

    def counting(messages):
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        time.sleep(0.01)
        active -= 1
        return []

    grid._push = counting  # type: ignore[method-assign]
    threads = [threading.Thread(target=grid.push_messages, args=([],)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    grid._push = original  # type: ignore[method-assign]
    assert peak == 1
