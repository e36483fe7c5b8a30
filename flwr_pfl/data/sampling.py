"""Seeded index arithmetic shared by the data layer: seeds per stage, rounding, subsampling.

Every random choice of the data layer draws from a generator derived from the config's seed and
the name of the stage (and, where it matters, the client), so that stages are independent of one
another and every simulation worker that rebuilds the data computes the same indices.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

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
    labels: np.ndarray,
    num_groups: int,
    rng: np.random.Generator,
    shares: Sequence[int] | None = None,
) -> np.ndarray:
    """A group id in [0, num_groups) for every sample: balanced overall and within each label.

    Samples are ordered by label, randomly within a label, and dealt round-robin, so group
    sizes differ by at most one, and so do the sizes of one label within the groups. Each sample
    gets exactly one group.

    With integer ``shares`` (one per group, >= 1) the round-robin cycle has ``sum(shares)`` slots,
    ``shares[g]`` of them for group g, spread evenly over the cycle; group g then gets a fraction
    ``shares[g] / sum(shares)`` of the samples, overall and within each label (up to rounding).
    Equal shares deal exactly as without them.
    """
    if shares is not None and len(shares) != num_groups:
        raise ValueError(f"need one share per group ({num_groups}); got {list(shares)}")
    cycle = np.arange(num_groups) if shares is None else _spread_slots(shares)
    n = len(labels)
    order = np.lexsort((rng.random(n), labels))
    groups = np.empty(n, dtype=np.int64)
    groups[order] = cycle[np.arange(n) % len(cycle)]
    return groups


def _spread_slots(shares: Sequence[int]) -> np.ndarray:
    """One round-robin cycle: group g in ``shares[g]`` slots, evenly spaced.

    Slot j of group g sits at position (j + 1/2) / shares[g] of the cycle (ties: lower group
    first), so every prefix of the cycle holds each group within about one slot of its share;
    equal shares give 0, 1, ..., M - 1.
    """
    if any(s < 1 for s in shares):
        raise ValueError(f"shares must be integers >= 1; got {list(shares)}")
    groups = np.repeat(np.arange(len(shares)), shares)
    positions = np.concatenate([(np.arange(s) + 0.5) / s for s in shares])
    return groups[np.argsort(positions, kind="stable")]
