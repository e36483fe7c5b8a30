"""IFCA's mathematics (flwr_pfl.core.ifca) against sums written by hand, and the fresh
initialisation of the further clusters (flwr_pfl.models.reinit) against models built under the
same seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from flwr_pfl.core.ifca import aggregate, aggregate_clusters, assign_cluster, check_options, cluster_init_seed, cluster_sizes
from flwr_pfl.errors import ConfigError
from flwr_pfl.models.reinit import redrawn_arrays
from flwr_pfl.models.split import split_model
from flwr_pfl.training import get_arrays, group_keys


# ------------------------------------------------------------------------------ the cluster estimate
@pytest.mark.parametrize("losses, expected", [
    ([0.9, 0.4, 0.7], 1),
    ([0.2, 0.4, 0.7, 0.1], 3),
    ([0.5], 0),
    ([0.3, 0.3, 0.1, 0.1], 2),   # ties: the lowest index
    ([0.3, 0.3], 0),
    ([float("nan"), 2.0, 1.0], 2),  # a diverged cluster model never wins
    ([float("inf"), float("nan"), 5.0], 2),
    ([float("nan"), float("nan")], 0),  # nothing finite: cluster 0
    ([-1.0, -2.0], 1),  # a loss may be negative (a user's loss function)
])
def test_the_cluster_is_the_argmin_of_the_losses(losses, expected):
    assert assign_cluster(losses) == expected


def test_the_argmin_matches_a_search_written_by_hand_on_random_losses():
    rng = np.random.default_rng(0)
    for _ in range(200):
        losses = rng.integers(0, 4, size=int(rng.integers(1, 6))).astype(float)  # many ties
        best = 0
        for j, value in enumerate(losses):
            if value < losses[best]:
                best = j
        assert assign_cluster(list(losses)) == best


def test_no_losses_is_refused():
    with pytest.raises(ValueError, match="one loss per cluster"):
        assign_cluster([])


def test_cluster_sizes_count_each_cluster_and_the_empty_ones():
    assert cluster_sizes([2, 0, 2, 2], 4) == [1, 0, 3, 0]
    assert cluster_sizes([], 2) == [0, 0]


# ------------------------------------------------------------------------------ the server's averages
def models(values: list[float]) -> list[list[np.ndarray]]:
    """One model per value: a float32 (2, 2) array and an int64 counter (the BatchNorm step count)."""
    return [[np.full((2, 2), v, np.float32), np.array(int(10 * v), np.int64)] for v in values]


def test_each_cluster_is_the_example_weighted_mean_of_its_members_and_an_unpicked_one_is_kept():
    previous = [[np.full((2, 2), -1.0, np.float32), np.array(7, np.int64)] for _ in range(3)]
    replies = models([1.0, 2.0, 4.0, 8.0])
    clusters, weights = [2, 0, 2, 0], [10, 30, 30, 10]
    new = aggregate_clusters(previous, replies, clusters, weights)
    # cluster 0: replies 1 and 3 with weights 30 and 10; cluster 2: replies 0 and 2 with 10 and 30
    np.testing.assert_allclose(new[0][0], np.full((2, 2), (30 * 2.0 + 10 * 8.0) / 40))
    np.testing.assert_allclose(new[2][0], np.full((2, 2), (10 * 1.0 + 30 * 4.0) / 40))
    assert new[0][1].dtype == np.int64 and int(new[0][1]) == round((30 * 20 + 10 * 80) / 40)
    assert int(new[2][1]) == round((10 * 10 + 30 * 40) / 40)
    assert new[0][0].dtype == np.float32
    # cluster 1: nobody picked it; its arrays are the previous ones, untouched
    assert all(a is b for a, b in zip(new[1], previous[1]))


def test_one_cluster_is_the_fedavg_mean_to_the_bit():
    from flwr_pfl.core.aggregation import weighted_average

    rng = np.random.default_rng(1)
    replies = [[rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(5).astype(np.float32)] for _ in range(4)]
    weights = [3, 17, 5, 11]
    (only,) = aggregate_clusters([[np.zeros((3, 4), np.float32), np.zeros(5, np.float32)]], replies, [0] * 4, weights)
    for a, b in zip(only, weighted_average(replies, weights)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_with_a_shared_body_the_body_is_averaged_over_everyone_and_the_heads_per_cluster():
    bodies = [[np.full(3, v, np.float64)] for v in (1.0, 2.0, 6.0)]
    heads = [[np.full(2, v, np.float64)] for v in (10.0, 20.0, 60.0)]
    previous = [[np.full(2, -5.0)], [np.full(2, -6.0)]]
    body, parts = aggregate(previous, bodies, heads, [1, 0, 1], [1, 2, 3])
    np.testing.assert_allclose(body[0], np.full(3, (1 * 1.0 + 2 * 2.0 + 3 * 6.0) / 6))
    np.testing.assert_allclose(parts[0][0], np.full(2, 20.0))
    np.testing.assert_allclose(parts[1][0], np.full(2, (1 * 10.0 + 3 * 60.0) / 4))
    body, parts = aggregate(previous, [[], [], []], heads, [1, 1, 1], [1, 2, 3])  # no shared body
    assert body == [] and parts[0][0] is previous[0][0]


def test_bad_cluster_indices_and_lengths_are_refused():
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        aggregate_clusters([[np.zeros(1)]] * 2, models([1.0]), [2], [1])
    with pytest.raises(ValueError, match="2 models, 1 cluster indices"):
        aggregate_clusters([[np.zeros(1)]] * 2, models([1.0, 2.0]), [0], [1])


def test_options_are_checked_with_their_keys():
    check_options(1, True, str)
    with pytest.raises(ConfigError, match="ifca.num-clusters must be an integer >= 1"):
        check_options(0, False, lambda o: f"ifca.{o}")
    with pytest.raises(ConfigError, match="num-clusters"):
        check_options(True, False, str)
    with pytest.raises(ConfigError, match="ifca.share-body must be true or false"):
        check_options(2, "yes", lambda o: f"ifca.{o}")


def test_cluster_seeds_are_distinct_and_fixed():
    seeds = {cluster_init_seed(s, j) for s in range(5) for j in range(6)}
    assert len(seeds) == 30
    assert cluster_init_seed(3, 2) == cluster_init_seed(3, 2)
    assert all(0 <= s < 2**63 for s in seeds)


# ------------------------------------------------------------------------------ fresh initialisations
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.bn = nn.BatchNorm1d(7)
        self.fc2 = nn.Linear(7, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def test_a_redrawn_model_is_the_model_built_under_that_seed_and_the_original_is_untouched():
    torch.manual_seed(0)
    model = split_model(Net(), "fc2")
    with torch.no_grad():
        model.module.bn.running_mean.fill_(3.0)  # state a fresh model does not have
    before = [a.copy() for a in get_arrays(model)]
    keys = group_keys(model, "all")
    state = torch.random.get_rng_state()
    drawn = redrawn_arrays(model, keys, 123)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state is left alone
    torch.manual_seed(123)
    built = split_model(Net(), "fc2")
    for a, b in zip(drawn, get_arrays(built)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert all(np.array_equal(a, b) for a, b in zip(get_arrays(model), before))
    assert not np.array_equal(drawn[0], before[0])
    assert not np.array_equal(redrawn_arrays(model, keys, 124)[0], drawn[0])


def test_only_the_modules_within_the_keys_are_redrawn():
    torch.manual_seed(0)
    model = split_model(Net(), "fc2")
    heads = group_keys(model, "heads")
    drawn = redrawn_arrays(model, heads, 9)
    assert len(drawn) == len(heads) == 2
    current = dict(zip(group_keys(model, "all"), get_arrays(model)))
    assert not np.array_equal(drawn[0], current[heads[0]])
    torch.manual_seed(9)
    fresh = nn.Linear(7, 3)  # the head alone, drawn first under the seed
    np.testing.assert_array_equal(drawn[0], fresh.weight.detach().numpy())
    np.testing.assert_array_equal(drawn[1], fresh.bias.detach().numpy())


def test_a_model_with_nothing_to_reset_is_refused():
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.w

    model = Bare()
    with pytest.raises(ConfigError, match="reset_parameters"):
        redrawn_arrays(model, ["w"], 1)
