"""Client-level DP maths (flwr_pfl.core.dp) against closed forms, Flower's own helpers and the
papers' definitions (McMahan et al. 2018; Andrew et al. 2021)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flwr_pfl.core.dp import (
    adapt_clip_norm,
    clip_to_norm,
    noise_std,
    noisy_unclipped_fraction,
    private_mean,
    update_noise_multiplier,
)


def norm(arrays) -> float:
    return math.sqrt(sum(float(np.sum(np.square(a))) for a in arrays))


def updates(seed: int, scales=(0.1, 1.0, 5.0)) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.normal(size=(4, 3)) * s, rng.normal(size=5) * s] for s in scales]


def test_clipping_scales_to_the_norm_and_keeps_the_direction():
    update = [np.array([3.0, 0.0]), np.array([[4.0]])]  # norm 5
    clipped, within = clip_to_norm(update, 2.0)
    assert not within and norm(clipped) == pytest.approx(2.0)
    np.testing.assert_allclose(clipped[0], [1.2, 0.0])
    np.testing.assert_allclose(clipped[1], [[1.6]])
    same, within = clip_to_norm(update, 5.0)  # on the boundary: within, unchanged
    assert within and all(np.array_equal(a, b) for a, b in zip(same, update))
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        clip_to_norm(update, 0.0)
    low, _ = clip_to_norm([np.array([0.1, 0.2], np.float32)], 1.0)  # float64 out: sums do not round
    assert low[0].dtype == np.float64


def test_noise_std_is_z_c_over_m_as_in_flowers_helper():
    from flwr.supercore.differential_privacy import compute_stdv

    for z, c, m in ((1.0, 1.0, 10), (0.7, 2.5, 3), (3.0, 0.1, 100), (2.0, 0.5, 1)):
        assert noise_std(z, c, m) == pytest.approx(z * c / m)
        assert noise_std(z, c, m) == pytest.approx(compute_stdv(z, c, m))


def test_without_noise_the_mean_is_the_clipped_sum_over_the_sampled_count():
    """Three updates of five sampled clients (two dropped out): the sum of the clipped updates
    divided by 5, not 3; so nobody's weight grows when others drop out."""
    ups = updates(0)
    mean, bits = private_mean(ups, 1.0, 0.0, 5, np.random.default_rng(0))
    clipped = [clip_to_norm(u, 1.0)[0] for u in ups]
    for i, got in enumerate(mean):
        np.testing.assert_allclose(got, sum(c[i] for c in clipped) / 5, rtol=1e-12)
    assert bits == [norm(u) <= 1.0 for u in ups] == [True, False, False]


def test_one_clients_influence_on_the_sum_is_at_most_the_clip_norm():
    """The sensitivity the noise is calibrated to: adding any update, however large, moves the
    (noiseless) sum by at most C."""
    ups = updates(1)
    without, _ = private_mean(ups, 0.5, 0.0, 10, np.random.default_rng(0))
    for scale in (1e-3, 1.0, 1e6):
        with_it, _ = private_mean(ups + [[a * scale for a in ups[0]]], 0.5, 0.0, 10, np.random.default_rng(0))
        assert norm([10 * (a - b) for a, b in zip(with_it, without)]) <= 0.5 + 1e-9


@pytest.mark.parametrize("seed", range(5))
def test_the_noise_has_the_stated_standard_deviation_and_no_bias(seed):
    """200,000 coordinates per draw: the sample std is within 1 % of z C / m (its own standard
    error is 0.16 %) and the mean within 5 standard errors of 0."""
    ups = [[np.zeros(200_000)] for _ in range(4)]
    z, c, m = 1.3, 0.8, 7
    mean, _ = private_mean(ups, c, z, m, np.random.default_rng(seed))
    noise = mean[0]
    expected = z * c / m
    assert np.std(noise) == pytest.approx(expected, rel=0.01)
    assert abs(np.mean(noise)) < 5 * expected / math.sqrt(noise.size)


def test_equal_to_flowers_server_side_fixed_clipping_on_a_case_they_share():
    """Flower's DifferentialPrivacyServerSideFixedClipping (Message API) around FedAvg, with equal
    client weights and no noise, adopts global + mean of the clipped updates: ours exactly."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    global_arrays = [np.zeros((4, 3)), np.ones(5)]
    ups = updates(2)
    replies = []
    for i, update in enumerate(ups):
        sent = Message(RecordDict(), dst_node_id=10 + i, message_type="train")
        content = RecordDict({"arrays": ArrayRecord([g + u for g, u in zip(global_arrays, update)]),
                              "metrics": MetricRecord({"num-examples": 7})})
        replies.append(Message(content, reply_to=sent))
    flower = DifferentialPrivacyServerSideFixedClipping(FedAvg(), 0.0, 1.0, len(ups))
    flower.current_arrays = ArrayRecord(global_arrays)
    theirs, _ = flower.aggregate_train(1, replies)
    mean, _ = private_mean(ups, 1.0, 0.0, len(ups), np.random.default_rng(0))
    for got, g, m in zip(theirs.to_numpy_ndarrays(), global_arrays, mean):
        np.testing.assert_allclose(got, g + m, rtol=1e-12, atol=1e-15)


def test_the_noise_is_the_generators_own_draw_added_to_the_sum():
    """Exactly (sum of clipped + rng.normal(0, z C, shape)) / m, for a given generator state:
    the noise is added (not subtracted) and drawn once per array, in order."""
    ups = updates(4)
    mean, _ = private_mean(ups, 0.7, 1.3, 4, np.random.default_rng(9))
    rng = np.random.default_rng(9)
    clipped = [clip_to_norm(u, 0.7)[0] for u in ups]
    for i, got in enumerate(mean):
        total = sum(c[i] for c in clipped)
        np.testing.assert_allclose(got, (total + rng.normal(0.0, 1.3 * 0.7, size=total.shape)) / 4, rtol=1e-12)


def test_a_single_update_is_its_clipped_self_over_m():
    mean, bits = private_mean([[np.array([3.0, 4.0])]], 1.0, 0.0, 2, np.random.default_rng(0))
    np.testing.assert_allclose(mean[0], [0.3, 0.4])
    assert bits == [False]


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="^private_mean needs at least one update$"):
        private_mean([], 1.0, 1.0, 3, np.random.default_rng(0))
    with pytest.raises(ValueError, match="4 updates for 3 sampled clients"):
        private_mean(updates(0, (1, 1, 1, 1)), 1.0, 1.0, 3, np.random.default_rng(0))
    with pytest.raises(ValueError, match="^the updates do not share one layout$"):
        private_mean([[np.zeros(2)], [np.zeros(3)]], 1.0, 1.0, 3, np.random.default_rng(0))
    with pytest.raises(ValueError, match="noise_multiplier must be >= 0"):
        private_mean(updates(0), 1.0, -1.0, 3, np.random.default_rng(0))
    with pytest.raises(ValueError, match="num_sampled must be >= 1"):
        noise_std(1.0, 1.0, 0)


# ------------------------------------------------------------------------------ adaptive clipping
def test_the_update_noise_multiplier_of_theorem_1():
    """z_u = (z^-2 - (2 sigma_b)^-2)^(-1/2): composing the updates' Gaussian (z_u) with the
    count's (sensitivity 1/2, std sigma_b, so multiplier 2 sigma_b) gives multiplier z again."""
    for z, sigma_b in ((1.0, 5.0), (0.5, 0.3), (2.0, 1.5)):
        z_u = update_noise_multiplier(z, sigma_b)
        assert z_u > z
        assert (z_u ** -2 + (2 * sigma_b) ** -2) ** -0.5 == pytest.approx(z)
    with pytest.raises(ValueError, match=r"noise \(0.5\) must exceed noise_multiplier / 2 \(0.5\) for the updates"):
        update_noise_multiplier(1.0, 0.5)
    with pytest.raises(ValueError, match="noise_multiplier must be > 0"):
        update_noise_multiplier(0.0, 1.0)


def test_the_noiseless_unclipped_fraction_is_the_share_within_the_norm():
    rng = np.random.default_rng(0)
    assert noisy_unclipped_fraction([True, False, True, True], 0.0, 4, rng) == pytest.approx(0.75)
    # m counts every sampled client: the one that did not answer counts as half in, half out
    assert noisy_unclipped_fraction([True, True], 0.0, 3, rng) == pytest.approx((2 + 0.5) / 3)
    assert noisy_unclipped_fraction([False], 0.0, 1, rng) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="^num_sampled must be >= 1, got 0$"):
        noisy_unclipped_fraction([], 1.0, 0, rng)
    # the noise is the generator's draw, added to the centred count
    draw = np.random.default_rng(4).normal(0.0, 0.7)
    got = noisy_unclipped_fraction([True, False, True], 0.7, 3, np.random.default_rng(4))
    assert got == pytest.approx((0.5 - 0.5 + 0.5 + draw) / 3 + 0.5)


@pytest.mark.parametrize("seed", range(5))
def test_the_count_noise_has_the_stated_spread(seed):
    rng = np.random.default_rng(seed)
    draws = np.array([noisy_unclipped_fraction([True] * 10, 2.0, 10, rng) for _ in range(20_000)])
    assert np.mean(draws) == pytest.approx(1.0, abs=5 * 0.2 / math.sqrt(draws.size))
    assert np.std(draws) == pytest.approx(2.0 / 10, rel=0.03)


def test_the_clip_norm_grows_when_too_many_updates_are_clipped_and_shrinks_otherwise():
    """C exp(-eta (b - gamma)): every update clipped (b = 0) raises C; none clipped lowers it;
    b = gamma keeps it (Andrew et al., Alg. 1)."""
    assert adapt_clip_norm(1.0, 0.0, 0.5, 0.2) == pytest.approx(math.exp(0.1))
    assert adapt_clip_norm(1.0, 1.0, 0.5, 0.2) == pytest.approx(math.exp(-0.1))
    assert adapt_clip_norm(2.0, 0.3, 0.3, 0.7) == pytest.approx(2.0)


def test_adaptive_clipping_converges_to_the_target_quantile_of_the_norms():
    """Noiseless, 100 clients whose update norms are 1 .. 100: C settles near the 30th
    percentile for gamma = 0.3, from far below and from far above."""
    ups = [[np.array([float(k)])] for k in range(1, 101)]
    for start in (0.01, 1000.0):
        c = start
        for _ in range(400):
            _, bits = private_mean(ups, c, 0.0, 100, np.random.default_rng(0))
            c = adapt_clip_norm(c, noisy_unclipped_fraction(bits, 0.0, 100, np.random.default_rng(0)), 0.3, 0.2)
        assert 28 <= c <= 32, (start, c)
