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
  neither extreme values nor claimed example counts buy influence.
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
