"""Seeded index utilities: exact apportionment, stratified subsampling, balanced assignment."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_pfl.data.sampling import (
    apportion,
    balanced_assignment,
    stage_rng,
    stage_seed,
    stratified_subsample,
)


@pytest.mark.parametrize("total", [0, 1, 7, 500, 1001])
def test_apportion_sums_exactly_and_stays_within_one(total: int) -> None:
    weights = np.random.default_rng(total).dirichlet(np.ones(6) * 0.3)
    counts = apportion(total, weights)
    assert counts.sum() == total and (counts >= 0).all()
    assert np.abs(counts - total * weights).max() < 1.0


def test_stage_seeds_differ_by_stage_seed_and_key() -> None:
    seeds = {stage_seed(0, "a"), stage_seed(1, "a"), stage_seed(0, "b"), stage_seed(0, "a", 3)}
    assert len(seeds) == 4 and stage_seed(0, "a") == stage_seed(0, "a")
    assert stage_rng(5, "x").random() == stage_rng(5, "x").random()


def test_stratified_subsample_keeps_label_shares() -> None:
    labels = np.repeat(np.arange(4), [400, 300, 200, 100])
    keep = stratified_subsample(labels, 100, np.random.default_rng(0))
    assert len(keep) == 100 and len(np.unique(keep)) == 100
    assert np.bincount(labels[keep]).tolist() == [40, 30, 20, 10]
    assert len(stratified_subsample(labels, 5000, np.random.default_rng(0))) == 1000


def test_balanced_assignment_is_balanced_overall_and_per_label() -> None:
    labels = np.random.default_rng(1).integers(0, 10, 1003)
    groups = balanced_assignment(labels, 4, np.random.default_rng(2))
    counts = np.bincount(groups, minlength=4)
    assert counts.sum() == 1003 and counts.max() - counts.min() <= 1
    for c in range(10):
        per_label = np.bincount(groups[labels == c], minlength=4)
        assert per_label.max() - per_label.min() <= 1
    again = balanced_assignment(labels, 4, np.random.default_rng(2))
    other = balanced_assignment(labels, 4, np.random.default_rng(3))
    assert (groups == again).all() and (groups != other).any()


def test_balanced_assignment_in_shares_overall_and_per_label() -> None:
    labels = np.random.default_rng(4).integers(0, 10, 3000)
    shares = (6, 1, 3)
    groups = balanced_assignment(labels, 3, np.random.default_rng(5), shares)
    expected = np.array(shares) / 10
    assert np.abs(np.bincount(groups, minlength=3) - 3000 * expected).max() <= 1
    for c in range(10):
        in_label = labels == c
        per_label = np.bincount(groups[in_label], minlength=3)
        assert np.abs(per_label - in_label.sum() * expected).max() <= 2


def test_equal_shares_deal_exactly_as_no_shares() -> None:
    labels = np.random.default_rng(1).integers(0, 10, 1003)
    plain = balanced_assignment(labels, 4, np.random.default_rng(2))
    assert (balanced_assignment(labels, 4, np.random.default_rng(2), (1, 1, 1, 1)) == plain).all()
    assert (balanced_assignment(labels, 4, np.random.default_rng(2), (2, 2, 2, 2)) == plain).all()


@pytest.mark.parametrize("shares", [(1, 2), (1, 0, 2), (3, -1, 1)])
def test_balanced_assignment_rejects_bad_shares(shares: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="share"):
        balanced_assignment(np.zeros(30, dtype=np.int64), 3, np.random.default_rng(0), shares)
