"""pFedFDA's Strategy and NumPyClient, message by message: wire layout, sampling, bad replies,
client state and the client's fallbacks (spec §8-9)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from torch import nn

import flwr_pfl.core.pfedfda as core
from flwr_pfl.clients import PFedFDAClient
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.data.types import ArraySplit
from flwr_pfl.errors import ReplyError
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.training import get_arrays, group_shapes

from fakes import FakeProxy, fit_res, manager
from fakes import PFEDFDA_CLASSES as C
from fakes import PFEDFDA_FEATURES as D
from fakes import pfedfda_strategy as strategy
from fakes import pfedfda_wire as wire
from fakes import ready_pfedfda_strategy as ready_strategy


# ------------------------------------------------------------------------------------------
# Server: initial statistics, sampling, wire layout
# ------------------------------------------------------------------------------------------


def test_first_round_sends_backbone_with_the_servers_initial_statistics():
    s = strategy(num_rounds=5)
    cm = manager(10)
    ins = s.configure_fit(1, ndarrays_to_parameters(wire(1.0)), cm)
    arrays = parameters_to_ndarrays(ins[0][1].parameters)
    mu0, sigma0 = core.init_global_statistics(C, D, seed=0)
    assert [a.shape for a in arrays] == [(D, 2), (D,), (C, D), (D, D)]  # [backbone..., mu, Sigma]
    np.testing.assert_array_equal(arrays[0], 1.0)  # the client's backbone
    np.testing.assert_array_equal(arrays[-2], mu0)
    np.testing.assert_array_equal(arrays[-1], sigma0)
    assert all(a.dtype == np.float32 for a in arrays)
    assert len({id(i.parameters) for _, i in ins}) == 1  # the same message for every client


def test_bernoulli_sampling_with_all_clients_in_the_last_round():
    s = strategy(num_rounds=30, fraction_fit=0.3)
    cm = manager(10)
    params = ndarrays_to_parameters(wire())
    sizes = [len(s.configure_fit(r, params, cm)) for r in range(1, 30)]
    assert len(set(sizes)) > 1 and 1 <= min(sizes) and max(sizes) < 10  # Bernoulli: sizes vary
    # strategy seeds 0-7: mean size 2.45..3.28, sizes 1..7, 5..7 distinct sizes
    assert abs(np.mean(sizes) - 3.0) < 1.0  # q * M on average
    last = s.configure_fit(30, params, cm)
    assert sorted(s.partition_of[p.cid] for p, _ in last) == list(range(10))
    no_full = strategy(num_rounds=30, full_last_round=False, fraction_fit=0.3)
    no_full.configure_fit(1, params, cm)
    assert len(no_full.configure_fit(30, params, cm)) < 10


def test_sampling_is_reproducible_and_follows_partition_ids():
    params = ndarrays_to_parameters(wire())
    picks = []
    for _ in range(2):
        s = strategy(num_rounds=10)
        cm = manager(10)
        picks.append([sorted(s.partition_of[p.cid] for p, _ in s.configure_fit(r, params, cm)) for r in range(1, 6)])
    assert picks[0] == picks[1]


def test_train_clients_restricts_fit_but_evaluation_reaches_everyone():
    s = strategy(num_rounds=3, train_clients=4, fraction_fit=1.0)
    cm = manager(10)
    params = ndarrays_to_parameters(wire())
    for r in (1, 2, 3):
        assert sorted(s.partition_of[p.cid] for p, _ in s.configure_fit(r, params, cm)) == [0, 1, 2, 3]
    assert len(s.configure_evaluate(3, params, cm)) == 10


def test_eval_every_zero_evaluates_only_after_the_last_round():
    s = strategy(num_rounds=3, eval_every=0)
    cm = manager(10)
    params = ndarrays_to_parameters(wire())
    s.configure_fit(1, params, cm)
    assert s.configure_evaluate(1, params, cm) == [] and s.configure_evaluate(2, params, cm) == []
    assert len(s.configure_evaluate(3, params, cm)) == 10


def test_the_last_round_evaluates_every_client_and_the_others_a_sample():
    s = strategy(num_rounds=4, fraction_evaluate=0.3)
    cm = manager(10)
    params = ndarrays_to_parameters(wire())
    s.configure_fit(1, params, cm)
    assert [len(s.configure_evaluate(r, params, cm)) for r in (1, 2, 3)] == [3, 3, 3]
    assert sorted(s.partition_of[p.cid] for p, _ in s.configure_evaluate(4, params, cm)) == list(range(10))
    off = strategy(num_rounds=4, fraction_evaluate=0.0)
    off.configure_fit(1, params, cm)
    assert off.configure_evaluate(4, params, cm) == []  # evaluation switched off stays off


# ------------------------------------------------------------------------------------------
# Server: replies and aggregation
# ------------------------------------------------------------------------------------------


def spd(seed: int) -> np.ndarray:
    a = np.random.default_rng(seed).standard_normal((D, D))
    return (a @ a.T + np.eye(D)).astype(np.float32)


def test_aggregation_is_the_sample_weighted_mean_of_every_array():
    s = ready_strategy()
    rng = np.random.default_rng(1)
    msgs = [wire(float(i), rng.standard_normal((C, D)).astype(np.float32), spd(i)) for i in range(3)]
    counts = [10, 30, 60]
    replies = [s.check_reply(1, FakeProxy(str(i), i), fit_res(m, n, i)) for i, (m, n) in enumerate(zip(msgs, counts))]
    out = s.aggregate_replies(1, replies[::-1])  # arrival order does not matter
    w = np.array(counts) / sum(counts)
    for k in range(4):
        np.testing.assert_allclose(out[k], sum(wi * m[k] for wi, m in zip(w, msgs)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[-1], out[-1].T)


def test_packed_covariance_wire_carries_the_upper_triangle():
    s = strategy(packed_cov=True)
    s.configure_fit(1, ndarrays_to_parameters(core.join_wire(wire()[:2], np.zeros((C, D)), np.eye(D), packed_cov=True)), manager(10))
    assert s.expected_shapes(1)[-1] == (D * (D + 1) // 2,)
    msgs = [core.join_wire(wire()[:2], np.ones((C, D), np.float32), spd(i), packed_cov=True) for i in range(2)]
    replies = [s.check_reply(1, FakeProxy(str(i), i), fit_res(m, 10, i)) for i, m in enumerate(msgs)]
    out = s.aggregate_replies(1, replies)
    np.testing.assert_allclose(core.triu_to_cov(out[-1], D), (spd(0) + spd(1)) / 2, rtol=1e-5)


def _bad(kind: str) -> list[np.ndarray]:
    arrays = wire(0.0, np.zeros((C, D), np.float32), spd(0))
    if kind == "not_psd":
        arrays[-1] = np.diag([1.0, 1.0, 1.0, -5.0]).astype(np.float32)
    elif kind == "asymmetric":
        arrays[-1] = arrays[-1] + np.triu(np.ones((D, D), np.float32), 1)
    elif kind == "nan_means":
        arrays[-2][0, 0] = np.nan
    elif kind == "inf_cov":
        arrays[-1][0, 0] = np.inf
    elif kind == "means_shape":
        arrays[-2] = np.zeros((C + 1, D), np.float32)
    elif kind == "missing_cov":
        arrays = arrays[:-1]
    return arrays


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("not_psd", "positive semi-definite"),
        ("asymmetric", "not symmetric"),
        ("nan_means", "NaN"),
        ("inf_cov", "NaN|Inf|inf"),
        ("means_shape", "shape"),
        ("missing_cov", "array"),
    ],
)
def test_bad_statistics_are_rejected_naming_the_client(kind, match):
    s = ready_strategy()
    with pytest.raises(ReplyError, match=match):
        s.check_reply(1, FakeProxy("77", 2), fit_res(_bad(kind), 10, 2))


def test_a_rejected_reply_is_counted_and_the_round_goes_on():
    s = ready_strategy()
    good = [(FakeProxy(str(i), i), fit_res(wire(1.0, cov=spd(i)), 10, i)) for i in range(2)]
    bad = (FakeProxy("9", 9), fit_res(_bad("not_psd"), 10, 9))
    params, metrics = s.aggregate_fit(1, [*good, bad], [])
    assert metrics["num_rejected"] == 1.0 and metrics["num_failures"] == 1.0
    assert params is not None and np.isfinite(metrics["sigma_g_trace"])


def test_a_collapse_of_the_features_is_logged_every_round_and_warned_about_once(caplog):
    s = ready_strategy()
    apart = 3.0 * np.eye(C, D, dtype=np.float32)  # class means 3 apart: separated
    healthy = [(FakeProxy(str(i), i), fit_res(wire(1.0, mu=apart, cov=spd(i)), 10, i)) for i in range(2)]
    merged = np.full((C, D), 0.5, np.float32)
    collapsed = [(FakeProxy(str(i), i), fit_res(wire(1.0, mu=merged + 1e-4 * i, cov=spd(i)), 10, i)) for i in range(2)]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, metrics = s.aggregate_fit(1, healthy, [])
        assert metrics["mu_g_separation"] > 0.5 and "collapse" not in caplog.text
        for server_round in (2, 3):
            _, metrics = s.aggregate_fit(server_round, collapsed, [])
            assert metrics["mu_g_separation"] < 1e-3  # the per-round metric, every round
    warnings = [r.getMessage() for r in caplog.records if "collapse" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("round 2:") and "learning-rate" in warnings[0]


def test_resumed_strategy_samples_what_the_uninterrupted_run_sampled():
    s = ready_strategy(num_rounds=10)
    cm = manager(10)
    params = ndarrays_to_parameters(wire())
    state = s.state_dict()
    ahead = [[p.cid for p, _ in s.configure_fit(r, params, cm)] for r in range(2, 8)]
    t = strategy(num_rounds=10)  # the same config: each round's draw depends on (seed, round) only
    t.load_state_dict(state, rounds_done=1)
    again = [[p.cid for p, _ in t.configure_fit(r, params, cm)] for r in range(1, 7)]
    assert ahead == again
    other = strategy(num_rounds=10, seed=123)
    other.load_state_dict(state, rounds_done=1)
    assert [[p.cid for p, _ in other.configure_fit(r, params, cm)] for r in range(1, 7)] != ahead


# ------------------------------------------------------------------------------------------
# Client: fit/evaluate messages, state, fallbacks (spec §9.8, §9.10)
# ------------------------------------------------------------------------------------------


def make_client(labels, *, pid=0, context=None, dim_in=6, **kwargs) -> PFedFDAClient:
    g = torch.Generator().manual_seed(pid)
    y = torch.as_tensor(labels, dtype=torch.long)
    x = torch.randn(len(y), dim_in, generator=g) + y.unsqueeze(1).float()
    split = ArraySplit(x, y, torch.zeros(len(y), dtype=torch.long))
    test = ArraySplit(x[:4], y[:4], torch.zeros(min(4, len(y)), dtype=torch.long))
    torch.manual_seed(0)
    model = EncoderHeadModel(nn.Sequential(nn.Linear(dim_in, D), nn.LeakyReLU()), D, C)
    context = context or Context(run_id=1, node_id=1, node_config={"partition-id": pid}, state=RecordDict(), run_config={})
    return PFedFDAClient(context, model, LocalData(split.loader(8, True), test.loader(8, False)), TrainConfig(local_epochs=2), **kwargs)


def _with_head(head: nn.Module | None = None, num_heads: int = 1) -> EncoderHeadModel:
    """A model of the make_client shape whose first head is replaced by ``head``."""
    model = EncoderHeadModel(nn.Sequential(nn.Linear(6, D), nn.LeakyReLU()), D, C, num_heads=num_heads)
    if head is not None:
        model.heads[0] = head
    return model


@pytest.mark.parametrize(
    ("model", "found"),
    [
        (EncoderHeadModel(nn.Sequential(nn.Linear(6, D)), D, C, head_bias=False), "a head without a bias"),
        (_with_head(nn.Sequential(nn.Linear(D, C))), "a head of type Sequential (need torch.nn.Linear)"),
        (_with_head(nn.Linear(D + 1, C)), f"a head Linear({D + 1}, {C}) on a model with feature_dim={D} and num_outputs={C}"),
        (_with_head(num_heads=2), "2 heads (need exactly one)"),
    ],
    ids=["no-bias", "not-linear", "wrong-shape", "two-heads"],
)
def test_client_refuses_a_head_that_cannot_hold_the_lda_head(model: EncoderHeadModel, found: str) -> None:
    split = ArraySplit(torch.randn(8, 6), torch.arange(8) % C, torch.zeros(8, dtype=torch.long))
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    with pytest.raises(ValueError, match="pFedFDA needs one linear head with a bias on the representation") as err:
        PFedFDAClient(context, model, LocalData(split.loader(8, True), split.loader(8, False)), TrainConfig())
    assert f"this model has {found}" in str(err.value) and "head_bias=True" in str(err.value)


def server_message(client: PFedFDAClient) -> list[np.ndarray]:
    mu, sigma = core.init_global_statistics(C, D, seed=0)
    return core.join_wire(get_arrays(client.model, "body"), mu, sigma)


def test_client_wire_layout_and_beta_in_context_state():
    client = make_client([0, 1, 2] * 10)
    arrays, n, metrics = client.fit(server_message(client), {"server-round": 1})
    shapes = group_shapes(client.model, "body")
    assert [a.shape for a in arrays] == [*shapes, (C, D), (D, D)]  # no head on the wire
    assert n == 30 and metrics["n_feats"] == 60  # all epochs' features; num_examples = n_i
    core.check_client_statistics(arrays[-2], arrays[-1], C, D)
    stored = dict(client.context.state["pfedfda"])
    assert stored["beta_mu"] == pytest.approx(metrics["beta_mu"])
    loss, n_test, ev = client.evaluate(server_message(client), {"server-round": 1})
    assert n_test == 4 and 0.0 <= ev["accuracy"] <= 1.0 and np.isfinite(loss)
    assert dict(client.context.state["pfedfda"]) == stored  # evaluation does not overwrite beta


def test_absent_class_keeps_the_global_mean():
    client = make_client([0, 1] * 10)  # class 2 absent
    message = server_message(client)
    arrays, _, _ = client.fit(message, {"server-round": 1})
    np.testing.assert_array_equal(arrays[-2][2], message[-2][2])


@pytest.mark.parametrize("labels", [[1], [0, 1]])
def test_fewer_samples_than_folds_falls_back_to_global_statistics(labels):
    client = make_client(labels, stats_source="fresh_pass")
    message = server_message(client)
    arrays, _, metrics = client.fit(message, {"server-round": 1})
    assert metrics["beta_mu"] == 0.0 and metrics["beta_fallback"] == 1.0
    np.testing.assert_allclose(arrays[-2], message[-2], atol=1e-6)
    loss, _, ev = client.evaluate(message, {"server-round": 1})
    assert np.isfinite(loss) and ev["beta_fallback"] == 1.0


def test_a_failing_beta_solver_keeps_the_previous_beta(monkeypatch):
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    client = make_client([0, 1, 2] * 10, context=context)
    _, _, first = client.fit(server_message(client), {"server-round": 1})
    assert first["beta_fallback"] == 0.0

    def broken(*args, **kwargs):
        raise RuntimeError("line search failed")

    monkeypatch.setattr("flwr_pfl.core.pfedfda.beta._minimize_lbfgs", broken)
    client = make_client([0, 1, 2] * 10, context=context)  # a new object, as the engine builds
    _, _, second = client.fit(server_message(client), {"server-round": 2})
    assert second["beta_fallback"] == 1.0
    assert second["beta_mu"] == pytest.approx(first["beta_mu"])


@pytest.mark.parametrize("source", ["all_epochs", "last_epoch", "fresh_pass"])
def test_stats_sources(source):
    client = make_client([0, 1, 2] * 10, stats_source=source)
    _, _, metrics = client.fit(server_message(client), {"server-round": 1})
    assert metrics["n_feats"] == {"all_epochs": 60, "last_epoch": 30, "fresh_pass": 30}[source]


def test_client_rejects_statistics_of_the_wrong_size():
    client = make_client([0, 1, 2] * 4)
    message = server_message(client)
    message[-2] = np.zeros((C + 2, D), np.float32)
    with pytest.raises(ValueError, match=r"\(C, d\)"):
        client.fit(message, {"server-round": 1})
