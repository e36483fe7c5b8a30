"""Interpolation of local and global statistics, Alg. 1 lines 10-11.

mu_hat = beta mu_local + (1 - beta) mu_global, and the same for Sigma with beta (or a separate
beta_Sigma).
"""

from __future__ import annotations

import torch

from flwr_pfl.core.pfedfda.checks import ArrayLike, _check_real, _float


def interpolate_statistics(
    local_means: ArrayLike,
    local_cov: ArrayLike,
    global_means: ArrayLike,
    global_cov: ArrayLike,
    beta_mu: float,
    beta_sigma: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mu_i = beta_mu mu_hat + (1 - beta_mu) mu_g and Sigma_i = beta_Sigma Sigma_hat + (1 - beta_Sigma) Sigma_g.

    Alg. 1 lines 10-11 (single beta: ``beta_sigma=None`` uses ``beta_mu``). A class absent
    locally has mu_hat^c = mu_g^c, so mu_i^c = mu_g^c whatever beta is. A convex combination of
    PSD matrices is PSD.

    Shapes: means (C, d), covariances (d, d); betas in [0, 1]. Returns tensors like the local ones.

    Raises:
        ValueError: a beta outside [0, 1] or mismatched shapes.
    """
    beta_sigma = beta_mu if beta_sigma is None else beta_sigma
    _check_real("beta_mu", beta_mu, low=0.0, high=1.0)
    _check_real("beta_sigma", beta_sigma, low=0.0, high=1.0)
    mu_l = _float(local_means, "local_means", 2)
    cov_l = _float(local_cov, "local_cov", 2, like=mu_l)
    mu_g = _float(global_means, "global_means", 2, like=mu_l)
    cov_g = _float(global_cov, "global_cov", 2, like=mu_l)
    if mu_l.shape != mu_g.shape or cov_l.shape != cov_g.shape or cov_l.shape != (mu_l.shape[1],) * 2:
        raise ValueError(
            f"shapes do not agree: local means {tuple(mu_l.shape)}, global means {tuple(mu_g.shape)}, "
            f"local cov {tuple(cov_l.shape)}, global cov {tuple(cov_g.shape)}"
        )
    return _mix(mu_l, mu_g, beta_mu), _mix(cov_l, cov_g, beta_sigma)


def _mix(local: torch.Tensor, global_: torch.Tensor, beta: float | torch.Tensor) -> torch.Tensor:
    """beta * local + (1 - beta) * global (unchecked; beta may be a tensor carrying gradients)."""
    return global_ + beta * (local - global_)
