"""Label priors and the generative (LDA) head, Eq. 3-4.

Class-conditional Gaussians N(z | mu^c, Sigma) with a shared covariance and the client's label
priors pi give, by Bayes' rule, a linear head W z + b; :func:`lda_head` computes it in closed
form and :func:`lda_logits` applies it.
"""

from __future__ import annotations

import torch

from flwr_pfl.core.pfedfda.checks import ArrayLike, _check_real, _float, _labels
from flwr_pfl.core.pfedfda.options import LDASolve


def label_counts(labels: ArrayLike, num_classes: int) -> torch.Tensor:
    """Number of rows of each class, shape (C,), int64.

    Args:
        labels: integer class labels in [0, C), shape (N,).
        num_classes: C.
    """
    y = _labels(labels, num_classes)
    return torch.bincount(y, minlength=num_classes)


def label_priors(labels: ArrayLike, num_classes: int, eps: float = 1e-4) -> torch.Tensor:
    """Smoothed label priors pi^c = (n^c/n + eps) / sum_c' (n^c'/n + eps), shape (C,), float32.

    pi_i is the client's label distribution (paper §3, p_i(y)); the official code adds eps = 1e-4
    so that an absent class gets log-prior ~ log(1e-4) = -9.2, which all but forbids predicting
    it (spec §9.18). Compute it once from the client's whole training split.

    Raises:
        ValueError: no labels, labels outside [0, C), or eps < 0.
    """
    counts = label_counts(labels, num_classes)
    return priors_from_counts(counts, eps)


def priors_from_counts(counts: ArrayLike, eps: float = 1e-4) -> torch.Tensor:
    """Smoothed priors from class counts (C,): (n^c/n + eps) normalized; see :func:`label_priors`."""
    _check_real("prior_eps", eps, low=0.0)
    c = torch.as_tensor(counts).to(torch.float64)
    if c.ndim != 1 or c.numel() == 0:
        raise ValueError(f"counts must be a non-empty vector, got shape {tuple(c.shape)}")
    if not torch.isfinite(c).all() or (c < 0).any() or c.sum() <= 0:
        raise ValueError("counts must be finite, >= 0 and not all zero")
    p = c / c.sum() + eps
    return (p / p.sum()).to(torch.float32)


def lda_head(
    means: ArrayLike,
    cov: ArrayLike,
    priors: ArrayLike,
    *,
    shrinkage: float = 1e-4,
    solve: LDASolve = "lstsq",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The linear head equivalent to the tied-covariance Gaussian posterior (Eq. 3-4).

    log p(y=c|z) = z^T Sigma^-1 mu^c - 1/2 mu^c^T Sigma^-1 mu^c + log pi^c + const(z), so the
    head is W_c = Sigma~^-1 mu^c and b_c = -1/2 <mu^c, W_c> + log pi^c, with logits W z + b and
    softmax(W z + b) the posterior of Eq. 3. Sigma^-1 mu is a least-squares solve (§4.2), never
    an explicit inverse unless ``solve="inverse"``. As in the official code, Sigma is first
    shrunk to Sigma~ = (1-eps) Sigma + eps tr(Sigma)/d I (``shrinkage`` = eps, 0 turns it off),
    and b uses the unshrunk mu with W from Sigma~. Differentiable in ``means`` and ``cov``.

    Args:
        means: class means mu, shape (C, d).
        cov: tied covariance Sigma, shape (d, d), symmetric.
        priors: class priors pi, shape (C,), >= 0, summing to 1 (a zero prior gives b_c = -inf).
        shrinkage: eps in [0, 1); default 1e-4 (code).
        solve: ``"lstsq"`` (default) or ``"inverse"``.

    Returns:
        (W, b): weight (C, d) and bias (C,), in the dtype and on the device of ``means``.

    Raises:
        ValueError: shapes that do not agree, non-finite entries, priors off the simplex,
            a bad shrinkage or solve option.
    """
    mu = _float(means, "means", 2)
    sigma = _float(cov, "cov", 2, like=mu)
    pi = _float(priors, "priors", 1, like=mu)
    num_classes, dim = mu.shape
    if sigma.shape != (dim, dim):
        raise ValueError(
            f"cov must have shape ({dim}, {dim}) to match means {tuple(mu.shape)}, got {tuple(sigma.shape)}"
        )
    if pi.shape != (num_classes,):
        raise ValueError(f"priors must have shape ({num_classes},), got {tuple(pi.shape)}")
    if (pi < 0).any() or abs(float(pi.sum()) - 1.0) > 1e-4:
        raise ValueError("priors must be >= 0 and sum to 1")
    _check_real("lda_shrinkage", shrinkage, low=0.0, high=1.0, high_open=True)
    if solve not in ("lstsq", "inverse"):
        raise ValueError(f"solve must be 'lstsq' or 'inverse', got {solve!r}")
    return _lda_head(mu, sigma, torch.log(pi), shrinkage, solve)


def lda_logits(features: ArrayLike, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Logits W z + b of the LDA head for a batch of features (N, d) -> (N, C)."""
    z = _float(features, "features", 2, like=weight)
    if z.shape[1] != weight.shape[1]:
        raise ValueError(f"features have width {z.shape[1]} but the head expects {weight.shape[1]}")
    return z @ weight.T + bias


def _lda_head(
    mu: torch.Tensor, sigma: torch.Tensor, log_priors: torch.Tensor, shrinkage: float, solve: LDASolve
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unchecked LDA head (used inside the differentiable beta objective)."""
    dim = sigma.shape[0]
    if shrinkage > 0:
        eye = torch.eye(dim, dtype=sigma.dtype, device=sigma.device)
        sigma = (1.0 - shrinkage) * sigma + shrinkage * (torch.diagonal(sigma).sum() / dim) * eye
    if solve == "lstsq":
        weight = torch.linalg.lstsq(sigma, mu.T).solution.T
    else:
        weight = mu @ torch.linalg.inv(sigma).T
    bias = -0.5 * (mu * weight).sum(dim=1) + log_priors
    return weight, bias
