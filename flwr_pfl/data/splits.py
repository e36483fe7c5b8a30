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
    indices: np.ndarray, val_fraction: float, test_fraction: float, rng: np.random.Generator
) -> SplitIndices:
    """Cut a shuffled copy of ``indices`` into test, validation and train parts.

    The test and validation sizes are ``round(n * fraction)`` (halves up); train keeps the rest.
    """
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ValueError(
            f"fractions must be in [0, 1) with a sum < 1; got val {val_fraction}, "
            f"test {test_fraction}"
        )
    shuffled = rng.permutation(np.asarray(indices, dtype=np.int64))
    n = len(shuffled)
    n_test = int(np.floor(n * test_fraction + 0.5))
    n_val = int(np.floor(n * val_fraction + 0.5))
    return SplitIndices(
        train=shuffled[n_test + n_val :],
        val=shuffled[n_test : n_test + n_val],
        test=shuffled[:n_test],
    )
