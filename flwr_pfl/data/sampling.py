"""Seeded index arithmetic shared by the data layer: seeds per stage, rounding, subsampling.

Every random choice of the data layer draws from a generator derived from the config's seed and
the name of the stage (and, where it matters, the client), so that stages are independent of one
another and every simulation worker that rebuilds the data computes the same indices.
"""

from __future__ import annotations

import zlib

import numpy as np


def stage_seed(seed: int, stage: str, *keys: int) -> int:
    """A 32-bit seed for one stage (and optional integer keys such as a client id)."""
    entropy = [seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, zlib.crc32(stage.encode()), *keys]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def stage_rng(seed: int, stage: str, *keys: int) -> np.random.Generator:
    """A numpy generator for one stage, independent of the other stages' generators."""
    return np.random.default_rng(stage_seed(seed, stage, *keys))


def apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """Integers proportional to ``weights`` that sum exactly to ``total``.

    Largest-remainder rounding: each share is floored, and the units left over go to the shares
    with the largest fractional parts (ties to the lower index). Every share is within one of
    ``total * weight / sum(weights)``.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if total < 0 or weights.ndim != 1 or (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(f"cannot apportion {total} by weights {weights}")
    exact = total * weights / weights.sum()
    counts = np.floor(exact).astype(np.int64)
    left = total - int(counts.sum())
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:left]] += 1
    return counts


def stratified_subsample(labels: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of ``size`` samples, each label keeping its share of the pool.

    Pass constant labels for a uniform subsample (regression). Asking for at least the pool size
    returns every index.
    """
    n = len(labels)
    if size >= n:
        return np.arange(n)
    classes, counts = np.unique(labels, return_counts=True)
    quotas = apportion(size, counts.astype(np.float64))
    chosen = [
        rng.choice(np.flatnonzero(labels == c), size=q, replace=False)
        for c, q in zip(classes, quotas)
    ]
    return np.sort(np.concatenate(chosen))


def balanced_assignment(
    labels: np.ndarray, num_groups: int, rng: np.random.Generator
) -> np.ndarray:
    """A group id in [0, num_groups) for every sample: balanced overall and within each label.

    Samples are ordered by label, randomly within a label, and dealt round-robin, so group
    sizes differ by at most one, and so do the sizes of one label within the groups. Each sample
    gets exactly one group.
    """
    n = len(labels)
    order = np.lexsort((rng.random(n), labels))
    groups = np.empty(n, dtype=np.int64)
    groups[order] = np.arange(n) % num_groups
    return groups
