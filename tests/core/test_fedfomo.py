"""FedFomo's mathematics (flwr_pfl/core/fedfomo.py) against hand computations: the raw first-order
weights (a negative improvement, a distance of 0, a NaN loss), their normalisation (the all-zero
case), the distance over the parameters only, the update (integer entries kept), the affinity
update, the exploration rate and the epsilon-greedy choice (epsilon 0 is the top M by affinity;
epsilon 1 the generator's random order; a mixed epsilon replayed slot by slot)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flwr_pfl.core.fedfomo import (
    exploration_rate,
    first_order_weights,
    fomo_update,
    normalized_weights,
    parameter_distance,
    select_candidates,
    update_affinity,
)


# ------------------------------------------------------------------------------ weights
def test_raw_weights_are_loss_improvement_over_distance_with_guards():
    # own loss 1.0; candidate 0 better, 1 worse (negative), 2 better but at distance 0, 3 better, 4 NaN
    raw = first_order_weights(1.0, [0.5, 1.5, 0.2, 0.7, math.nan], [2.0, 1.0, 0.0, 0.3, 1.0])
    assert raw.dtype == np.float64
    np.testing.assert_allclose(raw, [0.25, -0.5, 0.0, 1.0, 0.0], rtol=0, atol=1e-15)
    # an infinite loss (a diverged model) weighs 0, not -inf
    assert first_order_weights(1.0, [math.inf], [1.0]).tolist() == [0.0]
    assert first_order_weights(0.4, [], []).shape == (0,)
    with pytest.raises(ValueError, match="one loss per distance"):
        first_order_weights(1.0, [0.5, 0.4], [1.0])
    with pytest.raises(ValueError, match=">= 0"):
        first_order_weights(1.0, [0.5], [-1.0])


def test_normalisation_clips_negatives_and_an_all_zero_row_stays_zero():
    np.testing.assert_allclose(normalized_weights(np.array([0.25, -0.5, 0.0, 1.0])), [0.2, 0.0, 0.0, 0.8], atol=1e-15)
    assert normalized_weights(np.array([-0.25, 0.0, -3.0])).tolist() == [0.0, 0.0, 0.0]
    assert normalized_weights(np.zeros(0)).shape == (0,)


def test_distance_counts_only_the_masked_arrays():
    own = [np.array([[1.0, 2.0]], np.float32), np.array([5.0, 5.0], np.float32), np.array(3, np.int64)]
    other = [np.array([[4.0, -2.0]], np.float32), np.array([0.0, 0.0], np.float32), np.array(9, np.int64)]
    # only the first array is a parameter: sqrt(3^2 + 4^2) = 5; the statistics and the counter do not count
    assert parameter_distance(own, other, [True, False, False]) == 5.0
    assert parameter_distance(own, other, [True, True, False]) == pytest.approx(math.sqrt(25 + 50), abs=1e-12)
    with pytest.raises(ValueError, match="mask entries"):
        parameter_distance(own, other, [True])


# ------------------------------------------------------------------------------ the update
def test_update_steps_from_the_own_model_and_keeps_integer_entries():
    own = [np.array([1.0, -1.0], np.float32), np.array(4, np.int64)]
    a = [np.array([3.0, 1.0], np.float32), np.array(10, np.int64)]
    b = [np.array([-1.0, 5.0], np.float32), np.array(20, np.int64)]
    # theta_i + 0.3 (a - theta_i) + 0.2 (b - theta_i) = 0.5 theta_i + 0.3 a + 0.2 b (weights not summing to 1)
    out = fomo_update(own, [a, b], np.array([0.3, 0.2]))
    expected = [0.5 * 1.0 + 0.3 * 3.0 + 0.2 * -1.0, 0.5 * -1.0 + 0.3 * 1.0 + 0.2 * 5.0]
    np.testing.assert_allclose(out[0], expected, rtol=1e-6)
    assert out[0].dtype == np.float32 and out[1].dtype == np.int64 and int(out[1]) == 4
    # normalised weights: the convex combination of the candidates
    np.testing.assert_allclose(fomo_update(own, [a, b], np.array([0.25, 0.75]))[0], [0.0, 4.0], atol=1e-6)
    # no positive weight: the own model, unchanged, as a copy
    kept = fomo_update(own, [a, b], np.zeros(2))
    assert kept[0].tolist() == [1.0, -1.0] and kept[0] is not own[0]
    with pytest.raises(ValueError, match="one weight per candidate"):
        fomo_update(own, [a, b], np.ones(3))


def test_affinity_adds_raw_weights_into_the_clients_row():
    p = np.zeros((3, 3))
    update_affinity(p, 1, [2, 0], np.array([0.5, -0.25]))
    update_affinity(p, 1, [2], np.array([0.125]))
    update_affinity(p, 0, [1], np.array([2.0]))
    assert p.tolist() == [[0.0, 2.0, 0.0], [-0.25, 0.0, 0.625], [0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="one weight per candidate"):
        update_affinity(p, 0, [1, 2], np.array([1.0]))


# ------------------------------------------------------------------------------ model download
def test_exploration_rate_decays_linearly_from_the_first_round_and_stops_at_zero():
    assert exploration_rate(0.3, 0.05, 1) == 0.3
    assert exploration_rate(0.3, 0.05, 2) == pytest.approx(0.25)
    assert exploration_rate(0.3, 0.05, 6) == pytest.approx(0.05)
    assert exploration_rate(0.3, 0.05, 8) == 0.0
    assert exploration_rate(0.2, 0.0, 100) == 0.2
    with pytest.raises(ValueError, match=">= 1"):
        exploration_rate(0.3, 0.05, 0)


def test_epsilon_zero_takes_the_top_models_by_affinity():
    row = np.array([0.0, 0.7, -1.0, 2.0, 0.1, 0.7001, 9.0])  # client 6 is the chooser; it is not in the pool
    pool = [0, 1, 2, 3, 4, 5]
    for seed in range(5):
        assert select_candidates(row, pool, 3, 0.0, np.random.default_rng(seed)) == [3, 5, 1]
    assert select_candidates(row, pool, 10, 0.0, np.random.default_rng(0)) == [3, 5, 1, 4, 0, 2]  # M > pool: all
    assert select_candidates(row, [], 3, 0.5, np.random.default_rng(0)) == []
    with pytest.raises(ValueError, match="repeats"):
        select_candidates(row, [1, 1], 1, 0.0, np.random.default_rng(0))


def test_ties_are_broken_by_the_generator_and_repeat_with_its_seed():
    row = np.zeros(8)
    picks = {tuple(select_candidates(row, range(8), 3, 0.0, np.random.default_rng(seed))) for seed in range(12)}
    assert len(picks) > 1  # not always the lowest ids
    for seed in range(4):
        first = select_candidates(row, range(8), 3, 0.0, np.random.default_rng(seed))
        assert select_candidates(row, range(8), 3, 0.0, np.random.default_rng(seed)) == first
        # the tie-break is the generator's first permutation of the pool
        assert first == list(np.arange(8)[np.random.default_rng(seed).permutation(8)][:3])


def test_epsilon_one_takes_the_generators_random_order():
    row = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    pool = [0, 2, 3, 5]
    for seed in range(5):
        rng = np.random.default_rng(seed)
        rng.permutation(4)  # the tie-breaking draw
        order = np.array(pool)[rng.permutation(4)]
        assert select_candidates(row, pool, 3, 1.0, np.random.default_rng(seed)) == order[:3].tolist()


def test_a_mixed_epsilon_follows_the_authors_slot_by_slot_rule():
    """Replayed with index pointers: per slot one uniform; below epsilon the next random model not
    yet taken, else the next best by affinity not yet taken."""
    row = np.array([0.3, -0.2, 0.9, 0.1, 0.5, 0.0, 0.8])
    pool = list(range(7))
    seen = set()
    for seed in range(30):
        rng = np.random.default_rng(seed)
        tie = np.array(pool)[rng.permutation(7)]
        best = sorted(pool, key=lambda j: -row[j])  # affinities are distinct: no tie to break
        rand = np.array(pool)[rng.permutation(7)].tolist()
        taken: list[int] = []
        for _ in range(4):
            explore = rng.uniform() < 0.4
            source = rand if explore else best
            taken.append(next(j for j in source if j not in taken))
            source.remove(taken[-1])
        assert len(tie) == 7
        got = select_candidates(row, pool, 4, 0.4, np.random.default_rng(seed))
        assert got == taken
        seen.add(tuple(got))
    assert (2, 6, 4, 0) in seen and len(seen) > 3  # the pure top-4 occurs, and so do explorations
