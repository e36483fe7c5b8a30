"""FedAvg+FMTL's NumPyClient and Strategy message by message, against closed forms.

Client: a Linear(5, 4) + tanh body and one stacked head Linear(4, 3) (task c = class c), twelve
training samples with unequal task counts (7 / 5 / 0) in two unshuffled batches, so that a round
is replayed by a hand-written SGD loop. Phase 1 trains everything (FedProx term toward the received
model when ``prox_mu`` > 0); phase 2 trains the heads only, for ``phase2_epochs``, without the
proximal term unless ``phase2_prox``; the reply carries the model (or the heads), the task counts,
then the eq. (10) statistics when asked.

Strategy: fake replies of clients with unequal sizes and task counts; phase 1 averages with the
configured body weights, phase 2 keeps the body and gives head c the eq. (12) weights (holders
share 1/2 when 2 |I^c| <= K, else 1/K) or the sample-count weights, over the round's participants.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Context, RecordDict
from flwr.common import FitRes, Parameters, ndarrays_to_parameters
from torch.utils.data import DataLoader, TensorDataset

from flwr_pfl.clients import FedFMTLClient
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.core.fmtl import FMTLWeightingOptions
from flwr_pfl.errors import ConfigError, NumRoundsRequired
from flwr_pfl.strategies import FedFMTL
from flwr_pfl.training import OptimizerConfig, get_arrays, set_arrays

from fakes import FakeProxy, arrays_of, fit_res, manager, tiny_model
from fakes import assert_arrays_close as close

LR = 0.4
BATCH = 6
M = 3


X = torch.randn(12, 5, generator=torch.Generator().manual_seed(3))
Y = torch.tensor([0, 1, 0, 0, 1, 0, 1, 0, 1, 0, 1, 0])  # task counts 7 / 5 / 0


def make_client(epochs: int = 2, state: RecordDict | None = None, **kwargs) -> FedFMTLClient:
    loader = DataLoader(TensorDataset(X, Y), batch_size=BATCH, shuffle=False)
    data = LocalData(train=loader, test=loader)
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 4},
                      state=state if state is not None else RecordDict(), run_config={})
    config = TrainConfig(local_epochs=epochs, batch_size=BATCH, optimizer=OptimizerConfig("sgd", LR), device="cpu")
    return FedFMTLClient(context, tiny_model(99), data, config, **kwargs)


def reference(start, epochs: int, heads_only: bool, mu: float = 0.0) -> list[np.ndarray]:
    """SGD on the softmax cross-entropy over all heads (the augmented CE objective), batches in
    order; with ``mu`` the FedProx term (mu / 2) ||theta - start||^2 over the trained parameters."""
    model = tiny_model()
    set_arrays(model, start)
    named = list(model.named_parameters())
    params = [p for name, p in named if name.startswith("heads.") or not heads_only]
    anchor = [p.detach().clone() for p in params]
    for _ in range(epochs):
        for b in range(0, len(Y), BATCH):
            loss = F.cross_entropy(model(X[b:b + BATCH]), Y[b:b + BATCH])
            if mu:
                loss = loss + 0.5 * mu * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor))
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p -= LR * g
    return get_arrays(model)


def config(phase: int, upload: str = "full", stats: bool = False) -> dict:
    return {"server-round": 3, "fmtl-phase": phase, "fmtl-upload": upload, "fmtl-stats": stats}


# ------------------------------------------------------------------------------ client
@pytest.mark.parametrize("mu", [0.0, 0.7])
def test_phase1_trains_the_whole_model_with_the_fedprox_term(mu):
    """Phase 1: E epochs on every parameter, plus (mu/2) ||theta - theta_global||^2 toward the
    received model; the reply is the model followed by the task counts n_i^c."""
    glob = arrays_of(1)
    arrays, n, metrics = make_client(prox_mu=mu).fit(glob, config(1))
    expected = reference(glob, 2, heads_only=False, mu=mu)
    close(arrays[:-1], expected)
    np.testing.assert_array_equal(arrays[-1], [7, 5, 0])
    assert arrays[-1].dtype.kind == "i" and n == 12
    assert metrics["n_stats_arrays"] == 0 and metrics["num_tasks_held"] == 2
    if mu:  # the term is visible: without it the model moves farther from the global one
        free = reference(glob, 2, heads_only=False)
        dist = lambda xs: sum(float(((x - g) ** 2).sum()) for x, g in zip(xs, glob))  # noqa: E731
        assert dist(arrays[:-1]) < 0.97 * dist(free)


@pytest.mark.parametrize("phase2_prox", [False, True])
def test_phase2_trains_only_the_heads_for_phase2_epochs(phase2_prox):
    """Phase 2: the body is frozen, the heads train for ``phase2_epochs`` (3, not the 2 local
    epochs), the FedProx term only with ``phase2_prox``; a head-only upload carries the heads
    and the counts."""
    glob = arrays_of(2)
    client = make_client(prox_mu=0.9, phase2_epochs=3, phase2_prox=phase2_prox)
    arrays, _, _ = client.fit(glob, config(2, "head_only"))
    expected = reference(glob, 3, heads_only=True, mu=0.9 if phase2_prox else 0.0)
    np.testing.assert_array_equal(get_arrays(client.model, "body")[0], glob[0])  # body untouched
    close(arrays[:-1], expected[2:])  # heads only
    np.testing.assert_array_equal(arrays[-1], [7, 5, 0])
    full, _, _ = make_client(prox_mu=0.9, phase2_epochs=3, phase2_prox=phase2_prox).fit(glob, config(2, "full"))
    close(full[:-1], expected)


def test_phase2_statistics_follow_the_counts_on_the_wire():
    """Asked for statistics: [heads..., counts, tasks, counts, second moments] with
    ``n_stats_arrays`` = 3; the second moment of task c is mean over its samples of z z^T under
    the frozen body; computed once and kept in context.state."""
    glob = arrays_of(3)
    state = RecordDict()
    arrays, _, metrics = make_client(state=state).fit(glob, config(2, "head_only", stats=True))
    assert metrics["n_stats_arrays"] == 3 and len(arrays) == 2 + 1 + 3
    np.testing.assert_array_equal(arrays[2], [7, 5, 0])
    tasks, counts, second = arrays[3:]
    np.testing.assert_array_equal(tasks, [0, 1])
    np.testing.assert_array_equal(counts, [7, 5])
    body = tiny_model()
    set_arrays(body, glob)
    with torch.no_grad():
        z = body.features(X).double().numpy()
    for j, c in enumerate((0, 1)):
        zc = z[Y.numpy() == c]
        np.testing.assert_allclose(second[j], zc.T @ zc / len(zc), rtol=1e-5, atol=1e-6)
    assert "fmtl-stats" in state


# ------------------------------------------------------------------------------ strategy
GLOBAL = arrays_of(0)
COUNTS = {  # five clients with unequal sizes; each holds at least one task
    0: [6, 2, 0],
    1: [0, 5, 0],
    2: [3, 0, 0],
    3: [0, 0, 9],
    4: [0, 4, 0],
}


def reply(pid: int, arrays: list[np.ndarray]) -> tuple[FakeProxy, FitRes]:
    counts = np.array(COUNTS[pid], dtype=np.int64)
    return FakeProxy(f"c{pid}"), fit_res([*arrays, counts], int(counts.sum()), pid)


def uploads() -> dict[int, list[np.ndarray]]:
    return {pid: arrays_of(10 + pid) for pid in COUNTS}


def sizes() -> np.ndarray:
    return np.array([sum(COUNTS[pid]) for pid in sorted(COUNTS)], dtype=np.float64)


def strategy(**kwargs) -> FedFMTL:
    return FedFMTL(num_clients=len(COUNTS), t1_rounds=2, initial_arrays=[a.copy() for a in GLOBAL], **kwargs)


@pytest.mark.parametrize("body_weighting", ["uniform", "num_examples"])
def test_phase1_is_fedavg_with_the_configured_body_weights(body_weighting):
    s = strategy(body_weighting=body_weighting)
    up = uploads()
    s.aggregate_fit(2, [reply(pid, a) for pid, a in up.items()], [])
    n = sizes()
    w = n / n.sum() if body_weighting == "num_examples" else np.full(len(n), 1 / len(n))
    expected = [sum(w[pid] * up[pid][j].astype(np.float64) for pid in up) for j in range(len(GLOBAL))]
    close(s.global_arrays, expected)


def eq12(membership: np.ndarray) -> np.ndarray:
    """Eq. (12) by its definition, one column per task."""
    k, m = membership.shape
    beta = np.full((k, m), 1.0 / k)
    for c in range(m):
        h = int(membership[:, c].sum())
        if 0 < h and 2 * h <= k:
            beta[:, c] = np.where(membership[:, c], 1 / (2 * h), 1 / (2 * (k - h)))
    return beta


def expected_heads(beta: np.ndarray, up: dict[int, list[np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    pids = sorted(up)
    weight = sum(beta[i][:, None] * up[pid][2].astype(np.float64) for i, pid in enumerate(pids))
    bias = sum(beta[i] * up[pid][3].astype(np.float64) for i, pid in enumerate(pids))
    return weight, bias


@pytest.mark.parametrize("min_count", [1, 3])
def test_phase2_heads_take_eq12_weights_and_the_body_is_kept(min_count):
    """Head-only uploads in round t1 + 1: body unchanged; head c (row c of the stacked layer) is
    sum_i beta_i^c w_i,c with eq. (12) over the participants, holders those with n_i^c >=
    min_count (client 0 holds task 1 with 2 samples: a holder only for min_count 1)."""
    s = strategy(min_count=min_count)
    up = uploads()
    s.aggregate_fit(3, [reply(pid, a[2:]) for pid, a in up.items()], [])
    membership = np.array([COUNTS[pid] for pid in sorted(COUNTS)]) >= min_count
    beta = eq12(membership)
    weight, bias = expected_heads(beta, up)
    np.testing.assert_array_equal(s.global_arrays[0], GLOBAL[0])
    np.testing.assert_array_equal(s.global_arrays[1], GLOBAL[1])
    close(s.global_arrays[2:], [weight, bias])
    np.testing.assert_allclose(np.array(s.weight_history[-1]["beta"]), beta, atol=1e-12)


def test_phase2_full_uploads_keep_the_body():
    """upload = full: the clients' bodies arrive too (here all different) and are ignored."""
    s = strategy(upload="full")
    up = uploads()
    s.aggregate_fit(3, [reply(pid, a) for pid, a in up.items()], [])
    np.testing.assert_array_equal(s.global_arrays[0], GLOBAL[0])
    np.testing.assert_array_equal(s.global_arrays[1], GLOBAL[1])
    close(s.global_arrays[2:], expected_heads(eq12(np.array(list(COUNTS.values())) >= 1), up))


def test_phase2_sample_count_head_weights():
    """Head weighting ``num_examples``: beta_i^c = n_i / sum_j n_j for every head."""
    s = strategy(weighting=FMTLWeightingOptions(scheme="num_examples"))
    up = uploads()
    s.aggregate_fit(3, [reply(pid, a[2:]) for pid, a in up.items()], [])
    n = sizes()
    beta = np.repeat((n / n.sum())[:, None], M, axis=1)
    close(s.global_arrays[2:], expected_heads(beta, up))


def test_schedule_and_instructions():
    """Rounds <= t1 are phase 1 with full uploads; later rounds phase 2 with the configured
    upload; eq. (10) statistics are asked for in phase 2 only from clients whose statistics the
    server does not hold yet."""
    s = strategy(weighting=FMTLWeightingOptions(scheme="fmtl_eq10"))
    s.partition_of = {"c0": 0, "c1": 1}
    params = Parameters(tensors=[], tensor_type="numpy.ndarray")
    proxies = [FakeProxy("c0"), FakeProxy("c1"), FakeProxy("c9")]
    by_round = {r: {p.cid: ins.config for p, ins in s.fit_instructions(r, params, proxies)} for r in (2, 3)}
    assert {c["fmtl-phase"] for c in by_round[2].values()} == {1}
    assert {c["fmtl-upload"] for c in by_round[2].values()} == {"full"}
    assert not any(c["fmtl-stats"] for c in by_round[2].values())
    assert {c["fmtl-phase"] for c in by_round[3].values()} == {2}
    assert {c["fmtl-upload"] for c in by_round[3].values()} == {"head_only"}
    s.statistics["p0"] = object()  # held already: not asked again
    again = {p.cid: ins.config["fmtl-stats"] for p, ins in s.fit_instructions(4, params, proxies)}
    assert again == {"c0": False, "c1": True, "c9": True}


# ------------------------------------------------------------------------------ the two phases
def test_a_phase_1_longer_than_the_run_is_refused_naming_both_settings(caplog):
    """t1_rounds > the run's rounds would make the run FedAvg only: refused at construction
    when num_rounds is given, in the strategy's and the run config's terms. Exactly the run's
    rounds is phase 1 alone (the papers' FedProx baseline), logged as such."""
    with pytest.raises(ConfigError, match=r"t1_rounds=100 \(run config fmtl\.t1-rounds\) exceeds the run's 10 rounds"):
        FedFMTL(num_clients=2, num_rounds=10)
    with pytest.raises(ConfigError, match=r"t1_rounds=11 .* e\.g\. 9 of 10"):
        FedFMTL(num_clients=2, num_rounds=10, t1_rounds=11)
    from flwr.common.logger import FLOWER_LOGGER
    FLOWER_LOGGER.propagate = True
    try:
        assert FedFMTL(num_clients=2, num_rounds=10, t1_rounds=10).phase(10) == 1
    finally:
        FLOWER_LOGGER.propagate = False
    assert any("equals the run's rounds: every round is phase 1" in r.getMessage() for r in caplog.records)
    assert FedFMTL(num_clients=2, num_rounds=10, t1_rounds=9).phase(10) == 2


@pytest.mark.parametrize(("rounds", "t1"), [(1, 0), (2, 1), (5, 3), (10, 5), (110, 55)])
def test_t1_rounds_none_is_the_first_half_of_the_rounds(rounds, t1):
    s = FedFMTL(num_clients=2, num_rounds=rounds, t1_rounds=None)
    assert s.t1_rounds == t1 and s.phase(rounds) == 2 and s.phase(t1 + 1) == 2
    assert t1 == 0 or s.phase(t1) == 1


def test_t1_rounds_none_needs_the_runs_rounds():
    with pytest.raises(NumRoundsRequired, match=r"t1_rounds=None"):
        FedFMTL(num_clients=2, t1_rounds=None).check_phases()


def test_the_message_api_checks_the_phases_once_start_has_told_the_rounds():
    """The Message-API strategy learns the run's rounds from start(): the check runs before
    round 1's instructions, so a run of FedAvg only never sends a message."""
    s = FedFMTL(num_clients=2)  # num_rounds unknown: nothing to check yet
    s.num_rounds = 4  # what start(num_rounds=4) tells it
    with pytest.raises(ConfigError, match=r"t1_rounds=100 .* exceeds the run's 4 rounds"):
        s.configure_fit(1, ndarrays_to_parameters([np.zeros(2)]), manager(2))
