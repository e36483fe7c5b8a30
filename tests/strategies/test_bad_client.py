"""No single client can end or silently ruin a run, for every registered algorithm.

One client of five (partition ``BAD``) answers every fit message that carries arrays (FedDAR's
head phase included; FEDORA's setup, which carries none, is tested in ``test_fedora_e2e``) with
a corrupted copy of its honest reply, one kind of corruption per round. Each reply must be rejected like any bad reply, so that the run completes and every
honest client ends exactly where it ends when the bad client's fits all fail outright: a
rejected reply must weigh nothing, and must not stop the others.

The kinds, in two runs of three rounds:

* structure: a NaN value, an array of the wrong shape, one array missing;
* values: every float32 array sent as float64 and every float64 one as float32 (a float64
  reply would turn a float32 global model into float64), complex numbers, every value times 1e30 (finite, and absurd next to the other replies: the default outlier screen).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from flwr.app import Context
from flwr.client import ClientApp
from flwr.server import ServerApp, ServerAppComponents, ServerConfig

from fakes import BatchNormDropoutNet, split_loaders
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.clients import LocalData, TrainConfig
from flwr_pfl.training import OptimizerConfig

NUM_CLIENTS, BAD = 5, 0
TRAIN_SIZES = (24, 40, 16, 32, 28)  # unequal; batches of 8 leave no batch of one sample
TEST_SIZE = 10
#: the corruption of each round, per run
RUNS = {"structure": ("nan", "shape", "count"), "values": ("float-width", "complex", "huge")}
ROUNDS = 3


def corrupt(arrays: list[np.ndarray], kind: str) -> list[np.ndarray]:
    """A corrupted copy of a fit reply's arrays (an empty reply gains one array under "count")."""
    out = [np.array(a, copy=True) for a in arrays]
    floats = [i for i, a in enumerate(out) if a.dtype.kind == "f" and a.size]
    if kind == "count":
        return out[:-1] if out else [np.zeros(3, np.float32)]
    if not floats:
        return out
    first = floats[0]
    if kind == "nan":
        out[first].reshape(-1)[0] = np.nan
    elif kind == "shape":
        out[first] = np.concatenate([out[first].reshape(-1), np.zeros(1, out[first].dtype)])
    elif kind == "float-width":  # float32 arrays sent as float64, float64 ones as float32
        flipped = {np.dtype(np.float32): np.float64, np.dtype(np.float64): np.float32}
        out = [a.astype(flipped[a.dtype]) if a.dtype in flipped else a for a in out]
    elif kind == "complex":
        out[first] = out[first].astype(np.complex64) + 0j
    elif kind == "huge":
        out = [a * np.asarray(1e30, a.dtype) if a.dtype.kind == "f" else a for a in out]
    else:
        raise ValueError(kind)
    return out


def local_data(pid: int) -> LocalData:
    """Partition ``pid``: 6 features shifted by the class (3) and the partition, two domains."""
    n = TRAIN_SIZES[pid]
    total = n + 2 * TEST_SIZE
    g = torch.Generator().manual_seed(70 + pid)
    y = torch.arange(total) % 3
    d = torch.arange(total) % 2
    x = torch.randn(total, 6, generator=g) + y[:, None].float() + 0.3 * pid
    return split_loaders(x, y, d, n, TEST_SIZE)


@dataclass
class Outcome:
    rows: list = field(default_factory=list)
    corrupted: int = 0  # fit replies of BAD that were corrupted (non-empty corruption)


def _bad_fit(client, kinds: tuple[str, ...] | None, outcome: Outcome):
    honest = client.fit

    def fit(parameters, config):
        if not len(parameters):  # FEDORA's setup (a subspace for the similarity graph): tested on its own
            return honest(parameters, config)
        if kinds is None:
            raise RuntimeError("this client fails every fit")
        arrays, n, metrics = honest(parameters, config)
        kind = kinds[(int(config.get("server-round", 1)) - 1) % len(kinds)]
        bad = corrupt(arrays, kind)
        outcome.corrupted += int(len(bad) != len(arrays) or any(
            b.dtype != a.dtype or b.shape != a.shape or not np.array_equal(a, b, equal_nan=False) for a, b in zip(arrays, bad)))
        return bad, n, metrics

    client.fit = fit


@functools.cache
def federation(name: str, run: str | None) -> Outcome:
    """ROUNDS rounds of ``name``; partition BAD corrupts its fit replies (``RUNS[run]``), or
    fails every fit (``run=None``)."""
    spec = ALGORITHMS[name]
    options = spec.options()  # the suite's defaults
    outcome = Outcome()
    kinds = RUNS[run] if run is not None else None

    def client_fn(context: Context):
        torch.manual_seed(0)
        net = BatchNormDropoutNet()
        pid = int(context.node_config["partition-id"])
        config = TrainConfig(batch_size=8, device="cpu", optimizer=OptimizerConfig(learning_rate=0.05), seed=1)
        client = spec.client(context, net, local_data(pid), config, head="fc2", **spec.client_kwargs(options))
        if pid == BAD:
            _bad_fit(client, kinds, outcome)
        return client.to_client()

    def server_fn(context: Context):
        strategy = spec.strategy(num_clients=NUM_CLIENTS, seed=0, num_rounds=ROUNDS,
                                 on_round=lambda *row: outcome.rows.append(row), **spec.strategy_kwargs(options))
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=ROUNDS))

    run_inprocess(ServerApp(server_fn=server_fn), ClientApp(client_fn=client_fn), NUM_CLIENTS, {})
    return outcome


def honest_results(outcome: Outcome) -> dict[int, dict]:
    """Each honest client's metrics of the last evaluation round (loss, accuracy, ...)."""
    evaluations = [(r, clients) for r, phase, _, clients in outcome.rows if phase == "evaluate"]
    assert evaluations and evaluations[-1][0] == ROUNDS, "the run did not evaluate its last round"
    clients = evaluations[-1][1]
    out = {pid: {k: v for k, v in m.items() if isinstance(v, float) and "seconds" not in k}
           for pid, m in clients.items() if pid != BAD}
    assert sorted(out) == [p for p in range(NUM_CLIENTS) if p != BAD]
    return out


@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_a_corrupted_reply_counts_as_a_failed_client_and_the_run_goes_on(name, run):
    attacked, failing = federation(name, run), federation(name, None)
    assert max(r for r, *_ in attacked.rows) == ROUNDS  # completed: no reply ended the run
    if attacked.corrupted:  # Local sends nothing, so it has nothing to corrupt
        rejected = sum(m.get("num_rejected", 0) for _, phase, m, _ in attacked.rows if phase != "evaluate")
        assert rejected >= 1
    for outcome in (attacked, failing):
        # every fit row records who was dropped: the bad client, by partition, or by node id while
        # its partition is unknown (it never answered, and a round of everyone asks nobody for it)
        rows = [(r, m.get("num_failures"), m.get("dropped_ids")) for r, phase, m, _ in outcome.rows if phase == "fit"]
        assert rows and all(ids is not None for *_, ids in rows), rows
        assert all(ids == str(BAD) or ids.startswith("node-") for _, failed, ids in rows if failed), rows
    expected, got = honest_results(failing), honest_results(attacked)
    for pid, metrics in expected.items():
        for key, value in metrics.items():
            assert got[pid][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (pid, key)


def test_the_corruptions_are_what_they_say():
    arrays = [np.ones((2, 3), np.float32), np.arange(3, dtype=np.int64), np.full(2, 0.5, np.float64)]
    assert np.isnan(corrupt(arrays, "nan")[0]).sum() == 1
    assert corrupt(arrays, "shape")[0].shape == (7,)
    assert len(corrupt(arrays, "count")) == 2 and len(corrupt([], "count")) == 1
    assert [a.dtype for a in corrupt(arrays, "float-width")] == [np.float64, np.int64, np.float32]
    assert corrupt(arrays, "complex")[0].dtype == np.complex64
    huge = corrupt(arrays, "huge")
    assert huge[0].max() == pytest.approx(1e30, rel=1e-6) and huge[1].tolist() == [0, 1, 2] and huge[2][0] == 5e29
    assert arrays[0].max() == 1.0  # the honest reply is left as it was
