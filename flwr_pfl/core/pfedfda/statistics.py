"""Feature statistics, Eq. 6-8: class means and the shared covariance, and their regularization.

:func:`class_moments` accumulates per-class sums (mergeable across mini-batches with
:func:`merge_class_moments`); :func:`gaussian_estimates` turns them into (mu, Sigma);
:func:`regularize_covariance` and :func:`nearest_pd_same_variance` keep Sigma positive definite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flwr_pfl.core.pfedfda.checks import ArrayLike, _check_int, _check_real, _float, _labels
from flwr_pfl.core.pfedfda.options import CovRegularization


@dataclass(frozen=True, eq=False)
class ClassMoments:
    """Sufficient statistics of a labelled feature batch, mergeable across batches.

    Attributes:
        counts: rows per class n^c, shape (C,), int64.
        means: per-class sample means (Eq. 6), shape (C, d); rows of absent classes are 0.
        scatter: pooled within-class scatter sum_j (z_j - m^{y_j})(z_j - m^{y_j})^T around each
            class's own sample mean (Eq. 7-8 before the division), shape (d, d).
    """

    counts: torch.Tensor
    means: torch.Tensor
    scatter: torch.Tensor

    @property
    def total(self) -> int:
        """Number of rows N."""
        return int(self.counts.sum())


def class_moments(features: ArrayLike, labels: ArrayLike, num_classes: int) -> ClassMoments:
    """Per-class counts and means and the pooled within-class scatter of one batch (Eq. 6-8).

    Two-pass (centered) computation, accurate in float32, one (N, d) x (d, N) product on the
    features' device. Batches too large for memory, or a fresh pass over a data loader, are
    handled by calling this per mini-batch and combining with :func:`merge_class_moments`.

    Args:
        features: z, shape (N, d), floating.
        labels: y in [0, C), shape (N,).
        num_classes: C.
    """
    z = _float(features, "features", 2)
    y = _labels(labels, num_classes, device=z.device, n=z.shape[0])
    counts = torch.bincount(y, minlength=num_classes)
    sums = torch.zeros(num_classes, z.shape[1], dtype=z.dtype, device=z.device).index_add_(0, y, z)
    means = sums / counts.clamp(min=1).unsqueeze(1).to(z.dtype)
    centered = z - means[y]
    return ClassMoments(counts=counts, means=means, scatter=centered.T @ centered)


def merge_class_moments(a: ClassMoments, b: ClassMoments) -> ClassMoments:
    """Exact moments of the union of two batches (Chan et al.'s pairwise update, per class).

    m = m_a + (n_b/n) delta and S = S_a + S_b + sum_c (n_a^c n_b^c / n^c) delta_c delta_c^T with
    delta_c = m_b^c - m_a^c: the same result as :func:`class_moments` on the concatenation.
    """
    if a.means.shape != b.means.shape:
        raise ValueError(f"cannot merge moments of shapes {tuple(a.means.shape)} and {tuple(b.means.shape)}")
    n = a.counts + b.counts
    nf = n.clamp(min=1).to(a.means.dtype)
    delta = b.means - a.means
    means = a.means + delta * (b.counts.to(a.means.dtype) / nf).unsqueeze(1)
    coef = (a.counts.to(a.means.dtype) * b.counts.to(a.means.dtype) / nf).unsqueeze(1)
    return ClassMoments(counts=n, means=means, scatter=a.scatter + b.scatter + (delta * coef).T @ delta)


def gaussian_estimates(
    moments: ClassMoments,
    fallback_means: ArrayLike,
    *,
    min_class_count: int = 2,
    regularization: CovRegularization = CovRegularization(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local Gaussian estimates (mu_hat, Sigma_hat) from class moments (Eq. 6-8, Alg. 1 line 8).

    * mu_hat^c is the class sample mean when the class has *more than* ``min_class_count``
      rows, else the fallback (global) mean mu_g^c; absent classes always take mu_g^c.
    * Sigma_hat = S / (N - 1) + regularization, where S is the pooled within-class scatter: rows
      of a class with its own mean are centered on it; rows of a present class below the
      threshold are centered on mu_g^c (spec §9.11). N counts all rows; the divisor is N - 1 as
      in Eq. 7, not N - C (spec §9.12).

    Args:
        moments: from :func:`class_moments` / :func:`merge_class_moments`.
        fallback_means: mu_g, shape (C, d).
        min_class_count: threshold, >= 0 (2 = "more than 2 rows", the code's evaluation path;
            0 = any present class, the code's training path).
        regularization: ridge, constant and PD repair (:class:`CovRegularization`).

    Returns:
        mu_hat (C, d) and Sigma_hat (d, d), dtype and device of the moments.

    Raises:
        ValueError: fewer than 2 rows (Eq. 7 divides by N - 1) or mismatched shapes.
    """
    _check_int("min_class_count", min_class_count, low=0)
    fallback = _float(fallback_means, "fallback_means", 2, like=moments.means)
    if fallback.shape != moments.means.shape:
        raise ValueError(
            f"fallback_means must have shape {tuple(moments.means.shape)} (C, d), got {tuple(fallback.shape)}"
        )
    total = moments.total
    if total < 2:
        raise ValueError(f"need at least 2 feature rows to estimate a covariance (Eq. 7 divides by N - 1); got {total}")
    counts = moments.counts
    own = (counts > min_class_count).unsqueeze(1)
    means = torch.where(own, moments.means, fallback)
    # Rows of present classes centered on mu_g^c instead of their own mean add n^c s s^T.
    shift = torch.where(own | (counts == 0).unsqueeze(1), torch.zeros_like(fallback), moments.means - fallback)
    scatter = moments.scatter + (shift * counts.to(shift.dtype).unsqueeze(1)).T @ shift
    cov = regularize_covariance(scatter / (total - 1), regularization)
    return means, cov


def estimate_statistics(
    features: ArrayLike,
    labels: ArrayLike,
    fallback_means: ArrayLike,
    *,
    min_class_count: int = 2,
    regularization: CovRegularization = CovRegularization(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local (mu_hat, Sigma_hat) of a feature bank (Eq. 6-8): :func:`class_moments` then
    :func:`gaussian_estimates`. Shapes: features (N, d), labels (N,), fallback_means (C, d);
    returns (C, d) and (d, d)."""
    z = _float(features, "features", 2)
    fallback = _float(fallback_means, "fallback_means", 2, like=z)
    moments = class_moments(z, labels, fallback.shape[0])
    return gaussian_estimates(moments, fallback, min_class_count=min_class_count, regularization=regularization)


def regularize_covariance(cov: ArrayLike, regularization: CovRegularization = CovRegularization()) -> torch.Tensor:
    """Sigma + const_add * 1 1^T + ridge * I, then (optionally) the PD repair (§4.2; code).

    With the default (official-code) options this adds 1e-4 to every entry and a full identity,
    after which the matrix is always PD and the repair changes nothing. Shape (d, d) -> (d, d).
    """
    sigma = _float(cov, "cov", 2)
    if sigma.shape[0] != sigma.shape[1]:
        raise ValueError(f"cov must be square, got shape {tuple(sigma.shape)}")
    out = sigma
    if regularization.const_add:
        out = out + regularization.const_add
    if regularization.ridge:
        out = out + regularization.ridge * torch.eye(out.shape[0], dtype=out.dtype, device=out.device)
    if regularization.pd_repair:
        out = nearest_pd_same_variance(out, threshold=regularization.pd_threshold)
    return out


def nearest_pd_same_variance(cov: ArrayLike, threshold: float = 1e-15) -> torch.Tensor:
    """Nearest positive-definite matrix with the same variances (§4.2, ref. [11]; code's repair).

    Converts to the correlation matrix R = D^-1/2 Sigma D^-1/2, takes its eigendecomposition and,
    only if an eigenvalue is below ``threshold``, clips the eigenvalues at ``threshold``,
    rebuilds R, rescales it to unit diagonal and converts back with the original standard
    deviations. So the diagonal (the variances) is kept exactly and a PD input is returned
    unchanged. The linear algebra runs in float64 and the result is cast back.

    Args:
        cov: symmetric (d, d) matrix with a positive diagonal.
        threshold: clipping level of the correlation eigenvalues, > 0 (code: 1e-15).

    Returns:
        (d, d) matrix, same dtype and device; the input itself when nothing was clipped.

    Raises:
        ValueError: not square, non-finite, not symmetric, or a diagonal entry <= 0 (its variance
            cannot be kept; add a ridge).
    """
    _check_real("pd_threshold", threshold, low=0.0, low_open=True)
    sigma = _float(cov, "cov", 2)
    if sigma.shape[0] != sigma.shape[1]:
        raise ValueError(f"cov must be square, got shape {tuple(sigma.shape)}")
    s64 = sigma.detach().to(torch.float64)
    scale = float(s64.abs().max()) if s64.numel() else 0.0
    if float((s64 - s64.T).abs().max()) > 1e-5 * max(scale, 1e-30):
        raise ValueError("cov must be symmetric")
    var = torch.diagonal(s64)
    if (var <= 0).any():
        bad = int(torch.nonzero(var <= 0)[0])
        raise ValueError(
            f"cov has a non-positive variance at index {bad} ({float(var[bad]):.3g}); the repair keeps "
            "variances, so they must be > 0 (use a ridge > 0)"
        )
    std = var.sqrt()
    corr = s64 / std.unsqueeze(0) / std.unsqueeze(1)
    corr = 0.5 * (corr + corr.T)
    evals, evecs = torch.linalg.eigh(corr)
    if not bool((evals < threshold).any()):
        return sigma
    repaired = (evecs * evals.clamp(min=threshold)) @ evecs.T
    d = torch.diagonal(repaired).sqrt()
    repaired = repaired / d.unsqueeze(0) / d.unsqueeze(1)
    repaired = 0.5 * (repaired + repaired.T)
    return (repaired * std.unsqueeze(0) * std.unsqueeze(1)).to(sigma.dtype)
