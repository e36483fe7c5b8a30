"""pFedFDA's options: how beta is chosen and minimized (Eq. 9, paper §5.3, Table 5), covariance
regularization, the LDA solve, and :class:`PFedFDAConfig` with its ``paper()`` and
``official_code()`` presets and the flat ``key = value`` form (:data:`FLAT_KEYS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Literal

from flwr_pfl.core.pfedfda.checks import _as_bool, _check_int, _check_real, _enum_value, _plain


class BetaMode(str, Enum):
    """How the interpolation coefficient beta is chosen (paper §5.3, Table 5).

    * ``SINGLE`` (SB, the paper's main results and the recommended default): one beta for means
      and covariance, fitted by cross-validation (Eq. 9).
    * ``MULTI`` (MB, the official code's default flag): separate (beta_mu, beta_Sigma).
    * ``LOCAL`` (NB): beta = 1, local estimates only; no cross-validation.
    * ``FIXED``: a user-set constant (``BetaSearch.fixed_beta``); 0 gives the purely global
      generative classifier with local priors, a diagnostic.
    """

    SINGLE = "single"
    MULTI = "multi"
    LOCAL = "local"
    FIXED = "fixed"


class BetaSolver(str, Enum):
    """Minimizer of the cross-validated objective of Eq. 9.

    * ``LBFGS`` (default; what the official code does): unconstrained L-BFGS with a strong-Wolfe
      line search from x0 = 0.5, beta clipped to [0, 1] inside the objective and at the end.
      The gradient vanishes outside [0, 1], so it can stall at a bound; that is faithful.
    * ``GOLDEN``: a bounded search on [0, 1] (the paper's "L-BFGS-B" intent): golden-section
      search plus both end points for a single beta; cyclic coordinate golden-section sweeps for
      (beta_mu, beta_Sigma).
    """

    LBFGS = "lbfgs"
    GOLDEN = "golden"


class BetaStatus(str, Enum):
    """How a :class:`BetaResult` came about."""

    OPTIMIZED = "optimized"  # the solver ran and returned finite values
    LOCAL = "local"  # BetaMode.LOCAL: beta = 1
    FIXED = "fixed"  # BetaMode.FIXED
    CV_INFEASIBLE = "cv_infeasible"  # folds could not be built: beta = 0 (global statistics)
    SOLVER_FAILED = "solver_failed"  # the solver raised or returned non-finite: previous beta


LDASolve = Literal["lstsq", "inverse"]
"""How Sigma^-1 mu is formed: ``"lstsq"`` (paper §4.2, default) or an explicit ``"inverse"``."""


GlobalMeanInit = Literal["uniform", "gaussian"]
"""Initial global means: ``"uniform"`` U[0,1) as in the official code (default), or
``"gaussian"`` N(0, 1), the paper's "random spherical Gaussian"."""


@dataclass(frozen=True)
class CovRegularization:
    """Regularization of the local covariance estimate (paper §4.2; official code).

    The estimate is ``S/(N-1) + const_add * 1 1^T + ridge * I``, then, when ``pd_repair``,
    :func:`nearest_pd_same_variance` with eigenvalue threshold ``pd_threshold``.

    Defaults are the official code's, which produced the published tables (spec §9.2):
    ``ridge = 1.0`` (a full identity is added, a strong shrinkage that also makes the PD repair
    a no-op) and ``const_add = 1e-4`` added to *every* entry (probably meant as 1e-4 * I, kept
    for fidelity). :meth:`paper` gives the paper's "small diagonal eps I" (1e-4, no constant).

    Attributes:
        ridge: multiple of the identity added, >= 0.
        const_add: constant added to every entry, >= 0.
        pd_repair: replace a non-PD result with the nearest PD matrix of identical variances.
        pd_threshold: smallest eigenvalue allowed in the correlation matrix, > 0 (code: 1e-15).
    """

    ridge: float = 1.0
    const_add: float = 1e-4
    pd_repair: bool = True
    pd_threshold: float = 1e-15

    def __post_init__(self) -> None:
        _check_real("ridge", self.ridge, low=0.0)
        _check_real("const_add", self.const_add, low=0.0)
        _check_real("pd_threshold", self.pd_threshold, low=0.0, low_open=True)
        object.__setattr__(self, "pd_repair", _as_bool("pd_repair", self.pd_repair))

    @classmethod
    def official(cls) -> CovRegularization:
        """The official code's regularization: +I, +1e-4 on every entry, clipped PD repair."""
        return cls()

    @classmethod
    def paper(cls, eps: float = 1e-4) -> CovRegularization:
        """The paper's regularization: + eps I, then the clipped PD repair (§4.2)."""
        return cls(ridge=eps, const_add=0.0)


@dataclass(frozen=True)
class BetaSearch:
    """How beta is selected (Eq. 9; official code's solver settings).

    Attributes:
        mode: see :class:`BetaMode`; default ``SINGLE`` (spec §9.1).
        solver: see :class:`BetaSolver`; default ``LBFGS`` (code-faithful, spec §9.9).
        k_folds: number of cross-validation folds k (2 in all of the paper's experiments).
        cv_seed: seed of the stratified fold shuffle (the code uses 0).
        fixed_beta: beta for ``BetaMode.FIXED``, in [0, 1].
        x0: L-BFGS start, in [0, 1] (code: 0.5); also the start of the coordinate sweeps.
        max_iter: L-BFGS iterations (code: 10).
        gtol: L-BFGS stop when the largest |gradient| entry is below this (code: 1e-3).
        xtol: L-BFGS stop when the step or the loss change is below this (code: 1e-9).
        golden_tol: width of the final bracket of the golden-section search.
        golden_sweeps: coordinate sweeps of the bounded search in ``MULTI`` mode.
        float64: run the beta search in float64 (the code runs float32; use if unstable).
    """

    mode: BetaMode = BetaMode.SINGLE
    solver: BetaSolver = BetaSolver.LBFGS
    k_folds: int = 2
    cv_seed: int = 0
    fixed_beta: float = 0.5
    x0: float = 0.5
    max_iter: int = 10
    gtol: float = 1e-3
    xtol: float = 1e-9
    golden_tol: float = 1e-4
    golden_sweeps: int = 3
    float64: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _enum_value(BetaMode, self.mode, "beta_mode"))
        object.__setattr__(self, "solver", _enum_value(BetaSolver, self.solver, "beta_solver"))
        _check_int("k_folds", self.k_folds, low=2)
        _check_int("cv_seed", self.cv_seed, low=0)
        _check_real("fixed_beta", self.fixed_beta, low=0.0, high=1.0)
        _check_real("x0", self.x0, low=0.0, high=1.0)
        _check_int("max_iter", self.max_iter, low=1)
        _check_real("gtol", self.gtol, low=0.0)
        _check_real("xtol", self.xtol, low=0.0)
        _check_real("golden_tol", self.golden_tol, low=0.0, low_open=True)
        _check_int("golden_sweeps", self.golden_sweeps, low=1)
        object.__setattr__(self, "float64", _as_bool("beta_float64", self.float64))


@dataclass(frozen=True)
class PFedFDAConfig:
    """Every client-side option of pFedFDA's statistics, beta search and head.

    The default is what produced the paper's tables: single beta (the paper, Table 5 cross-check)
    with the official code's covariance regularization and solver. :meth:`paper` and
    :meth:`official_code` are the two presets of spec §10.

    Attributes:
        beta: beta selection (:class:`BetaSearch`).
        cov: covariance regularization (:class:`CovRegularization`).
        lda_shrinkage: eps of the head's shrinkage Sigma~ = (1-eps) Sigma + eps tr(Sigma)/d I,
            in [0, 1) (code: 1e-4; 0 turns it off).
        lda_solve: ``"lstsq"`` (default, paper §4.2) or ``"inverse"`` for Sigma~^-1 mu.
        prior_eps: smoothing of the label priors, pi^c ∝ n^c/n + eps, >= 0 (code: 1e-4).
        min_class_count: a class gets its own local mean only with *more than* this many rows;
            otherwise the global mean is used (spec §9.10; default 2 as the code's evaluation
            path; 0 reproduces the code's training path, where any present class qualifies).
    """

    beta: BetaSearch = field(default_factory=BetaSearch)
    cov: CovRegularization = field(default_factory=CovRegularization)
    lda_shrinkage: float = 1e-4
    lda_solve: LDASolve = "lstsq"
    prior_eps: float = 1e-4
    min_class_count: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.beta, BetaSearch):
            raise ValueError(f"beta must be a BetaSearch, got {type(self.beta).__name__}")
        if not isinstance(self.cov, CovRegularization):
            raise ValueError(f"cov must be a CovRegularization, got {type(self.cov).__name__}")
        _check_real("lda_shrinkage", self.lda_shrinkage, low=0.0, high=1.0, high_open=True)
        if self.lda_solve not in ("lstsq", "inverse"):
            raise ValueError(f"lda_solve must be 'lstsq' or 'inverse', got {self.lda_solve!r}")
        _check_real("prior_eps", self.prior_eps, low=0.0)
        _check_int("min_class_count", self.min_class_count, low=0)

    @classmethod
    def paper(cls) -> PFedFDAConfig:
        """The paper's variant: single beta, bounded solver ("L-BFGS-B"), eps I ridge."""
        return cls(beta=BetaSearch(mode=BetaMode.SINGLE, solver=BetaSolver.GOLDEN), cov=CovRegularization.paper())

    @classmethod
    def official_code(cls) -> PFedFDAConfig:
        """The official code's defaults: multi beta, L-BFGS, +I ridge (+1e-4 on every entry)."""
        return cls(beta=BetaSearch(mode=BetaMode.MULTI, solver=BetaSolver.LBFGS), cov=CovRegularization.official())

    def to_flat(self) -> dict[str, bool | int | float | str]:
        """The options as one flat dict of scalars (Flower's config values), keys as :data:`FLAT_KEYS`."""
        return {
            key: _plain(getattr(getattr(self, part) if part else self, attr)) for key, (part, attr) in _FLAT.items()
        }

    @classmethod
    def from_flat(cls, values: Mapping[str, Any], base: PFedFDAConfig | None = None) -> PFedFDAConfig:
        """Build a config from flat scalars (snake_case or kebab-case keys), others from ``base``.

        Raises:
            ValueError: an unknown key (the message lists the allowed ones) or a bad value.
        """
        base = cls() if base is None else base
        parts: dict[str, dict[str, Any]] = {"": {}, "beta": {}, "cov": {}}
        for raw_key, value in values.items():
            key = raw_key.replace("-", "_")
            if key not in _FLAT:
                raise ValueError(f"unknown pFedFDA option {raw_key!r}; allowed: {sorted(_FLAT)}")
            part, attr = _FLAT[key]
            parts[part][attr] = value
        beta = replace(base.beta, **parts["beta"])
        cov = replace(base.cov, **parts["cov"])
        return replace(base, beta=beta, cov=cov, **parts[""])


_FLAT: dict[str, tuple[str, str]] = {
    "beta_mode": ("beta", "mode"),
    "beta_solver": ("beta", "solver"),
    "k_folds": ("beta", "k_folds"),
    "cv_seed": ("beta", "cv_seed"),
    "beta_fixed": ("beta", "fixed_beta"),
    "beta_x0": ("beta", "x0"),
    "lbfgs_max_iter": ("beta", "max_iter"),
    "lbfgs_gtol": ("beta", "gtol"),
    "lbfgs_xtol": ("beta", "xtol"),
    "golden_tol": ("beta", "golden_tol"),
    "golden_sweeps": ("beta", "golden_sweeps"),
    "beta_float64": ("beta", "float64"),
    "cov_ridge": ("cov", "ridge"),
    "cov_const_add": ("cov", "const_add"),
    "pd_repair": ("cov", "pd_repair"),
    "pd_threshold": ("cov", "pd_threshold"),
    "lda_shrinkage": ("", "lda_shrinkage"),
    "lda_solve": ("", "lda_solve"),
    "prior_eps": ("", "prior_eps"),
    "min_class_count": ("", "min_class_count"),
}


FLAT_KEYS: tuple[str, ...] = tuple(_FLAT)
"""Keys of :meth:`PFedFDAConfig.to_flat` / :meth:`PFedFDAConfig.from_flat` (kebab-case accepted too)."""
