"""One bad client cannot wreck the model unnoticed: with the reply bounds on, a reply of huge
values or one claiming 10^12 examples leaves the aggregate near the honest clients' mean; off
(the default) they wreck it, as the papers' plain weighted mean does. Algorithms whose replies
are not model updates refuse the bounds."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.common import parameters_to_ndarrays

from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.server_app import build_strategy
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies import FedAvg, FedRep

from fakes import FakeProxy, fit_res

GLOBAL = [np.zeros((2, 3), np.float32), np.zeros(3, np.float32)]
SIZES = [10, 30, 20, 40, 25]  # unequal sizes: the honest mean is weighted


def honest(pid: int) -> list[np.ndarray]:
    rng = np.random.default_rng(pid)
    return [(0.1 * rng.normal(size=a.shape)).astype(np.float32) for a in GLOBAL]


def aggregate(strategy, replies):
    strategy.global_arrays = [a.copy() for a in GLOBAL]
    results = [(FakeProxy(str(100 + pid), pid), fit_res(arrays, n, pid)) for pid, (arrays, n) in enumerate(replies)]
    params, metrics = strategy.aggregate_fit(1, results, [])
    return parameters_to_ndarrays(params), metrics


def honest_mean(pids, sizes):
    weights = np.array(sizes, float) / sum(sizes)
    return [sum(w * honest(p)[i].astype(np.float64) for w, p in zip(weights, pids)) for i in range(len(GLOBAL))]


def distance(a, b) -> float:
    return float(np.sqrt(sum(np.sum((np.asarray(x, np.float64) - y) ** 2) for x, y in zip(a, b))))


def test_huge_values_wreck_the_plain_mean_and_not_the_bounded_ones():
    replies = [(honest(p), n) for p, n in enumerate(SIZES[:4])] + [([np.full(a.shape, 1e6, np.float32) for a in GLOBAL], SIZES[4])]
    target = honest_mean(range(4), SIZES[:4])
    plain, _ = aggregate(FedAvg(num_clients=5), replies)
    assert distance(plain, target) > 1e5  # wrecked
    clipped, _ = aggregate(FedAvg(num_clients=5, clip_update_norm=0.5), replies)
    # the attacker moves the mean by at most its weight times the clip norm
    # it moves the mean by at most its weight times (the clip norm + the honest mean's norm)
    weight = SIZES[4] / sum(SIZES)
    assert distance(clipped, target) <= weight * (0.5 + distance(target, [0 * t for t in target])) + 1e-6
    # exactly: the attacker's update (all coordinates equal, 9 of them) scaled to norm 0.5, then
    # the example-weighted mean of the five replies
    attacker = [np.full(a.shape, 0.5 / 3.0) for a in GLOBAL]
    for got, t, c in zip(clipped, target, attacker):
        np.testing.assert_allclose(got, (1 - weight) * t + weight * c, rtol=1e-5, atol=1e-7)
    trimmed, _ = aggregate(FedAvg(num_clients=5, aggregate="trimmed-mean", trim_fraction=0.2), replies)
    for i, t in enumerate(trimmed):  # every coordinate within the honest clients' values
        values = np.stack([honest(p)[i] for p in range(4)])
        assert np.all(t >= values.min(axis=0) - 1e-7) and np.all(t <= values.max(axis=0) + 1e-7)
    # and equal to the mean of the middle three of the five values per coordinate
    expected = np.sort(np.stack([r[0][0] for r in replies]).astype(np.float64), axis=0)[1:4].mean(axis=0)
    np.testing.assert_allclose(trimmed[0], expected, rtol=1e-6)


def test_a_claim_of_a_trillion_examples_wrecks_the_plain_mean_and_is_rejected_with_max_examples():
    bad = [np.full(a.shape, 5.0, np.float32) for a in GLOBAL]
    replies = [(honest(p), n) for p, n in enumerate(SIZES[:4])] + [(bad, 10**12)]
    target = honest_mean(range(4), SIZES[:4])
    plain, _ = aggregate(FedAvg(num_clients=5), replies)
    assert distance(plain, [b.astype(np.float64) for b in bad]) < 1e-6  # the liar takes over
    capped, metrics = aggregate(FedAvg(num_clients=5, max_examples=1000), replies)
    assert metrics["num_rejected"] == 1.0
    for a, t in zip(capped, target):
        np.testing.assert_allclose(a, t, rtol=1e-5, atol=1e-7)  # exactly the honest weighted mean


def test_bounds_that_do_not_bind_change_nothing():
    replies = [(honest(p), n) for p, n in enumerate(SIZES)]
    plain, _ = aggregate(FedAvg(num_clients=5), replies)
    loose, _ = aggregate(FedAvg(num_clients=5, clip_update_norm=1e9, max_examples=10**6), replies)
    assert all(np.array_equal(a, b) for a, b in zip(plain, loose))
    for a, t in zip(plain, honest_mean(range(5), SIZES)):
        np.testing.assert_allclose(a, t, rtol=1e-5, atol=1e-7)


def test_fedrep_clips_its_body_update():
    strategy = FedRep(num_clients=2, clip_update_norm=1.0)
    big = [np.full(a.shape, 100.0, np.float32) for a in GLOBAL]
    out, _ = aggregate(strategy, [(big, 1), (big, 1)])
    assert update_norm_of(out) == pytest.approx(1.0, rel=1e-5)


def update_norm_of(arrays) -> float:
    return float(np.sqrt(sum(np.sum(np.square(a, dtype=np.float64)) for a in arrays)))


@pytest.mark.parametrize("algorithm", ["feddar-sa", "fedgp", "fedora", "pfedfda", "fmtl", "local"])
@pytest.mark.parametrize("option", [{"clip-update-norm": 1.0}, {"aggregate": "trimmed-mean"}])
def test_algorithms_whose_replies_are_not_a_plain_mean_refuse_the_bounds(algorithm, option):
    experiment = parse_experiment({"algorithm": algorithm, "num-clients": 4, "num-server-rounds": 2, **option})
    with pytest.raises(ConfigError, match="cannot be used: .*leave them off for this algorithm"):
        build_strategy(experiment)


def test_bad_values_are_refused():
    for key, value, message in (("clip-update-norm", -1.0, "clip-update-norm=-1.0 must be > 0"),
                                ("aggregate", "median", "aggregate='median' is not allowed"),
                                ("trim-fraction", 0.5, "trim-fraction=0.5 is out of range"),
                                ("max-examples", -2, "max-examples=-2 must be >= 1")):
        with pytest.raises(ConfigError, match=message):
            parse_experiment({key: value})
    with pytest.raises(ConfigError, match="clip_update_norm .* must be a number > 0"):
        FedAvg(num_clients=2, clip_update_norm=0.0)
