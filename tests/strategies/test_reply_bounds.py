"""One bad client cannot wreck the model unnoticed: with the reply bounds on, a reply of huge
values or one claiming 10^12 examples leaves the aggregate near the honest clients' mean; off
they wreck it, as the papers' plain weighted mean does. The outlier screen, on by default,
rejects an absurdly large reply outright. Algorithms whose replies are not model updates
refuse clipping and trimming."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.common import parameters_to_ndarrays

from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.server_app import build_strategy
from flwr_pfl.errors import ConfigError, DivergedError
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
    plain, _ = aggregate(FedAvg(num_clients=5, outlier_norm_ratio=None), replies)
    assert distance(plain, target) > 1e5  # wrecked
    screened, metrics = aggregate(FedAvg(num_clients=5), replies)  # the default screen rejects it
    assert metrics["num_rejected"] == 1.0
    for a, t in zip(screened, target):
        np.testing.assert_allclose(a, t, rtol=1e-5, atol=1e-7)  # exactly the honest weighted mean
    clipped, _ = aggregate(FedAvg(num_clients=5, clip_update_norm=0.5, outlier_norm_ratio=None), replies)
    # the attacker moves the mean by at most its weight times the clip norm
    # it moves the mean by at most its weight times (the clip norm + the honest mean's norm)
    weight = SIZES[4] / sum(SIZES)
    assert distance(clipped, target) <= weight * (0.5 + distance(target, [0 * t for t in target])) + 1e-6
    # exactly: the attacker's update (all coordinates equal, 9 of them) scaled to norm 0.5, then
    # the example-weighted mean of the five replies
    attacker = [np.full(a.shape, 0.5 / 3.0) for a in GLOBAL]
    for got, t, c in zip(clipped, target, attacker):
        np.testing.assert_allclose(got, (1 - weight) * t + weight * c, rtol=1e-5, atol=1e-7)
    trimmed, _ = aggregate(FedAvg(num_clients=5, aggregate="trimmed-mean", trim_fraction=0.2, outlier_norm_ratio=None),
                           replies)
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


# ------------------------------------------------------------------------------ the outlier screen (on by default)
def test_the_screen_spares_honest_replies_of_very_different_sizes_bit_for_bit():
    """Replies 1x to 300x the smallest one's norm (below the default ratio of 1000) are all kept,
    and the aggregate is byte-identical to the unscreened one."""
    replies = [([a * scale for a in honest(p)], n) for p, (n, scale) in enumerate(zip(SIZES, (1, 300, 5, 40, 0.5)))]
    screened, metrics = aggregate(FedAvg(num_clients=5), replies)
    plain, _ = aggregate(FedAvg(num_clients=5, outlier_norm_ratio=None), replies)
    assert metrics["num_rejected"] == 0.0
    assert all(np.array_equal(a, b) for a, b in zip(screened, plain))


def test_a_reply_over_the_ratio_times_the_upper_median_is_rejected_and_one_under_it_kept():
    base = [np.full(a.shape, 0.1, np.float32) for a in GLOBAL]  # norm 0.3 (9 values of 0.1)
    for scale, rejected in ((9.0, 0.0), (11.0, 1.0)):  # ratio 10: the limit is 10 x 0.3
        replies = [(base, n) for n in SIZES[:4]] + [([a * scale for a in base], SIZES[4])]
        _, metrics = aggregate(FedAvg(num_clients=5, outlier_norm_ratio=10.0), replies)
        assert metrics["num_rejected"] == rejected, scale


def test_with_fewer_than_three_replies_the_previous_rounds_median_is_the_reference():
    strategy = FedAvg(num_clients=5)
    aggregate(strategy, [(honest(p), n) for p, n in enumerate(SIZES)])
    assert strategy.norm_reference is not None
    huge = [np.full(a.shape, 1e30, np.float32) for a in GLOBAL]
    out, metrics = aggregate(strategy, [(honest(0), SIZES[0]), (huge, SIZES[1])])
    assert metrics["num_rejected"] == 1.0
    assert all(np.array_equal(a, b) for a, b in zip(out, honest(0)))  # the honest reply alone


def test_an_aggregate_that_blows_up_ends_the_run_instead_of_reaching_the_clients():
    """With no reference (a first round of two replies) the huge reply passes the screen; the
    aggregate's norm then grows a billionfold and the strategy raises rather than send it."""
    strategy = FedAvg(num_clients=5)
    huge = [np.full(a.shape, 1e30, np.float32) for a in GLOBAL]
    with pytest.raises(DivergedError, match="round 1: the aggregate of the accepted replies has norm .* more than 1000"):
        aggregate(strategy, [(honest(0), SIZES[0]), (huge, SIZES[1])])
    assert all(np.array_equal(a, g) for a, g in zip(strategy.global_arrays, GLOBAL))  # not adopted
    off = FedAvg(num_clients=5, outlier_norm_ratio=None)
    out, _ = aggregate(off, [(honest(0), SIZES[0]), (huge, SIZES[1])])
    assert update_norm_of(out) > 1e29  # off: the papers' plain mean takes it


def test_the_ratio_is_checked():
    for value in (1.0, 0.5, -3.0, True, "big"):
        with pytest.raises(ConfigError, match="outlier_norm_ratio .* must be a number > 1 or None"):
            FedAvg(num_clients=2, outlier_norm_ratio=value)
    with pytest.raises(ConfigError, match="outlier-norm-ratio=1.0 is out of range; must be > 1, or 0"):
        parse_experiment({"outlier-norm-ratio": 1.0})
    assert parse_experiment({"outlier-norm-ratio": 0.0}).run.reply_bounds["outlier_norm_ratio"] is None
    assert parse_experiment({}).run.reply_bounds["outlier_norm_ratio"] == 1000.0


# ------------------------------------------------------------------------------ partition ids
def _round(strategy, server_round, replies):
    strategy.global_arrays = [a.copy() for a in GLOBAL]
    results = [(FakeProxy(cid), fit_res(arrays, n, pid)) for cid, pid, arrays, n in replies]
    _, metrics = strategy.aggregate_fit(server_round, results, [])
    return metrics


def test_a_node_cannot_claim_another_partition_after_its_first_reply():
    strategy = FedAvg(num_clients=5)
    _round(strategy, 1, [("a", 0, honest(0), 10), ("b", 1, honest(1), 30)])
    metrics = _round(strategy, 2, [("a", 1, honest(0), 10), ("b", 1, honest(1), 30)])  # node a claims partition 1
    assert metrics["num_rejected"] == 1.0
    assert strategy.partition_of == {"a": 0, "b": 1}


def test_two_replies_for_one_partition_in_a_round_keep_the_first_in_partition_order():
    strategy = FedAvg(num_clients=5)
    metrics = _round(strategy, 1, [("a", 2, honest(0), 10), ("b", 2, honest(1), 30), ("c", 3, honest(3), 20)])
    assert metrics["num_rejected"] == 1.0
    assert sorted(strategy.partition_of.values()) == [2, 3]


@pytest.mark.parametrize("pid", [5, -2, 1.5, "x", True])
def test_a_partition_id_outside_the_federation_is_rejected(pid):
    strategy = FedAvg(num_clients=5, stop_if_nothing_trains=False)  # the round's only reply is rejected
    results = [(FakeProxy("a"), fit_res(honest(0), 10, metrics={"partition_id": pid}))]
    strategy.global_arrays = [a.copy() for a in GLOBAL]
    params, metrics = strategy.aggregate_fit(1, results, [])
    assert params is None and metrics["num_rejected"] == 1.0
