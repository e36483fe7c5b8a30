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
