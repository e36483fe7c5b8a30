"""Server side: the per-source betas, fixed or auto-weighted (Eq. 3; App. A.4 for the delta form),
and the Delta errors they minimize: FedDA's (Theorem 4.2, Eq. 1) and FedGP's (Theorem 4.4, Eq. 2).
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from flwr_pfl.core.fedgp.config import FDAConfig
from flwr_pfl.core.fedgp.estimators import FDAStats
from flwr_pfl.core.fedgp.options import FedGPBetaForm, Rule, _coerce_enum


def auto_betas(
    stats: FDAStats, rule: Rule | str, fedgp_beta_form: FedGPBetaForm | str = FedGPBetaForm.DELTA1
) -> np.ndarray:
    """Per-source auto-weights beta_i in [0, 1] (Eq. 3; A.4 for ``delta_thresh``).

    * FedDA: beta_i = sigma^2 / (sigma^2 + d_i^2)                       (minimises Eq. 1)
    * FedGP ``delta1``: beta_i = sigma^2 / (sigma^2 + tau^2 d_i^2)     (minimises Eq. 2 w/o 1/m)
    * FedGP ``delta_thresh``: beta_i = sigma^2 / (sigma^2 + delta_i tau^2 d_i^2
      + (1 - delta_i) ||g_bar||^2 / m)

    Uses the clipped estimates, so each term is >= 0 and beta lies in [0, 1]. When
    sigma^2 = 0 the weight is 0 (the limit of sigma^2 / (sigma^2 + D) for D > 0; also used for
    0/0, where the target steps do not vary and nothing speaks for the sources). No absolute
    epsilon is added: the quantities are in squared-learning-rate units (often 1e-12 or less),
    where any fixed epsilon would bias beta.

    Returns:
        beta, shape (N,).

    Raises:
        ValueError: FedGP requested from summary statistics (no tau^2 d^2), or non-finite input.
    """
    r = _coerce_enum(Rule, rule, "rule")
    form = _coerce_enum(FedGPBetaForm, fedgp_beta_form, "fedgp_beta_form")
    if r is Rule.FEDDA:
        dist = stats.d2
    else:
        if stats.tau2d2 is None or stats.delta is None:
            raise ValueError(
                "FedGP auto-weights need tau^2 d^2 from the target's step updates "
                "(estimate_fda_stats); these statistics came from a summary (FedDA only)"
            )
        if form is FedGPBetaForm.DELTA1:
            dist = stats.tau2d2
        else:
            dist = stats.delta * stats.tau2d2 + (1.0 - stats.delta) * stats.target_norm2
    sigma2 = float(stats.target_var)
    dist = np.asarray(dist, dtype=np.float64)
    if not (np.isfinite(sigma2) and np.all(np.isfinite(dist))):
        raise ValueError("auto-weight statistics are not finite (overflowing updates?)")
    denom = sigma2 + dist
    safe = np.where(denom > 0, denom, 1.0)
    return np.clip(np.where(denom > 0, sigma2 / safe, 0.0), 0.0, 1.0)


def round_betas(config: FDAConfig, num_sources: int, stats: FDAStats | None = None) -> np.ndarray:
    """The beta_i used this round: ``config.beta`` for every source, or :func:`auto_betas`.

    With ``auto_weight`` and ``stats=None`` (the target took fewer than 2 steps, so no variance
    can be estimated) the fixed beta is used and a ``RuntimeWarning`` issued.

    Returns:
        beta, shape (num_sources,).
    """
    if isinstance(num_sources, bool) or not isinstance(num_sources, (int, np.integer)) or num_sources < 1:
        raise ValueError(f"num_sources must be an integer >= 1; got {num_sources!r}")
    if config.auto_weight:
        if stats is not None:
            betas = auto_betas(stats, config.rule, config.fedgp_beta_form)
            if betas.shape != (num_sources,):
                raise ValueError(f"stats hold {betas.size} sources but num_sources = {num_sources}")
            return betas
        warnings.warn(
            f"auto-weighting needs at least 2 target steps; using the fixed beta = {config.beta}",
            RuntimeWarning,
            stacklevel=2,
        )
    return np.full(num_sources, config.beta)


def delta_error_fedda(beta: float | np.ndarray, sigma2: float, d2: float) -> float | np.ndarray:
    """Delta error of FedDA for one source (Theorem 4.2, Eq. 1):
    (1 - beta)^2 sigma^2 + beta^2 d^2. Minimised by beta = sigma^2 / (sigma^2 + d^2)."""
    b = np.asarray(beta, dtype=np.float64)
    return (1.0 - b) ** 2 * sigma2 + b**2 * d2


def delta_error_fedgp(
    beta: float | np.ndarray,
    sigma2: float,
    tau2d2: float,
    dim: float = math.inf,
    delta: float = 1.0,
    target_norm2: float = 0.0,
) -> float | np.ndarray:
    """Approximate Delta error of FedGP for one source (Theorem 4.4, Eq. 2; App. A.4 form):
    ((1-beta)^2 + (2 beta - beta^2) delta / m) sigma^2 + beta^2 delta tau^2 d^2
    + beta^2 (1 - delta) ||g_T||^2. With m = inf and delta = 1 it is minimised by Eq. 3."""
    b = np.asarray(beta, dtype=np.float64)
    variance = ((1.0 - b) ** 2 + (2 * b - b**2) * delta / dim) * sigma2
    return variance + b**2 * delta * tau2d2 + b**2 * (1.0 - delta) * target_norm2
