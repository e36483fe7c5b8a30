"""The paper's closed-form client weights, eq. (12).

For task c with |I^c| holders among K clients: holders share 1/2 and non-holders share 1/2 when
2|I^c| <= K, otherwise every client gets 1/K. Eq. (12) minimizes the loosened bound of eq. (11);
it needs only the holder mask ("distribution-free").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flwr_pfl.core.fmtl.checks import _check_membership, _is_int_at_least


def eq12_weight_matrix(membership: np.ndarray) -> np.ndarray:
    """Eq. (12) weights for every task at once, over a reference set of K clients.

    For task c with h = |I^c| holders in the reference set:

    * 1 <= h and 2h <= K: beta_i^c = 1/(2h) for holders, 1/(2(K - h)) for non-holders;
    * 2h > K: beta_i^c = 1/K for every client (the paper's third case);
    * h = 0 (not covered by the paper): 1/K, as in the spec's sketch; under partial
      participation the :class:`EmptyHolderPolicy` decides what happens to such a head.

    Eq. (12) is the exact minimizer of the loosened bound a/(S_in^2 S_out) of eq. (11), with
    S_in = sum_{i in I^c} beta_i^c and a = max_i beta_i^c / beta_hat_i for equal n_i.

    Args:
        membership: (K, M) bool holder mask.

    Returns:
        (K, M) float64; every column sums to 1.
    """
    return _eq12(_check_membership(membership))


def _eq12(membership: np.ndarray) -> np.ndarray:
    """Eq. (12) on a validated (K, M) holder mask (rows may hold no task)."""
    k = membership.shape[0]
    h = membership.sum(axis=0)
    beta = np.full(membership.shape, 1.0 / k)
    split = (h >= 1) & (2 * h <= k)
    if split.any():
        hs = h[split].astype(np.float64)
        holder_w = 1.0 / (2.0 * hs)
        other_w = 1.0 / (2.0 * (k - hs))  # k - h >= h >= 1 here
        beta[:, split] = np.where(membership[:, split], holder_w, other_w)
    return beta


def fmtl_weights_eq12(num_clients: int, holders: Sequence[int] | np.ndarray) -> np.ndarray:
    """Eq. (12) weights beta_i^c of one task c over N clients.

    Holders (I^c) share 1/2 and non-holders share 1/2 when |I^c| <= N/2; otherwise all weights
    are 1/N (see :func:`eq12_weight_matrix`, which this wraps).

    Args:
        num_clients: N >= 1.
        holders: indices in [0, N) of the clients holding the task, no repeats (may be empty:
            then 1/N everywhere).

    Returns:
        (N,) float64 weights summing to 1.
    """
    if not _is_int_at_least(num_clients, 1):
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    idx = np.asarray(holders, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= num_clients):
        raise ValueError(f"holders must be client indices in [0, {num_clients}), got {idx.tolist()}")
    if np.unique(idx).size != idx.size:
        raise ValueError(f"holders must not repeat a client, got {idx.tolist()}")
    mask = np.zeros((num_clients, 1), dtype=bool)
    mask[idx, 0] = True
    return _eq12(mask)[:, 0]
