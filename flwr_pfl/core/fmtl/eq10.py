"""Numerical solution of the weight problem, eq. (10), from the clients' task statistics.

:func:`eq10_objective` evaluates a_beta / (sigma_min(Lambda_beta^{\\c}) S_in) for one task;
:func:`solve_eq10` maximizes the equivalent box problem by projected super-gradient ascent from
beta_hat, from eq. (12) scaled into the box, and from random restarts. The paper does not solve
(10); the solver settings (:class:`~flwr_pfl.core.fmtl.options.Eq10Options`) are this library's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flwr_pfl.core.fmtl.eq12 import fmtl_weights_eq12
from flwr_pfl.core.fmtl.options import Eq10Options


def _check_eq10_inputs(
    gram: np.ndarray, holders: np.ndarray, beta_hat: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    gram = np.asarray(gram, dtype=np.float64)
    holders = np.asarray(holders)
    beta_hat = np.asarray(beta_hat, dtype=np.float64)
    if gram.ndim != 3 or gram.shape[1] != gram.shape[2] or gram.shape[0] < 1:
        raise ValueError(f"gram must have shape (N, k, k), got {gram.shape}")
    n = gram.shape[0]
    if holders.shape != (n,) or holders.dtype != np.bool_:
        raise ValueError(
            f"holders must be a bool array of shape ({n},), got {holders.dtype} {holders.shape}"
        )
    if beta_hat.shape != (n,) or not np.all(np.isfinite(beta_hat)) or np.any(beta_hat <= 0):
        raise ValueError(
            f"beta_hat must be ({n},) positive sample shares n_i/n (every client needs samples), "
            f"got {beta_hat!r}"
        )
    if not np.all(np.isfinite(gram)):
        raise ValueError("gram contains NaN or Inf")
    return 0.5 * (gram + gram.transpose(0, 2, 1)), holders, beta_hat


def eq10_objective(
    beta: np.ndarray, gram: np.ndarray, holders: np.ndarray, beta_hat: np.ndarray
) -> np.ndarray:
    """Objective of problem (10) for one task, a_beta / (sigma_min(Lambda_beta^{\\c}) S_in).

    a_beta = max_i beta_i / beta_hat_i, Lambda_beta^{\\c} = sum_i beta_i G_i^c,
    S_in = sum_{i in I^c} beta_i (the paper prints Lambda_beta^{cc}, a typo).

    Args:
        beta: (N,) or (B, N) points of the simplex.
        gram: (N, k, k) G_i^c (:meth:`TaskStatistics.moment_sum_excluding`).
        holders: (N,) bool, i in I^c.
        beta_hat: (N,) n_i / n.

    Returns:
        () or (B,) float64; +inf where sigma_min = 0 or S_in = 0 (the bound is void there).
    """
    gram, holders, beta_hat = _check_eq10_inputs(gram, holders, beta_hat)
    b = np.asarray(beta, dtype=np.float64)
    single = b.ndim == 1
    b = np.atleast_2d(b)
    if b.shape[1] != gram.shape[0]:
        raise ValueError(f"beta must have {gram.shape[0]} entries per point, got shape {b.shape}")
    if np.any(b < 0) or np.any(np.abs(b.sum(axis=1) - 1.0) > 1e-9):
        raise ValueError("beta must lie on the probability simplex (>= 0, summing to 1)")
    lam = np.linalg.eigvalsh(np.einsum("bi,ikl->bkl", b, gram))[:, 0]
    s_in = b[:, holders].sum(axis=1)
    a = (b / beta_hat).max(axis=1)
    ok = (lam > 0) & (s_in > 0)
    out = np.full(b.shape[0], np.inf)
    out[ok] = a[ok] / (lam[ok] * s_in[ok])
    return out[0] if single else out


@dataclass(frozen=True)
class Eq10Solution:
    """Result of :func:`solve_eq10`.

    Attributes:
        beta: (N,) weights on the simplex.
        objective: value of problem (10) at ``beta`` (smaller is better).
        gamma: (N,) box-form solution (0 <= gamma <= beta_hat); beta = gamma / sum(gamma).
    """

    beta: np.ndarray
    objective: float
    gamma: np.ndarray


def _box_value_and_supergradient(
    gamma: np.ndarray, gram: np.ndarray, holders: np.ndarray
) -> tuple[float, np.ndarray]:
    """f(gamma) = lambda_min(sum_i gamma_i G_i) * S_in(gamma) / sum(gamma) and a super-gradient."""
    a = np.einsum("i,ikl->kl", gamma, gram)
    w, v = np.linalg.eigh(a)
    lam, vec = w[0], v[:, 0]
    s_in = gamma[holders].sum()
    total = gamma.sum()
    dlam = np.einsum("k,ikl,l->i", vec, gram, vec)
    grad = dlam * s_in / total + lam * (holders / total - s_in / total**2)
    return float(lam * s_in / total), grad


def solve_eq10(
    gram: np.ndarray,
    holders: np.ndarray,
    beta_hat: np.ndarray,
    options: Eq10Options | None = None,
) -> Eq10Solution:
    """Solve problem (10) for one task numerically (spec Sec. 3.3, observation 3).

    a_beta, sigma_min(Lambda_beta^{\\c}) and S_in are each homogeneous of degree 1 in beta, so
    with beta = gamma / sum(gamma) and a(gamma) = 1, (10) is equivalent to the box problem

        max_gamma  f(gamma) = lambda_min(sum_i gamma_i G_i) * S_in(gamma) / sum_i gamma_i,
        0 <= gamma_i <= beta_hat_i,

    whose optimum value is 1 / (optimum of (10)). f is not concave in general: it is maximized
    by projected super-gradient ascent (super-gradient of lambda_min: v^T G_i v for the bottom
    eigenvector v) from gamma = beta_hat, from eq. (12) scaled into the box, and from
    ``options.restarts`` random points; the best point is returned.

    Args:
        gram: (N, k, k) G_i^c = sum_{c' in C_i \\ {c}} Lambda_i^{c'}.
        holders: (N,) bool, i in I^c (at least one).
        beta_hat: (N,) n_i / n, all > 0.
        options: solver settings (default :class:`Eq10Options`).

    Returns:
        :class:`Eq10Solution`.

    Raises:
        ValueError: no holder (S_in = 0 for every beta), or sigma_min(Lambda_beta^{\\c}) = 0 for
            every beta tried (the other tasks' features do not span R^k; set
            ``Eq10Options(ridge=...)`` > 0, or use eq. (12)).
    """
    options = options if options is not None else Eq10Options()
    gram, holders, beta_hat = _check_eq10_inputs(gram, holders, beta_hat)
    n, k = gram.shape[0], gram.shape[1]
    if not holders.any():
        raise ValueError("no client holds the task: problem (10) is unbounded (S_in = 0)")
    if options.ridge > 0:
        gram = gram + options.ridge * np.eye(k)[None]
    rng = np.random.default_rng(options.seed)
    eq12 = fmtl_weights_eq12(n, np.flatnonzero(holders))
    starts = [beta_hat.copy(), eq12 / np.max(eq12 / beta_hat)]
    starts += [rng.uniform(0.05, 1.0, size=n) * beta_hat for _ in range(options.restarts)]
    step0 = options.step * float(np.linalg.norm(beta_hat))
    best_f, best_gamma = -np.inf, starts[0]
    for gamma in starts:
        for it in range(options.max_iter):
            f, grad = _box_value_and_supergradient(gamma, gram, holders)
            if f > best_f:
                best_f, best_gamma = f, gamma.copy()
            norm = float(np.linalg.norm(grad))
            if norm == 0.0:
                break
            nxt = np.clip(gamma + (step0 / np.sqrt(it + 1.0)) * grad / norm, 0.0, beta_hat)
            if nxt.sum() <= 0 or np.array_equal(nxt, gamma):
                break  # degenerate, or a vertex of the box where the ascent direction points out
            gamma = nxt
    scale = float(np.max(np.abs(gram))) if gram.size else 0.0
    if not best_f > 1e-12 * max(scale, 1e-300) * float(beta_hat.max()):
        raise ValueError(
            "sigma_min(Lambda_beta^{\\c}) is 0 for every weight vector tried: the features of the "
            "other tasks do not span the feature space; set Eq10Options(ridge=...) > 0 or use "
            "eq. (12)"
        )
    beta = best_gamma / best_gamma.sum()
    obj = float(eq10_objective(beta, gram, holders, beta_hat))
    return Eq10Solution(beta=beta, objective=obj, gamma=best_gamma)
