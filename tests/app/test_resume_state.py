"""Strategy state through a checkpoint file and back, for the parts the end-to-end resume tests
do not reach on their own: FEDORA's recomputed ``Theta_hat`` with frozen rows (and its
checkpoint size), FMTL's cached eq. (10) statistics, FedGP's kept source replies."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_pfl.app.checkpoint import CHECKPOINT_NAME, read_checkpoint, write_checkpoint
from flwr_pfl.core import fedora as core
from flwr_pfl.core.fmtl import TaskStatistics
from flwr_pfl.strategies.fedora import FEDORA
from flwr_pfl.strategies.fmtl import FedFMTL
from flwr_pfl.strategies.validation import ClientReply


def through_file(tmp_path, strategy, fresh, rounds_done: int = 3):
    """``strategy``'s state written to a checkpoint and loaded into ``fresh``; returns the file's entries."""
    write_checkpoint(tmp_path, rounds_done, {}, {}, strategy.state_dict())
    fresh.load_state_dict(read_checkpoint(tmp_path / CHECKPOINT_NAME).state, rounds_done)
    with np.load(tmp_path / CHECKPOINT_NAME, allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


# ------------------------------------------------------------------------------ FEDORA
K = 5
SHAPES = [(7, 3), (7,)]


def fedora_with_updates(frozen_last: bool) -> FEDORA:
    """A FEDORA server after setup and three Eq. 6 updates from partial uploads; in the last
    one, client 1 was sampled but sent nothing valid (frozen) when ``frozen_last``."""
    rng = np.random.default_rng(0)
    s = FEDORA(num_clients=K, fraction_fit=0.6)
    init = [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]
    s.global_arrays = init
    s.layout = core.ParameterLayout.from_arrays(init)
    subspaces = [np.linalg.qr(rng.standard_normal((9, 1)))[0] for _ in range(K)]
    s.graph = core.build_propagation_graph(subspaces, s.config.graph, s.config.propagation)
    s.theta, s.theta_hat = core.init_server_buffers(s.layout.flatten(init), K)
    for rnd, (sampled, uploaded) in enumerate([({0, 2, 3}, {0, 2, 3}), ({1, 4}, {4}), ({0, 1, 3}, {0, 3})]):
        if rnd == 2 and not frozen_last:
            uploaded = sampled
        s._sampled = set(sampled)
        replies = [ClientReply(f"c{k}", k, 10, [rng.standard_normal(sh).astype(np.float32) for sh in SHAPES], {})
                   for k in sorted(uploaded)]
        s.aggregate_replies(rnd + 1, replies)
    return s


@pytest.mark.parametrize("frozen_last", [True, False])
def test_fedora_theta_hat_is_recomputed_bit_for_bit(tmp_path, frozen_last):
    s = fedora_with_updates(frozen_last)
    assert s._last_frozen == ([1] if frozen_last else [])
    fresh = FEDORA(num_clients=K, fraction_fit=0.6)
    entries = through_file(tmp_path, s, fresh)
    assert "state_fedora_theta_hat" not in entries  # K x P values stored, not 2 K x P
    assert entries["state_fedora_theta_hat_frozen"].shape == (len(s._last_frozen), s.layout.size)
    np.testing.assert_array_equal(fresh.theta, s.theta)
    np.testing.assert_array_equal(fresh.theta_hat, s.theta_hat)
    if frozen_last:  # the kept row is an older value than M Theta gives now
        assert not np.array_equal(s.theta_hat[1], (s.graph.propagation.astype(np.float32) @ s.theta)[1])
    np.testing.assert_array_equal(fresh.graph.propagation, s.graph.propagation)
    # the next update continues identically
    upload = {2: np.full(s.layout.size, 0.5, np.float32)}
    for strategy in (s, fresh):
        core.server_update(strategy.theta, strategy.theta_hat, upload, strategy.graph, strategy.config.propagation)
    np.testing.assert_array_equal(fresh.theta_hat, s.theta_hat)


def test_fedora_before_any_update_restores_theta_hat_as_theta(tmp_path):
    s = fedora_with_updates(False)
    s.theta_hat = s.theta.copy()
    s._last_frozen = None
    fresh = FEDORA(num_clients=K)
    through_file(tmp_path, s, fresh)
    np.testing.assert_array_equal(fresh.theta_hat, s.theta)


def test_fedora_best_validation_record_survives(tmp_path):
    s = fedora_with_updates(False)
    s._best = {"fedora": {"val": 0.75, "round": 4, "acc": {0: 0.5, 3: None}}, "local": {"val": 0.7, "round": 2, "acc": {0: 0.25}}}
    s.setup_errors = {2: "all zeros"}
    fresh = FEDORA(num_clients=K)
    through_file(tmp_path, s, fresh)
    assert fresh._best == s._best and fresh.setup_errors == s.setup_errors


# ------------------------------------------------------------------------------ FMTL
def test_fmtl_registry_statistics_and_weights_survive(tmp_path):
    rng = np.random.default_rng(1)

    def stats(tasks):
        z = rng.standard_normal((len(tasks), 6, 4))
        return TaskStatistics(np.array(tasks), np.array([3] * len(tasks)), np.einsum("tni,tnj->tij", z, z) / 6)

    s = FedFMTL(num_clients=4, t1_rounds=1)
    s.registry = {"p3": np.array([0, 3, 0]), "p0": np.array([2, 0, 1])}
    s.statistics = {"p3": stats([1]), "p0": stats([0, 2])}
    s.weight_history = [{"round": 2, "participants": [3, 0], "beta": [[0.5, 0.25]], "skipped": []}]
    s.partition_of = {"node-a": 3, "node-b": 0}
    fresh = FedFMTL(num_clients=4, t1_rounds=1)
    through_file(tmp_path, s, fresh, rounds_done=2)
    assert list(fresh.registry) == ["p3", "p0"]  # the order the population weights stack in
    for k in s.registry:
        np.testing.assert_array_equal(fresh.registry[k], s.registry[k])
    assert list(fresh.statistics) == ["p3", "p0"]
    for k, st in s.statistics.items():
        for a, b in zip(fresh.statistics[k].to_arrays(), st.to_arrays()):
            np.testing.assert_array_equal(a, b)
    assert fresh.weight_history == s.weight_history
    assert fresh.partition_of == s.partition_of and fresh.round_offset == 2


# ------------------------------------------------------------------------------ FedGP
def test_fedgp_kept_source_replies_survive(tmp_path):
    from flwr_pfl.strategies.fedgp import FedGP

    s = FedGP(num_clients=3)
    s.target_cid, s.is_buffer, s.target_history = "n2", [False, True], [0.5, 0.625]
    s._pending = [ClientReply("n0", 0, 40, [np.ones((2, 2), np.float32), np.zeros(2)], {"lr": 0.1, "num_steps": 3}),
                  ClientReply("n1", 1, 25, [np.full((2, 2), 2.0, np.float32), np.ones(2)], {"lr": 0.1, "num_steps": 2})]
    fresh = FedGP(num_clients=3)
    through_file(tmp_path, s, fresh, rounds_done=4)
    assert (fresh.target_cid, fresh.is_buffer, fresh.target_history) == ("n2", [False, True], [0.5, 0.625])
    assert [(r.cid, r.partition_id, r.num_examples, r.metrics) for r in fresh._pending] == \
        [(r.cid, r.partition_id, r.num_examples, r.metrics) for r in s._pending]
    for a, b in zip(fresh._pending, s._pending):
        for x, y in zip(a.arrays, b.arrays):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)
