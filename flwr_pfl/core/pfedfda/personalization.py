"""The client step after local training and the personalized model at test time (Alg. 1 lines 8-11;
App. C.3).

:func:`personalize` estimates the local statistics, selects beta (Eq. 9), interpolates (Alg. 1
lines 10-11) and builds the client's LDA head (Eq. 3-4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flwr_pfl.core.pfedfda.beta import BetaResult, solve_beta
from flwr_pfl.core.pfedfda.checks import ArrayLike, _client_inputs, _num_classes
from flwr_pfl.core.pfedfda.interpolation import _mix
from flwr_pfl.core.pfedfda.lda import _lda_head, label_priors
from flwr_pfl.core.pfedfda.options import PFedFDAConfig
from flwr_pfl.core.pfedfda.statistics import estimate_statistics


@dataclass(frozen=True, eq=False)
class Personalization:
    """A client's adapted statistics and its personalized LDA head.

    Attributes:
        beta: the :class:`BetaResult` used.
        means: interpolated mu_i (C, d) (uploaded after ``fit``).
        cov: interpolated Sigma_i (d, d) (uploaded after ``fit``).
        priors: pi_i (C,).
        weight: head weight W_i (C, d); bias: b_i (C,).
    """

    beta: BetaResult
    means: torch.Tensor
    cov: torch.Tensor
    priors: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor


def personalize(
    features: ArrayLike,
    labels: ArrayLike,
    global_means: ArrayLike,
    global_cov: ArrayLike,
    *,
    priors: ArrayLike | None = None,
    config: PFedFDAConfig = PFedFDAConfig(),
    previous_beta: float | tuple[float, float] = 0.5,
) -> Personalization:
    """Alg. 1 lines 8-11 on a feature bank, plus the personalized head (§4.3 "At test time").

    1. beta by :func:`solve_beta` (line 9); 2. (mu_hat, Sigma_hat) by
    :func:`estimate_statistics` (line 8); 3. interpolation with mu_g, Sigma_g (lines 10-11);
    4. W_i, b_i = :func:`lda_head` (mu_i, Sigma_i, pi_i).

    After local training (``fit``) the features are the round's feature bank and
    (``means``, ``cov``) are uploaded. For evaluation and for new clients (Table 4) the features
    are the training split seen by the *global* backbone, and ``weight``/``bias`` score the test
    split (spec §9.6).

    Args:
        features: Z (N, d); labels: Y (N,) in [0, C).
        global_means: mu_g (C, d); global_cov: Sigma_g (d, d).
        priors: pi_i (C,); default: :func:`label_priors` of ``labels`` with ``config.prior_eps``
            (pass the priors of the whole training split when the bank is a subset of it).
        config: options. previous_beta: the solver-failure fallback.
    """
    z, y, mu_g, cov_g, pi = _client_inputs(
        features, labels, global_means, global_cov,
        label_priors(labels, _num_classes(global_means), config.prior_eps) if priors is None else priors,
    )
    beta = solve_beta(z, y, mu_g, cov_g, pi, config=config, previous_beta=previous_beta)
    mu_hat, cov_hat = estimate_statistics(
        z, y, mu_g, min_class_count=config.min_class_count, regularization=config.cov
    )
    means = _mix(mu_hat, mu_g, beta.beta_mu)
    cov = _mix(cov_hat, cov_g, beta.beta_sigma)
    weight, bias = _lda_head(means, cov, torch.log(pi), config.lda_shrinkage, config.lda_solve)
    return Personalization(beta=beta, means=means, cov=cov, priors=pi, weight=weight, bias=bias)
