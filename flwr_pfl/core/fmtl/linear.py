"""Linear FMTL with a known representation (the theory level of the paper).

:func:`linear_closed_form` is the minimizer of the weighted ERM, augmented (eqs. 5 and 7) or on
the original data (eq. 3), from the clients' statistics; :func:`linear_heads_gd` is a client's
local gradient steps on the squared-loss objective (with head-wise aggregation, FedAvg on eq. 7);
:func:`excess_risk` is the excess risk of eq. (6).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from flwr_pfl.core.fmtl.options import Augmentation
from flwr_pfl.core.fmtl.statistics import TaskStatistics


def linear_closed_form(
    statistics: Sequence[TaskStatistics],
    beta: np.ndarray,
    *,
    augmentation: Augmentation = Augmentation.AUGMENTED,
    ridge: float = 0.0,
    rcond: float = 1e-12,
) -> np.ndarray:
    """Minimizer of the weighted ERM (5)/(7) (augmented) or (3) (original), from statistics.

    Augmented (spec Sec. 3.1): w_c = [sum_i beta_i^c S_i]^{-1} sum_{i in I^c} beta_i^c r_i^c with
    S_i = Z_i Z_i^T / n_i and r_i^c = Z_i^c Y_i^c / n_i. Every client with beta_i^c > 0 enters
    the Gram matrix; only holders enter the right-hand side.

    Original, eq. (3): w_c = [sum_{i in I^c} beta_i^c Lambda_hat_i^c]^{-1}
    sum_{i in I^c} beta_i^c (Z_i^c Y_i^c / n_i^c); non-holders do not enter.

    Args:
        statistics: N :class:`TaskStatistics` with cross moments (real-valued targets).
        beta: (N, M) weights (columns need not be normalized; the minimizer is scale-free).
        augmentation: ``AUGMENTED`` (default) or ``ORIGINAL``.
        ridge: lambda >= 0 added as lambda * I to every Gram matrix (not in the paper; default 0).
        rcond: a Gram matrix whose smallest eigenvalue is <= rcond * its largest is singular.

    Returns:
        (M, k) heads, row c = w_c.

    Raises:
        ValueError: a singular Gram matrix (e.g. a task without holders under ``ORIGINAL``, or
            fewer samples than k), naming the tasks.
    """
    augmentation = Augmentation(augmentation)
    if not statistics:
        raise ValueError("linear_closed_form needs the statistics of at least one client")
    beta = np.asarray(beta, dtype=np.float64)
    n = len(statistics)
    if beta.ndim != 2 or beta.shape[0] != n:
        raise ValueError(f"beta must have shape ({n}, M), got {beta.shape}")
    if not np.all(np.isfinite(beta)) or np.any(beta < 0):
        raise ValueError("beta must be finite and >= 0")
    if not (np.isfinite(ridge) and ridge >= 0):
        raise ValueError(f"ridge must be a finite number >= 0, got {ridge}")
    m = beta.shape[1]
    k = statistics[0].dim
    gram = np.zeros((m, k, k))
    rhs = np.zeros((m, k))
    for i, st in enumerate(statistics):
        if st.dim != k:
            raise ValueError(f"client {i} statistics have dimension {st.dim}, expected {k}")
        if st.cross_moments is None:
            raise ValueError(f"client {i} statistics have no cross moments (targets are needed)")
        if st.tasks.max() >= m:
            raise ValueError(f"client {i} statistics name task {int(st.tasks.max())} >= M={m}")
        b = beta[i, st.tasks]
        if augmentation is Augmentation.AUGMENTED:
            share = st.counts / st.num_examples  # n_i^c / n_i
            gram += beta[i][:, None, None] * st.total_second_moment()[None]
            rhs[st.tasks] += (b * share)[:, None] * st.cross_moments
        else:
            gram[st.tasks] += b[:, None, None] * st.second_moments
            rhs[st.tasks] += b[:, None] * st.cross_moments
    gram = 0.5 * (gram + gram.transpose(0, 2, 1)) + ridge * np.eye(k)[None]
    eig = np.linalg.eigvalsh(gram)
    singular = np.flatnonzero(eig[:, 0] <= rcond * np.maximum(eig[:, -1], 0.0))
    if singular.size:
        raise ValueError(
            f"the weighted Gram matrix of task(s) {singular.tolist()} is singular (no holder with "
            "weight > 0 under 'original', or fewer samples than dimensions); give those tasks "
            "holders/weights or set ridge > 0"
        )
    return np.linalg.solve(gram, rhs[..., None])[..., 0]


def linear_heads_gd(
    heads: torch.Tensor,
    features: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    *,
    lr: float,
    steps: int = 1,
) -> torch.Tensor:
    """Local full-batch gradient steps of one client on all M linear heads (client side).

    Objective: f_i(W) = sum_c sum_j Omega[j, c] (z_j^T w_c - Y[j, c])^2 with (Y, Omega) from
    :func:`augmented_targets` (the squared-loss :func:`fmtl_head_loss`, whose gradient
    2 ((Z W^T - Y) * Omega)^T Z is used in closed form here). With one step per round and
    head-wise beta aggregation, FedAvg is exactly gradient descent on eq. (7) and converges to
    :func:`linear_closed_form` (spec Sec. 3.2 (A2)); more steps give the usual FedAvg drift.

    Args:
        heads: (M, k) current heads (row c = w_c); not modified.
        features: (n_i, k) features z.
        targets: (n_i, M) per-head targets Y.
        weights: (n_i, M) per-head sample weights Omega.
        lr: step size > 0.
        steps: number of full-batch steps E >= 1.

    Returns:
        (M, k) updated heads.
    """
    if heads.ndim != 2 or features.ndim != 2 or features.shape[1] != heads.shape[1]:
        raise ValueError(
            f"heads must be (M, k) and features (n_i, k); got {tuple(heads.shape)} and "
            f"{tuple(features.shape)}"
        )
    expected = (features.shape[0], heads.shape[0])
    if tuple(targets.shape) != expected or tuple(weights.shape) != expected:
        raise ValueError(
            f"targets and weights must have shape {expected}, got {tuple(targets.shape)} and "
            f"{tuple(weights.shape)}"
        )
    if not (np.isfinite(lr) and lr > 0) or steps < 1:
        raise ValueError(f"lr must be > 0 and steps >= 1, got lr={lr}, steps={steps}")
    w = heads  # never modified in place: every step makes a new tensor
    for _ in range(steps):
        resid = (features @ w.T - targets) * weights
        w = w - (2.0 * lr) * (resid.T @ features)
    return w


def excess_risk(
    heads: np.ndarray,
    true_heads: np.ndarray,
    test_second_moments: np.ndarray,
    task_weights: np.ndarray | None = None,
) -> float:
    """Excess risk of eq. (6): sum_c alpha^c ||w_hat_c - w_c*||^2 in the Lambda_bar^c norm.

    Args:
        heads: (M, k) estimates.
        true_heads: (M, k) w_c*.
        test_second_moments: (M, k, k) Lambda_bar^c of the test distributions.
        task_weights: (M,) alpha^c >= 0 (default 1/M).

    Returns:
        float.
    """
    heads = np.asarray(heads, dtype=np.float64)
    true_heads = np.asarray(true_heads, dtype=np.float64)
    lam = np.asarray(test_second_moments, dtype=np.float64)
    if (
        heads.ndim != 2
        or heads.shape != true_heads.shape
        or lam.shape != (*heads.shape, heads.shape[1])
    ):
        raise ValueError(
            f"heads and true_heads must be (M, k) and test_second_moments (M, k, k); got "
            f"{heads.shape}, {true_heads.shape}, {lam.shape}"
        )
    m = heads.shape[0]
    alpha = np.full(m, 1.0 / m) if task_weights is None else np.asarray(task_weights, dtype=np.float64)
    if alpha.shape != (m,) or np.any(alpha < 0):
        raise ValueError(f"task_weights must be ({m},) and >= 0")
    d = heads - true_heads
    return float(np.einsum("c,ck,ckl,cl->", alpha, d, lam, d))
