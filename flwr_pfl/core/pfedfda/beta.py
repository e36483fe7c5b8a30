"""Minimization of the cross-validated objective of Eq. 9 over beta (Alg. 1 line 10).

:func:`solve_beta` picks beta by the configured mode and solver (L-BFGS as in the official code,
or golden-section search on [0, 1]) and falls back to the previous beta when the solver fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flwr_pfl.core.pfedfda.checks import ArrayLike, _check_real, _client_inputs, _less
from flwr_pfl.core.pfedfda.cross_validation import CVInfeasible, build_cv_folds, cv_objective
from flwr_pfl.core.pfedfda.options import (
    BetaMode,
    BetaSearch,
    BetaSolver,
    BetaStatus,
    PFedFDAConfig,
)


@dataclass(frozen=True)
class BetaResult:
    """The interpolation coefficients a client uses, and how they came about.

    Attributes:
        beta_mu: beta for the means, in [0, 1].
        beta_sigma: beta for the covariance, in [0, 1] (equal to beta_mu unless MULTI).
        status: :class:`BetaStatus`.
        objective: f(beta) of Eq. 9 at the result (NaN when not evaluated).
        reason: why a fallback was taken (empty otherwise).
    """

    beta_mu: float
    beta_sigma: float
    status: BetaStatus
    objective: float = math.nan
    reason: str = ""

    @property
    def fallback(self) -> bool:
        """True when beta came from a fallback (CV infeasible or solver failure)."""
        return self.status in (BetaStatus.CV_INFEASIBLE, BetaStatus.SOLVER_FAILED)

    def as_metrics(self) -> dict[str, float]:
        """Scalars for a Flower metrics dict: beta_mu, beta_sigma, beta_fallback (0/1)."""
        return {"beta_mu": self.beta_mu, "beta_sigma": self.beta_sigma, "beta_fallback": float(self.fallback)}


def golden_section_minimize(
    f: Callable[[float], float], low: float = 0.0, high: float = 1.0, tol: float = 1e-4
) -> tuple[float, float]:
    """Bounded scalar minimization on [low, high]: golden-section search, then the end points.

    Exact for unimodal f up to ``tol``; a minimum at a bound is returned exactly because both
    end points are evaluated too. Returns (x*, f(x*)); non-finite values never win.
    """
    _check_real("golden_tol", tol, low=0.0, low_open=True)
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = low, high
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if _less(fc, fd):
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    candidates = [(c, fc), (d, fd), (low, f(low)), (high, f(high))]
    best = candidates[0]
    for x, fx in candidates[1:]:
        if _less(fx, best[1]):
            best = (x, fx)
    return best


def solve_beta(
    features: ArrayLike,
    labels: ArrayLike,
    global_means: ArrayLike,
    global_cov: ArrayLike,
    priors: ArrayLike,
    *,
    config: PFedFDAConfig = PFedFDAConfig(),
    previous_beta: float | tuple[float, float] = 0.5,
) -> BetaResult:
    """Select beta by k-fold cross-validation (Eq. 9; Alg. 1 line 9).

    * ``LOCAL`` mode: beta = 1; ``FIXED``: the configured constant; neither builds folds.
    * Otherwise the folds of :func:`build_cv_folds` are built; if that is impossible
      (:class:`CVInfeasible`: fewer rows than folds, or a fold too small for a covariance)
      the result is beta = 0, i.e. purely global statistics (code behaviour, spec §9.8).
    * The objective :func:`cv_objective` is minimized over beta in [0, 1] with the configured
      :class:`BetaSolver`; a solver that raises or returns non-finite values gives
      ``previous_beta`` (the client's last beta, 0.5 at first) with status SOLVER_FAILED.

    Args:
        features: the feature bank Z (N, d); labels: Y (N,) in [0, C).
        global_means: mu_g (C, d); global_cov: Sigma_g (d, d).
        priors: the client's label priors pi (C,), from its whole training split.
        config: options (:class:`PFedFDAConfig`).
        previous_beta: fallback beta, or (beta_mu, beta_Sigma), in [0, 1].
    """
    search = config.beta
    prev_mu, prev_sigma = previous_beta if isinstance(previous_beta, tuple) else (previous_beta, previous_beta)
    _check_real("previous beta_mu", prev_mu, low=0.0, high=1.0)
    _check_real("previous beta_sigma", prev_sigma, low=0.0, high=1.0)
    if search.mode is BetaMode.LOCAL:
        return BetaResult(1.0, 1.0, BetaStatus.LOCAL)
    if search.mode is BetaMode.FIXED:
        return BetaResult(search.fixed_beta, search.fixed_beta, BetaStatus.FIXED)

    z, y, mu_g, cov_g, pi = _client_inputs(features, labels, global_means, global_cov, priors)
    if search.float64:
        z, mu_g, cov_g, pi = (t.to(torch.float64) for t in (z, mu_g, cov_g, pi))
    try:
        folds = build_cv_folds(
            z,
            y,
            mu_g,
            k_folds=search.k_folds,
            seed=search.cv_seed,
            min_class_count=config.min_class_count,
            regularization=config.cov,
        )
    except CVInfeasible as err:
        return BetaResult(0.0, 0.0, BetaStatus.CV_INFEASIBLE, reason=str(err))

    multi = search.mode is BetaMode.MULTI

    def objective(x: torch.Tensor) -> torch.Tensor:
        x = x.clamp(0.0, 1.0)
        return cv_objective(
            x[0], x[1] if multi else x[0], folds, mu_g, cov_g, pi,
            lda_shrinkage=config.lda_shrinkage, lda_solve=config.lda_solve,
        )

    try:
        if search.solver is BetaSolver.LBFGS:
            x = _minimize_lbfgs(objective, 2 if multi else 1, search, z.dtype, z.device)
        else:
            x = _minimize_golden(objective, 2 if multi else 1, search, z.dtype, z.device)
        with torch.no_grad():
            value = float(objective(x))
        if not (bool(torch.isfinite(x).all()) and math.isfinite(value)):
            raise FloatingPointError(f"solver returned beta={x.tolist()} with objective {value}")
    except (RuntimeError, FloatingPointError, ValueError) as err:
        return BetaResult(prev_mu, prev_sigma, BetaStatus.SOLVER_FAILED, reason=f"{type(err).__name__}: {err}")
    beta = x.clamp(0.0, 1.0).tolist()
    return BetaResult(beta[0], beta[-1], BetaStatus.OPTIMIZED, objective=value)


def _minimize_lbfgs(
    objective: Callable[[torch.Tensor], torch.Tensor],
    size: int,
    search: BetaSearch,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Unconstrained L-BFGS (strong-Wolfe, history 100) on the clipped objective, from x0."""
    x = torch.full((size,), search.x0, dtype=dtype, device=device, requires_grad=True)
    optimizer = torch.optim.LBFGS(
        [x],
        lr=1.0,
        max_iter=search.max_iter,
        max_eval=search.max_iter * 25,
        tolerance_grad=search.gtol,
        tolerance_change=search.xtol,
        history_size=100,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = objective(x)
        loss.backward()
        return loss

    optimizer.step(closure)
    return x.detach().clamp(0.0, 1.0)


def _minimize_golden(
    objective: Callable[[torch.Tensor], torch.Tensor],
    size: int,
    search: BetaSearch,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Bounded search: golden section for one beta; cyclic coordinate sweeps for two."""
    x = torch.full((size,), search.x0, dtype=dtype, device=device)
    with torch.no_grad():
        for _ in range(1 if size == 1 else search.golden_sweeps):
            for i in range(size):

                def along(t: float, i: int = i) -> float:
                    trial = x.clone()
                    trial[i] = t
                    return float(objective(trial))

                x[i] = golden_section_minimize(along, 0.0, 1.0, search.golden_tol)[0]
    return x
