"""Bounds on what one client's reply can do to an average: update clipping and trimmed means.

Plain weighted averaging (FedAvg) lets a single client move the global model anywhere: a reply
of huge (finite) values, or an honest reply claiming 10^12 examples, dominates the mean. These
functions are the maths of the strategies' optional defences (:class:`~flwr_pfl.strategies.base.PFLStrategy`
``clip_update_norm``, ``aggregate="trimmed-mean"``):

* :func:`clip_update`: scale a client's update (its arrays minus the global arrays it was sent)
  to at most a given L2 norm over all its floating-point arrays, keeping its direction
  (as in DP-FedAvg, McMahan et al., 2018);
* :func:`trimmed_mean`: per coordinate, drop the ``k = floor(trim_fraction * K)`` largest and
  smallest of the K clients' values and average the rest without weights (Yin et al., 2018):
  neither extreme values nor claimed example counts buy influence;
* :func:`magnitude_outliers` and :func:`aggregate_blowup`: the defaults that are always on. A
  reply whose norm is absurd next to the round's other replies is rejected, and an aggregate
  that is non-finite or has grown by orders of magnitude in one round ends the run. Honest
  replies of one federation are within a small factor of each other, so the screen never
  touches an honest run's numbers; a 1e30 reply is a factor of 1e29 away.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

NDArrays = list[np.ndarray]


def _floating(array: np.ndarray) -> bool:
    return np.issubdtype(array.dtype, np.floating)


def update_norm(update: Sequence[np.ndarray]) -> float:
    """L2 norm of the floating-point arrays of ``update`` taken together (float64)."""
    return math.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in update if _floating(a)))


def clip_update(arrays: Sequence[np.ndarray], reference: Sequence[np.ndarray], max_norm: float) -> NDArrays:
    """``reference + d * min(1, max_norm / ||d||)`` with ``d = arrays - reference``.

    The norm is taken over every floating-point array together; integer arrays (step counters)
    are returned as sent. An update within ``max_norm`` is returned unchanged (the same values).

    Raises:
        ValueError: ``max_norm`` is not > 0, or the layouts differ.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    if len(arrays) != len(reference) or any(a.shape != r.shape for a, r in zip(arrays, reference)):
        raise ValueError("the reply's arrays do not match the reference layout")
    update = [a.astype(np.float64) - r.astype(np.float64) if _floating(a) else a for a, r in zip(arrays, reference)]
    norm = update_norm(update)
    if norm <= max_norm:
        return list(arrays)
    scale = max_norm / norm
    return [
        (r.astype(np.float64) + d * scale).astype(a.dtype) if _floating(a) else a
        for a, r, d in zip(arrays, reference, update)
    ]


def trimmed_mean(arrays_per_client: Sequence[Sequence[np.ndarray]], trim_fraction: float) -> NDArrays:
    """Coordinate-wise mean of the K clients' values without the ``floor(trim_fraction * K)``
    largest and smallest ones (unweighted; float64, cast back to each array's dtype, integer
    arrays rounded).

    Raises:
        ValueError: no clients, mismatched layouts, or ``trim_fraction`` outside [0, 0.5).
    """
    if not arrays_per_client:
        raise ValueError("cannot average zero clients")
    if not 0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
    reference = arrays_per_client[0]
    for k, arrays in enumerate(arrays_per_client):
        if len(arrays) != len(reference) or any(a.shape != r.shape for a, r in zip(arrays, reference)):
            raise ValueError(f"client {k}'s arrays do not match client 0's layout")
    num = len(arrays_per_client)
    trim = math.floor(trim_fraction * num)
    out: NDArrays = []
    for i, ref in enumerate(reference):
        stacked = np.stack([np.asarray(arrays[i], dtype=np.float64) for arrays in arrays_per_client])
        kept = np.sort(stacked, axis=0)[trim: num - trim]
        mean = kept.mean(axis=0)
        out.append(np.rint(mean).astype(ref.dtype) if np.issubdtype(ref.dtype, np.integer) else mean.astype(ref.dtype))
    return out


#: the default of :func:`magnitude_outliers`' ``ratio`` and :func:`aggregate_blowup`'s ``growth``
#: (run key ``outlier-norm-ratio``): three orders of magnitude. Honest replies of one federation
#: differ by a small factor (models of one architecture trained alike; statistics summed over at
#: most a few hundred times more examples on one client than on the median one)
DEFAULT_OUTLIER_RATIO = 1e3


def reply_norm(arrays: Sequence[np.ndarray]) -> float:
    """L2 norm of a reply's floating-point arrays together (float64; ``inf`` when it overflows)."""
    with np.errstate(over="ignore"):
        return update_norm(arrays)


def upper_median(values: Sequence[float]) -> float:
    """The ``ceil((K + 1) / 2)``-th smallest value: the median of an odd count, the larger middle
    value of an even one. More than half the values must be raised to raise it."""
    if not values:
        raise ValueError("the upper median of no values is undefined")
    return float(sorted(values)[len(values) // 2])


def magnitude_outliers(norms: Sequence[float], ratio: float, reference: float | None = None) -> list[int]:
    """Indices of the replies whose norm is absurd: non-finite, or above ``ratio`` times the
    reference norm.

    The reference is the upper median of the finite norms when there are at least three (one
    bad reply of three cannot move it), else ``reference`` (a norm the caller trusts: the
    previous round's). With neither, or a reference of 0 (most replies all zeros: nothing to
    compare with), only non-finite norms are outliers.

    Raises:
        ValueError: ``ratio`` is not > 1 (a ratio of 1 or less would reject honest replies).
    """
    if not ratio > 1:
        raise ValueError(f"ratio must be > 1, got {ratio}")
    finite = [n for n in norms if math.isfinite(n)]
    ref = upper_median(finite) if len(finite) >= 3 else reference
    limit = ratio * ref if ref is not None and math.isfinite(ref) and ref > 0 else math.inf
    return [i for i, n in enumerate(norms) if not math.isfinite(n) or n > limit]


def aggregate_blowup(arrays: Sequence[np.ndarray], previous: Sequence[np.ndarray] | None, growth: float) -> str | None:
    """Why a new aggregate cannot be used (in words), or None: it holds NaN/Inf, or its norm
    exceeds ``growth`` times the previous aggregate's norm, floored at ``sqrt(P)`` for P
    floating-point values (the norm of entries of magnitude 1: a model that starts at zero may
    grow to entries of magnitude ``growth`` on average)."""
    bad = sum(int(np.size(a) - np.count_nonzero(np.isfinite(a))) for a in arrays if np.issubdtype(a.dtype, np.inexact))
    if bad:
        return f"{bad} NaN/Inf value(s)"
    norm = reply_norm(arrays)
    size = sum(int(np.size(a)) for a in arrays if np.issubdtype(a.dtype, np.floating))
    before = max(reply_norm(previous) if previous else 0.0, math.sqrt(max(size, 1)))
    if not math.isfinite(norm) or norm > growth * before:
        return f"norm {norm:.4g}, more than {growth:g} x the previous round's {before:.4g}"
    return None
