"""Client weights over a reference set of clients: every head weighting scheme and the body weights.

:func:`head_weight_matrix` gives beta_i^c for every client and head under eq. (12), eq. (10),
uniform, sample-count (beta_hat_i = n_i / n, Sec. III) or the two readings of the paper's EW
baseline (Sec. VI); :func:`body_weights` weights the shared representation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flwr_pfl.core.fmtl.checks import ArrayLike, _check_membership, _check_num_examples
from flwr_pfl.core.fmtl.eq10 import solve_eq10
from flwr_pfl.core.fmtl.eq12 import eq12_weight_matrix
from flwr_pfl.core.fmtl.options import BodyWeighting, Eq10Options, HeadWeighting
from flwr_pfl.core.fmtl.statistics import TaskStatistics


def _shares(num_examples: np.ndarray) -> np.ndarray:
    """beta_hat_i = n_i / n (paper Sec. III), shape (K,)."""
    return num_examples / num_examples.sum()


def body_weights(
    num_examples: ArrayLike | Sequence[float], scheme: BodyWeighting = BodyWeighting.UNIFORM
) -> np.ndarray:
    """Client weights for the representation (FedAvg in phase 1, or any non-head array).

    Args:
        num_examples: (S,) n_i of the participants (>= 0, not all 0).
        scheme: ``UNIFORM`` (default, FedRep) or ``NUM_EXAMPLES`` (Flower's FedAvg).

    Returns:
        (S,) float64 weights summing to 1.
    """
    scheme = BodyWeighting(scheme)
    n = _check_num_examples(num_examples, None)
    size = n.shape[0]
    if scheme is BodyWeighting.UNIFORM:
        return np.full(size, 1.0 / size)
    return _shares(n)


def head_weight_matrix(
    membership: np.ndarray,
    scheme: HeadWeighting = HeadWeighting.FMTL_EQ12,
    *,
    num_examples: ArrayLike | Sequence[float] | None = None,
    statistics: Sequence[TaskStatistics] | None = None,
    eq10: Eq10Options | None = None,
) -> np.ndarray:
    """Weights beta_i^c of every client of a reference set for every head.

    The reference set is whatever the caller treats as [N]: the round's participants (policy
    ``ROUND_LOCAL``) or the whole registered population (the population policies).

    Args:
        membership: (K, M) bool holder mask; every client must hold at least one task.
        scheme: see :class:`HeadWeighting` (default ``FMTL_EQ12``).
        num_examples: (K,) n_i; required by ``NUM_EXAMPLES``; used as beta_hat by ``FMTL_EQ10``
            (otherwise beta_hat comes from the statistics' counts).
        statistics: K :class:`TaskStatistics`, one per client in row order; required by
            ``FMTL_EQ10``.
        eq10: solver settings for ``FMTL_EQ10`` (default :class:`Eq10Options`).

    Returns:
        (K, M) float64. Every column sums to 1, except ``EW_HOLDERS`` columns of tasks without a
        holder, which are all 0. Tasks without a holder get 1/K under ``FMTL_EQ12`` and
        ``FMTL_EQ10`` (the paper does not cover them; see :class:`EmptyHolderPolicy`).
    """
    scheme = HeadWeighting(scheme)
    membership = _check_membership(membership)
    k, m = membership.shape
    if scheme in (HeadWeighting.UNIFORM, HeadWeighting.EW_PARTICIPANTS):
        return np.full((k, m), 1.0 / k)
    if scheme is HeadWeighting.NUM_EXAMPLES:
        if num_examples is None:
            raise ValueError("head weighting 'num_examples' needs num_examples")
        shares = _shares(_check_num_examples(num_examples, k))
        return np.repeat(shares[:, None], m, axis=1)
    if scheme is HeadWeighting.EW_HOLDERS:
        h = membership.sum(axis=0)
        return membership / np.maximum(h, 1)[None, :]
    if scheme is HeadWeighting.FMTL_EQ12:
        return eq12_weight_matrix(membership)
    # FMTL_EQ10
    if statistics is None or len(statistics) != k:
        raise ValueError(
            f"head weighting 'fmtl_eq10' needs one TaskStatistics per client ({k}), got "
            f"{None if statistics is None else len(statistics)}"
        )
    options = eq10 if eq10 is not None else Eq10Options()
    dims = {st.dim for st in statistics}
    if len(dims) != 1:
        raise ValueError(f"all TaskStatistics must have the same feature dimension, got {sorted(dims)}")
    for i, st in enumerate(statistics):
        if st.tasks.size and st.tasks.max() >= m:
            raise ValueError(f"statistics of client {i} name task {int(st.tasks.max())} >= M={m}")
    if num_examples is None:
        beta_hat = _shares(np.array([st.num_examples for st in statistics], dtype=np.float64))
    else:
        beta_hat = _shares(_check_num_examples(num_examples, k))
    beta = np.empty((k, m))
    for c in range(m):
        holders = membership[:, c]
        if not holders.any():
            beta[:, c] = 1.0 / k  # problem (10) is unbounded (S_in = 0 for every beta)
            continue
        gram = np.stack([st.moment_sum_excluding(c) for st in statistics])
        try:
            beta[:, c] = solve_eq10(gram, holders, beta_hat, options).beta
        except ValueError as err:
            raise ValueError(f"eq. (10) weights for task {c}: {err}") from None
    return beta
