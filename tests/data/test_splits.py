"""A client's local split: sizes from the fractions, disjoint parts, seeded."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_pfl.data.splits import split_indices


@pytest.mark.parametrize(
    ("n", "val", "test", "sizes"),
    [(100, 0.1, 0.2, (70, 10, 20)), (7, 0.0, 0.25, (5, 0, 2)), (10, 0.15, 0.0, (8, 2, 0))],
)
def test_sizes_follow_the_fractions(n: int, val: float, test: float, sizes: tuple) -> None:
    split = split_indices(np.arange(n) + 1000, val, test, np.random.default_rng(0))
    assert (len(split.train), len(split.val), len(split.test)) == sizes
    assert len(split) == n


def test_parts_are_disjoint_and_cover_the_client() -> None:
    indices = np.random.default_rng(3).choice(10_000, 257, replace=False)
    split = split_indices(indices, 0.2, 0.3, np.random.default_rng(1))
    joined = split.concatenated()
    assert len(np.unique(joined)) == len(joined) == 257
    assert set(joined.tolist()) == set(indices.tolist())


def test_seeded() -> None:
    a = split_indices(np.arange(50), 0.2, 0.2, np.random.default_rng(7))
    b = split_indices(np.arange(50), 0.2, 0.2, np.random.default_rng(7))
    c = split_indices(np.arange(50), 0.2, 0.2, np.random.default_rng(8))
    assert (a.test == b.test).all() and (a.test != c.test).any()


def test_bad_fractions() -> None:
    with pytest.raises(ValueError, match="fractions"):
        split_indices(np.arange(5), 0.6, 0.5, np.random.default_rng(0))


@pytest.mark.parametrize(("fraction", "kept"), [(0.25, 18), (0.5, 35), (0.004, 1), (1.0, 70)])
def test_train_fraction_subsamples_the_training_part_only(fraction: float, kept: int) -> None:
    """pFedFDA's data scarcity: round(70 * f) training samples (halves up, at least one), drawn
    from the full training part; validation and test are the same indices as without it."""
    full = split_indices(np.arange(100), 0.1, 0.2, np.random.default_rng(4))
    scarce = split_indices(np.arange(100), 0.1, 0.2, np.random.default_rng(4), train_fraction=fraction)
    assert len(scarce.train) == kept
    assert set(scarce.train.tolist()) <= set(full.train.tolist())
    assert (scarce.val == full.val).all() and (scarce.test == full.test).all()


def test_train_fraction_is_a_uniform_subsample() -> None:
    """Over seeds every training index is kept about a quarter of the time, not always the same ones."""
    counts = np.zeros(100)
    for seed in range(400):
        counts[split_indices(np.arange(100), 0.0, 0.2, np.random.default_rng(seed), train_fraction=0.25).train] += 1
    assert counts.sum() == 400 * 20
    assert np.abs(counts / 400 - 0.25).max() < 0.12  # binomial(400, 0.25)/400: std 0.022


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5])
def test_bad_train_fraction(bad: float) -> None:
    with pytest.raises(ValueError, match=r"train_fraction must be in \(0, 1\]"):
        split_indices(np.arange(5), 0.0, 0.2, np.random.default_rng(0), train_fraction=bad)
