"""FedDAR's options: the head aggregation rule (WA or SA, Sec. 4.3), the head loss (which fixes the
head Hessian), where the Hessian is evaluated, and the options of second-order aggregation
(Eq. 8): client weights alpha, linear solver and damping.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np


class HeadAggregation(str, Enum):
    """Server rule for the domain heads (Sec. 4.3).

    ``WA``: count-weighted average, w_m = sum_i (L_{i,m} / L_m) w_{i,m} (FedDAR-WA).
    ``SA``: second-order aggregation, Eq. 8 (FedDAR-SA).
    """

    WA = "wa"
    SA = "sa"


class HeadLoss(str, Enum):
    """Loss of a linear head, which fixes its Hessian (Sec. 4.3).

    ``SQUARED``: sum_c (o_c - y_c)^2 per sample (N >= 1 outputs); Hessian 2 I kron phi phi^T.
    ``LOGISTIC``: binary cross-entropy on one logit (N = 1), targets in [0, 1];
    Hessian mu (1 - mu) phi phi^T (the paper's binary example).
    ``SOFTMAX``: multiclass cross-entropy on N >= 2 logits, integer targets in [0, N); Hessian
    (diag(p) - p p^T) kron phi phi^T. It is singular by construction (adding one vector to every
    class row changes no prediction), so SA needs damping or a pseudo-inverse (:class:`SASolver`).
    """

    SQUARED = "squared"
    LOGISTIC = "logistic"
    SOFTMAX = "softmax"


class HessianAt(str, Enum):
    """Point at which a client evaluates its head Hessian for SA.

    ``LOCAL`` (default): at the locally updated head, as Algorithm 1 writes it.
    ``GLOBAL``: at the round-start global head, as the Newton-step derivation of Eq. 8 assumes.
    Identical for squared loss, whose Hessian does not depend on the head.
    """

    LOCAL = "local"
    GLOBAL = "global"


class SAWeighting(str, Enum):
    """Client weights alpha in Eq. 8 when Hessians are mean (1/L_{i,m}-normalised) Hessians.

    ``DOMAIN_COUNT`` (default): alpha_{i,m} proportional to L_{i,m}, consistent with
    R_m = sum_i (L_{i,m} / L_m) R_{i,m}; makes SA on squared loss equal pooled least squares.
    ``CLIENT_COUNT``: alpha_i proportional to L_i, Eq. 7 read literally (clients without samples
    of the domain still contribute nothing).
    """

    DOMAIN_COUNT = "domain_count"
    CLIENT_COUNT = "client_count"


class SASolver(str, Enum):
    """How the server solves A w = b with A = sum_i alpha_i H_i, b = sum_i alpha_i H_i w_i.

    ``DAMPED`` (default, a safeguard not in the paper): w = (A + lam I)^{-1} (b + lam w_prev), a
    proximal pull toward the previous global head (Levenberg-Marquardt damping of the Newton
    step that Eq. 8 is); lam is at least damping * trace(A) / P, and raised until the step
    ||w - w_prev|| fits the trust region of ``SAOptions.trust_radius``. Finite for singular A
    (softmax heads, small domains); equal to Eq. 8 when damping = 0.
    ``PINV``: w = w_prev + A^+ (b - A w_prev), the solution of the least-squares system nearest to
    the previous head; equals Eq. 8 whenever A is invertible.
    ``EXACT``: Eq. 8 as written, w = A^{-1} b; raises ValueError when A is singular or its
    condition number exceeds ``cond_threshold``.
    """

    DAMPED = "damped"
    PINV = "pinv"
    EXACT = "exact"


@dataclass(frozen=True)
class SAOptions:
    """Options of second-order aggregation (Eq. 8).

    Attributes:
        weighting: client weights alpha, default :attr:`SAWeighting.DOMAIN_COUNT`.
        solver: linear solve, default :attr:`SASolver.DAMPED`.
        damping: relative damping for ``DAMPED`` (lam >= damping * trace(A) / P), default 1e-6;
            0 reproduces the paper's undamped Eq. 8 (and turns the trust region off).
        fallback_to_wa: when the condition number of A exceeds ``cond_threshold``, use WA for
            that domain instead of solving (default False).
        cond_threshold: condition-number limit for ``fallback_to_wa`` and ``EXACT``, and
            1 / cond_threshold is the relative cutoff of ``PINV`` (default 1e12).
        trust_radius: trust region of ``DAMPED`` (a safeguard not in the paper): each domain
            head moves at most trust_radius x the longest local step max_i ||w_{i,m} - w_prev||
            of the clients holding the domain; lam is raised to the smallest value that keeps
            the step inside. Eq. 8 is the minimiser of the sum of the clients' second-order
            models of their losses (Sec. 4.3); for softmax and logistic heads those models hold
            only near the point they were taken, and the summed softmax Hessian has many
            near-zero eigenvalues (weak feature directions, saturated probabilities: Sec. 4.3's
            stability remark), along
            which the undamped solve moves the head arbitrarily far. Not applied to squared-loss
            heads, whose second-order model is the loss itself (SA stays pooled least squares).
            Default 1.0 (SA never steps farther than the farthest client did); 0 = off.
    """

    weighting: SAWeighting = SAWeighting.DOMAIN_COUNT
    solver: SASolver = SASolver.DAMPED
    damping: float = 1e-6
    fallback_to_wa: bool = False
    cond_threshold: float = 1e12
    trust_radius: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "weighting", SAWeighting(self.weighting))
        object.__setattr__(self, "solver", SASolver(self.solver))
        if not (np.isfinite(self.damping) and self.damping >= 0):
            raise ValueError(f"SAOptions.damping must be a finite number >= 0, got {self.damping}")
        if not (np.isfinite(self.trust_radius) and self.trust_radius >= 0):
            raise ValueError(f"SAOptions.trust_radius must be a finite number >= 0, got {self.trust_radius}")
        if not self.cond_threshold > 1:
            raise ValueError(f"SAOptions.cond_threshold must be > 1, got {self.cond_threshold}")
