"""Weighted averaging of parameter lists: the FedAvg step (McMahan et al., 2017, Alg. 1).

Shared by every strategy that averages some parameter group (FedAvg averages everything;
FedRep/FedPer the body; FedDAR-WA each domain's head with its own weights).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NDArrays = list[np.ndarray]


def weighted_average(arrays_per_client: Sequence[Sequence[np.ndarray]], weights: Sequence[float]) -> NDArrays:
    """sum_k w_k * theta_k / sum_k w_k, tensor by tensor.

    Accumulates in float64 and casts back to each tensor's dtype (integer buffers such as
    BatchNorm's step counter are rounded).

    Args:
        arrays_per_client: K lists of arrays with identical shapes across clients.
        weights: K non-negative weights, not all zero (usually example counts).

    Raises:
        ValueError: no clients, mismatched layouts, or invalid weights.
    """
    if not arrays_per_client:
        raise ValueError("cannot average zero clients")
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(arrays_per_client),):
        raise ValueError(f"need one weight per client: {len(arrays_per_client)} clients, {w.size} weights")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all zero; got {w.tolist()}")
    reference = arrays_per_client[0]
    for k, arrays in enumerate(arrays_per_client):
        if len(arrays) != len(reference) or any(a.shape != r.shape for a, r in zip(arrays, reference)):
            raise ValueError(f"client {k}'s arrays do not match client 0's layout")
    w = w / w.sum()
    active = [(wk, arrays) for wk, arrays in zip(w, arrays_per_client) if wk > 0]  # 0 * inf would be NaN
    # One float64 accumulator per tensor and one float64 scratch buffer shared by all: each
    # client's tensor is widened into the scratch buffer, scaled and added in place. Every entry
    # sees the same float64 operations in the same client order as ``acc += w_k * theta_k``
    # (so the result is identical), without a new temporary per client and tensor.
    scratch = np.empty(max(r.size for r in reference), dtype=np.float64) if reference else None
    out: NDArrays = []
    for i, ref in enumerate(reference):
        acc = np.zeros(ref.shape, dtype=np.float64)
        term = scratch[: ref.size].reshape(ref.shape)
        for wk, arrays in active:
            term[...] = arrays[i]
            term *= wk
            acc += term
        out.append(np.rint(acc).astype(ref.dtype) if np.issubdtype(ref.dtype, np.integer) else acc.astype(ref.dtype))
    return out
