"""A client's local train / validation / test split of its sample indices.

Clients split locally, as they would in a deployment: the pool is not pre-divided into a
global train and test set. The split is a seeded random permutation cut into three disjoint
parts; it is not stratified (clients of a label-skewed partition may hold a label only a few
times).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class SplitIndices:
    """Disjoint index arrays of one client's train, validation and test samples."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray

    def __len__(self) -> int:
        return len(self.train) + len(self.val) + len(self.test)

    def concatenated(self) -> np.ndarray:
        """train, val and test indices one after the other."""
        return np.concatenate([self.train, self.val, self.test])


def split_indices(
    indices: np.ndarray,
    val_fraction: float,
    test_fraction: float,
    rng: np.random.Generator,
    test_size_of: int | None = None,
    train_fraction: float = 1.0,
) -> SplitIndices:
    """Cut a shuffled copy of ``indices`` into test, validation and train parts.

    The test and validation sizes are ``round(n * fraction)`` (halves up); train keeps the rest.

    ``test_size_of``: a client larger than the others (FEDORA's imbalanced layout) gets the test
    split a client of this many samples gets, and cuts the rest into validation and train in the
    same ratio as that client, ``val_fraction : 1 - val_fraction - test_fraction``.

    ``train_fraction``: keep only this share of the training part (``round(n_train *
    train_fraction)``, halves up, at least one sample), a uniform subsample since the part is
    already shuffled; validation and test are cut first, so they do not change (pFedFDA's
    data-scarcity protocol subsamples the training split only).
    """
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ValueError(
            f"fractions must be in [0, 1) with a sum < 1; got val {val_fraction}, "
            f"test {test_fraction}"
        )
    if not 0 < train_fraction <= 1:
        raise ValueError(f"train_fraction must be in (0, 1]; got {train_fraction}")
    shuffled = rng.permutation(np.asarray(indices, dtype=np.int64))
    n = len(shuffled)
    if test_size_of is None:
        n_test = _rounded(n * test_fraction)
        n_val = _rounded(n * val_fraction)
    else:
        n_test = min(n, _rounded(test_size_of * test_fraction))
        # rounded to 9 decimals first, so that a half (0.1 / 0.8 = 0.12499...) rounds up
        n_val = _rounded(round((n - n_test) * val_fraction / (1 - test_fraction), 9))
    train = shuffled[n_test + n_val :]
    if train_fraction < 1 and len(train):
        train = train[: max(1, _rounded(len(train) * train_fraction))]
    return SplitIndices(
        train=train,
        val=shuffled[n_test : n_test + n_val],
        test=shuffled[:n_test],
    )


def _rounded(x: float) -> int:
    """``x`` rounded to an integer, halves up."""
    return int(np.floor(x + 0.5))
