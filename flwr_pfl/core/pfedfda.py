"""pFedFDA: personalized federated learning via feature distribution adaptation.

McLaughlin & Su, "Personalized Federated Learning via Feature Distribution Adaptation",
NeurIPS 2024. Every model is a shared feature extractor phi (x -> z in R^d) plus a per-client
*generative* classifier: class-conditional Gaussians N(z | mu^c, Sigma) with one covariance tied
across classes and the client's label priors pi, which Bayes' rule turns into a linear (LDA)
head (Eq. 3-4). The head is never trained; it is computed in closed form.

This module holds the mathematics only, free of Flower:

* options: :class:`BetaMode`, :class:`BetaSolver`, :class:`CovRegularization`,
  :class:`BetaSearch`, :class:`PFedFDAConfig` (presets ``paper()`` / ``official_code()``);
* the LDA head (Eq. 3-4): :func:`label_priors`, :func:`lda_head`, :func:`lda_logits`;
* feature statistics (Eq. 6-8): :func:`class_moments` (mergeable across mini-batches with
  :func:`merge_class_moments`), :func:`gaussian_estimates`, :func:`estimate_statistics`,
  covariance regularization :func:`regularize_covariance` and the PD repair
  :func:`nearest_pd_same_variance`;
* interpolation (Alg. 1 lines 10-11): :func:`interpolate_statistics`;
* beta selection by k-fold cross-validation (Eq. 9): :func:`stratified_kfold`,
  :func:`build_cv_folds`, :func:`cv_objective`, :func:`solve_beta`;
* the client step after local training, and the personalized model at test time (Alg. 1
  lines 8-11; App. C.3): :func:`personalize`;
* the server step (Alg. 1 lines 1-2 and 15): :func:`init_global_statistics`,
  :func:`bernoulli_participation`, :func:`aggregate_statistics`,
  :func:`check_client_statistics`, :func:`global_statistics_summary`,
  :func:`client_accuracy_summary`;
* the wire layout: :func:`join_wire`, :func:`split_wire`, :func:`cov_to_triu`,
  :func:`triu_to_cov`;
* theory and accounting: :func:`interpolated_mean_error`, :func:`optimal_interpolation_beta`
  (Theorem 1 / App. E), :func:`communication_cost` (Table 8).

Who calls what
--------------
Server (each round): send ``join_wire(backbone, mu_g, Sigma_g)``; receive from every sampled
client ``[backbone..., mu_i, Sigma_i]`` with ``num_examples = n_i``; check each reply with
:func:`check_client_statistics`; average everything with n_i weights (the whole server step is
FedAvg over the extended list, :func:`aggregate_statistics` for the two statistics arrays).

Client ``fit``: ``mu_g, Sigma_g = split_wire(arrays)``; ``pi = label_priors(train labels)``;
``W, b = lda_head(mu_g, Sigma_g, pi)`` frozen into the model's linear head; train phi; collect the
feature bank (Z, Y); ``p = personalize(Z, Y, mu_g, Sigma_g, priors=pi, previous_beta=...)``;
return ``join_wire(backbone, p.means, p.cov)`` and ``p.beta.as_metrics()``.

Client ``evaluate``: features of the training split from the *global* backbone;
``p = personalize(...)``; score the test split with ``lda_logits(z, p.weight, p.bias)``.

Conventions: client-side functions take ``torch.Tensor`` or NumPy arrays and return tensors on
the device and in the floating dtype of the features; server-side functions take and return
NumPy arrays (what crosses the wire). C is the number of classes, d the feature width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from flwr_pfl.core.aggregation import weighted_average
from flwr_pfl.core.metrics import summarize

ArrayLike = torch.Tensor | np.ndarray

# --------------------------------------------------------------------------------------------
# Input checks and conversions
# --------------------------------------------------------------------------------------------


def _float(
    x: ArrayLike,
    name: str,
    ndim: int,
    *,
    like: torch.Tensor | None = None,
) -> torch.Tensor:
    """A finite floating tensor of ``ndim`` dimensions (on ``like``'s device and dtype if given)."""
    t = torch.as_tensor(x)
    if like is not None:
        t = t.to(device=like.device, dtype=like.dtype)
    if not t.is_floating_point():
        t = t.to(torch.get_default_dtype())
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or Inf")
    return t


def _labels(
    labels: ArrayLike, num_classes: int, *, device: torch.device | None = None, n: int | None = None
) -> torch.Tensor:
    """A 1-D int64 label tensor with values in [0, num_classes)."""
    _check_int("num_classes", num_classes, low=1)
    y = torch.as_tensor(labels, device=device)
    if y.ndim != 1 or y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"labels must be a 1-D integer array, got shape {tuple(y.shape)} and dtype {y.dtype}")
    if n is not None and y.shape[0] != n:
        raise ValueError(f"got {n} feature rows but {y.shape[0]} labels")
    if y.numel() == 0:
        raise ValueError("labels are empty")
    y = y.long()
    lo, hi = int(y.min()), int(y.max())
    if lo < 0 or hi >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got values in [{lo}, {hi}]")
    return y


def _num_classes(global_means: ArrayLike) -> int:
    shape = tuple(torch.as_tensor(global_means).shape)
    if len(shape) != 2:
        raise ValueError(f"global_means must be (C, d), got shape {shape}")
    return shape[0]


def _client_inputs(
    features: ArrayLike, labels: ArrayLike, global_means: ArrayLike, global_cov: ArrayLike, priors: ArrayLike
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features, labels and global statistics checked and moved to the features' device/dtype."""
    z = _float(features, "features", 2)
    mu_g = _float(global_means, "global_means", 2, like=z)
    cov_g = _float(global_cov, "global_cov", 2, like=z)
    pi = _float(priors, "priors", 1, like=z)
    num_classes, dim = mu_g.shape
    if z.shape[1] != dim:
        raise ValueError(f"features have width {z.shape[1]} but global_means have width {dim}")
    if cov_g.shape != (dim, dim):
        raise ValueError(f"global_cov must have shape ({dim}, {dim}), got {tuple(cov_g.shape)}")
    if pi.shape != (num_classes,) or (pi < 0).any() or abs(float(pi.sum()) - 1.0) > 1e-4:
        raise ValueError(f"priors must be a ({num_classes},) vector >= 0 summing to 1")
    y = _labels(labels, num_classes, device=z.device, n=z.shape[0])
    return z, y, mu_g, cov_g, pi


def _check_counts(num_examples: Sequence[int], expected: int) -> np.ndarray:
    counts = np.asarray(num_examples, dtype=np.float64)
    if counts.shape != (expected,):
        raise ValueError(f"need one example count per client ({expected}), got shape {counts.shape}")
    for i, c in enumerate(counts):
        if not math.isfinite(c) or c < 0 or c != int(c):
            raise ValueError(f"client {i}'s example count must be a non-negative integer, got {num_examples[i]!r}")
    if counts.sum() <= 0:
        raise ValueError("all example counts are zero; nothing to aggregate")
    return counts


def _check_real(
    name: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    numeric = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
    if not numeric or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value}")


def _check_int(name: str, value: int, *, low: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _enum_value(enum: type[Enum], value: Any, name: str) -> Any:
    try:
        return enum(value)
    except ValueError:
        allowed = [m.value for m in enum]  # type: ignore[attr-defined]
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}") from None


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)) or value in (0, 1):
        return bool(value)
    raise ValueError(f"{name} must be a bool (or 0/1), got {value!r}")


def _plain(value: Any) -> bool | int | float | str:
    return value.value if isinstance(value, Enum) else value


def _numpy(x: ArrayLike) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _less(a: float, b: float) -> bool:
    """a < b, with non-finite values losing to finite ones."""
    if not math.isfinite(a):
        return False
    return not math.isfinite(b) or a < b


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Priors and the generative (LDA) head, Eq. 3-4
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Feature statistics, Eq. 6-8, and covariance regularization
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Interpolation, Alg. 1 lines 10-11
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# beta selection by k-fold cross-validation, Eq. 9
# --------------------------------------------------------------------------------------------


class CVInfeasible(ValueError):
    """The cross-validation folds of Eq. 9 cannot be built (too few rows or classes).

    :func:`solve_beta` answers it with beta = 0, i.e. purely global statistics, as the official
    code does (spec §9.8).
    """


def stratified_kfold(labels: ArrayLike, k: int = 2, seed: int = 0) -> np.ndarray:
    """Stratified k-fold assignment: the validation fold of every row, shape (N,), int64.

    Classes are numbered by order of first appearance; each class's rows are spread over the
    folds as evenly as possible by round-robin over the sorted labels, and the fold order within
    each class is shuffled with ``numpy.random.RandomState(seed)``, class by class. This is the
    rule of the reference stratified k-fold with shuffling that the official code uses (k = 2,
    seed 0), written in NumPy.

    Raises:
        CVInfeasible: k greater than the number of rows, or every class has fewer than k rows.
        ValueError: k < 2 or labels not a 1-D integer array.
    """
    _check_int("k_folds", k, low=2)
    y = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be a 1-D integer array, got shape {y.shape} and dtype {y.dtype}")
    n = y.size
    if k > n:
        raise CVInfeasible(f"k_folds={k} is greater than the number of samples ({n})")
    _, first_index, inverse = np.unique(y, return_index=True, return_inverse=True)
    _, class_order = np.unique(first_index, return_inverse=True)
    encoded = class_order[inverse]
    counts = np.bincount(encoded)
    if np.all(counts < k):
        raise CVInfeasible(f"k_folds={k} is greater than the number of members in every class {counts.tolist()}")
    by_class = np.sort(encoded)
    allocation = np.stack([np.bincount(by_class[i::k], minlength=counts.size) for i in range(k)])
    rng = np.random.RandomState(seed)
    folds = np.empty(n, dtype=np.int64)
    for c in range(counts.size):
        assignment = np.repeat(np.arange(k), allocation[:, c])
        rng.shuffle(assignment)
        folds[encoded == c] = assignment
    return folds


@dataclass(frozen=True, eq=False)
class CVFold:
    """One fold of Eq. 9: estimates from the fold's training part and its held-out rows.

    Attributes:
        means: mu_hat_j (C, d), global means for classes missing from the training part.
        cov: Sigma_hat_j (d, d), regularized.
        val_features: held-out features (n_val, d).
        val_labels: held-out labels (n_val,).
    """

    means: torch.Tensor
    cov: torch.Tensor
    val_features: torch.Tensor
    val_labels: torch.Tensor


def build_cv_folds(
    features: ArrayLike,
    labels: ArrayLike,
    global_means: ArrayLike,
    *,
    k_folds: int = 2,
    seed: int = 0,
    min_class_count: int = 2,
    regularization: CovRegularization = CovRegularization(),
) -> list[CVFold]:
    """The k folds of Eq. 9 (official code's procedure).

    Rows of classes with fewer than k rows are removed first (they still count in the priors);
    the rest is split by :func:`stratified_kfold`; each fold's training part gives
    (mu_hat_j, Sigma_hat_j) with the estimator of :func:`estimate_statistics`.

    Args:
        features: (N, d); labels: (N,) in [0, C); global_means: mu_g (C, d).

    Raises:
        CVInfeasible: fewer than k rows remain, or a fold's training part has fewer than 2 rows
            (its covariance would divide by zero).
    """
    z = _float(features, "features", 2)
    mu_g = _float(global_means, "global_means", 2, like=z)
    if z.shape[1] != mu_g.shape[1]:
        raise ValueError(f"features have width {z.shape[1]} but global_means have width {mu_g.shape[1]}")
    num_classes = mu_g.shape[0]
    y = _labels(labels, num_classes, device=z.device, n=z.shape[0])
    counts = torch.bincount(y, minlength=num_classes)
    keep = counts[y] >= k_folds
    if int(keep.sum()) < k_folds:
        raise CVInfeasible(
            f"after removing classes with fewer than k_folds={k_folds} rows, {int(keep.sum())} rows remain; "
            f"need at least {k_folds} (class counts {counts.tolist()})"
        )
    z, y = z[keep], y[keep]
    fold_of = torch.as_tensor(stratified_kfold(y, k_folds, seed), device=z.device)
    folds = []
    for j in range(k_folds):
        val = fold_of == j
        train = ~val
        if int(train.sum()) < 2:
            raise CVInfeasible(f"fold {j}'s training part has {int(train.sum())} rows; a covariance needs at least 2")
        means, cov = estimate_statistics(
            z[train], y[train], mu_g, min_class_count=min_class_count, regularization=regularization
        )
        folds.append(CVFold(means=means, cov=cov, val_features=z[val], val_labels=y[val]))
    return folds


def cv_objective(
    beta_mu: float | torch.Tensor,
    beta_sigma: float | torch.Tensor,
    folds: Sequence[CVFold],
    global_means: torch.Tensor,
    global_cov: torch.Tensor,
    priors: torch.Tensor,
    *,
    lda_shrinkage: float = 1e-4,
    lda_solve: LDASolve = "lstsq",
) -> torch.Tensor:
    """The cross-validated loss of Eq. 9 at (beta_mu, beta_Sigma):

        f(beta) = sum_j CE_mean(LDA_logits(Z_j^val; mix(mu_hat_j, mu_g, beta_mu),
                                           mix(Sigma_hat_j, Sigma_g, beta_Sigma), pi), Y_j^val),

    with mix(a, b, t) = t a + (1 - t) b.

    Eq. 9 as the official code evaluates it: the sum over folds of each fold's *mean*
    cross-entropy (the paper writes (1/k) sum over samples; the minimizer is the same for
    equal-size folds). Betas are used as given (clip them first); differentiable in both.

    Args:
        folds: from :func:`build_cv_folds`. global_means: mu_g (C, d). global_cov: Sigma_g (d, d).
        priors: pi (C,). All on the folds' device and dtype.

    Returns:
        A 0-d tensor.
    """
    log_priors = torch.log(priors)
    total = torch.zeros((), dtype=global_means.dtype, device=global_means.device)
    for fold in folds:
        weight, bias = _lda_head(
            _mix(fold.means, global_means, beta_mu),
            _mix(fold.cov, global_cov, beta_sigma),
            log_priors,
            lda_shrinkage,
            lda_solve,
        )
        total = total + F.cross_entropy(fold.val_features @ weight.T + bias, fold.val_labels)
    return total


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


# --------------------------------------------------------------------------------------------
# Client step: Alg. 1 lines 8-11, and the personalized model (App. C.3)
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Server step: Alg. 1 lines 1-2 and 15
# --------------------------------------------------------------------------------------------


def init_global_statistics(
    num_classes: int, dim: int, *, init: GlobalMeanInit = "uniform", seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Initial (mu_g^0, Sigma_g^0) (Alg. 1 line 2): means (C, d) and I_d, float32.

    ``init="uniform"`` draws U[0,1) as the official code does (default, spec §9.13);
    ``"gaussian"`` draws N(0, 1), the paper's "random spherical Gaussian".
    """
    _check_int("num_classes", num_classes, low=1)
    _check_int("dim", dim, low=1)
    rng = np.random.default_rng(seed)
    if init == "uniform":
        means = rng.random((num_classes, dim))
    elif init == "gaussian":
        means = rng.standard_normal((num_classes, dim))
    else:
        raise ValueError(f"init must be 'uniform' or 'gaussian', got {init!r}")
    return means.astype(np.float32), np.eye(dim, dtype=np.float32)


def bernoulli_participation(
    num_clients: int, q: float, rng: np.random.Generator, *, full: bool = False, ensure_nonempty: bool = True
) -> np.ndarray:
    """Indices of the clients taking part in a round: each independently with probability q.

    The paper and code sample Bernoulli(q) per client and use full participation in the last
    round (``full=True``). An empty draw (possible; the code would divide by zero) becomes one
    client chosen uniformly when ``ensure_nonempty`` (spec §9.15). Returns sorted int64 indices.
    """
    _check_int("num_clients", num_clients, low=1)
    _check_real("q", q, low=0.0, high=1.0)
    if full:
        return np.arange(num_clients, dtype=np.int64)
    chosen = np.flatnonzero(rng.random(num_clients) < q).astype(np.int64)
    if chosen.size == 0 and ensure_nonempty:
        chosen = np.array([rng.integers(num_clients)], dtype=np.int64)
    return chosen


def aggregate_statistics(
    means: Sequence[np.ndarray], covs: Sequence[np.ndarray], num_examples: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Server update of the Gaussian statistics (Alg. 1 line 15): n_i-weighted means.

    mu_g' = sum_i w_i mu_i and Sigma_g' = sum_i w_i Sigma_i with w_i = n_i / sum_j n_j: the
    count-weighted pooled covariance of the uploaded (already interpolated) covariances, with
    no between-client mean-shift term (spec §3.2d). It is the FedAvg rule applied to the last
    two wire arrays, so averaging the whole list [backbone..., mu, Sigma] with FedAvg gives the
    same result. With single beta it reads as a moving average
    mu_g' = sum_i w_i beta_i mu_hat_i + (1 - sum_i w_i beta_i) mu_g. Accumulates in float64;
    returns the input dtype; Sigma_g' is symmetrized.

    Args:
        means: per client mu_i (C, d); covs: per client Sigma_i (d, d);
        num_examples: per client n_i (training-split size), >= 0, not all 0.

    Raises:
        ValueError: mismatched lengths or shapes, or invalid counts.
    """
    if len(means) != len(covs):
        raise ValueError(f"got {len(means)} mean arrays but {len(covs)} covariance arrays")
    counts = _check_counts(num_examples, len(means))
    mu, cov = weighted_average([[np.asarray(m), np.asarray(c)] for m, c in zip(means, covs)], counts)
    return mu, (0.5 * (cov + cov.T)).astype(cov.dtype)


def check_client_statistics(
    means: np.ndarray, cov: np.ndarray, num_classes: int, dim: int, *, psd_tol: float = 1e-5
) -> None:
    """Validate a client's uploaded (mu_i, Sigma_i) before aggregation.

    Raises ValueError naming what is wrong: shapes other than (C, d) and (d, d), NaN/Inf,
    an asymmetric covariance, or an eigenvalue below -psd_tol * (largest |eigenvalue|).
    """
    mu, sigma = np.asarray(means), np.asarray(cov)
    if mu.shape != (num_classes, dim):
        raise ValueError(f"means must have shape ({num_classes}, {dim}), got {mu.shape}")
    if sigma.shape != (dim, dim):
        raise ValueError(f"cov must have shape ({dim}, {dim}), got {sigma.shape}")
    if not np.isfinite(mu).all():
        raise ValueError("means contain NaN or Inf")
    if not np.isfinite(sigma).all():
        raise ValueError("cov contains NaN or Inf")
    s64 = sigma.astype(np.float64)
    scale = max(float(np.abs(s64).max()), 1e-30)
    if float(np.abs(s64 - s64.T).max()) > 1e-5 * scale:
        raise ValueError("cov is not symmetric")
    evals = np.linalg.eigvalsh(0.5 * (s64 + s64.T))
    if evals[0] < -psd_tol * max(float(np.abs(evals).max()), 1e-30):
        raise ValueError(f"cov is not positive semi-definite (smallest eigenvalue {evals[0]:.3g})")


def global_statistics_summary(means: np.ndarray, cov: np.ndarray) -> dict[str, float]:
    """Per-round log scalars (spec §10): ||mu_g||_F, tr(Sigma_g) and the condition number of Sigma_g."""
    mu, sigma = np.asarray(means, dtype=np.float64), np.asarray(cov, dtype=np.float64)
    evals = np.linalg.eigvalsh(0.5 * (sigma + sigma.T))
    cond = float(evals[-1] / evals[0]) if evals[0] > 0 else math.inf
    return {"mu_g_norm": float(np.linalg.norm(mu)), "sigma_g_trace": float(np.trace(sigma)), "sigma_g_cond": cond}


def client_accuracy_summary(accuracies: Sequence[float], num_test: Sequence[int]) -> dict[str, float]:
    """Accuracy across clients as the paper and code report it (§3.2e, spec §9.14).

    ``wmean`` is weighted by test-set size (what the code prints); ``mean`` is unweighted and
    ``std_bessel`` is the across-client standard deviation with Bessel's correction (what the
    paper's "average (std)" shows; 0 for a single client); plus min, max and population std.
    """
    out = summarize(accuracies, num_test)
    values = np.asarray(accuracies, dtype=np.float64)
    values = values[np.isfinite(values)]
    out["std_bessel"] = float(values.std(ddof=1)) if values.size > 1 else 0.0
    return out


# --------------------------------------------------------------------------------------------
# Wire layout
# --------------------------------------------------------------------------------------------


def join_wire(
    backbone: Sequence[np.ndarray], means: ArrayLike, cov: ArrayLike, *, packed_cov: bool = False
) -> list[np.ndarray]:
    """The message [backbone arrays..., mu (C, d), Sigma (d, d)] (spec §8; the head is not sent).

    With ``packed_cov`` Sigma travels as its upper triangle, d(d+1)/2 values (Table 8 counting).
    """
    mu = _numpy(means)
    sigma = _numpy(cov)
    return [*(np.asarray(a) for a in backbone), mu, cov_to_triu(sigma) if packed_cov else sigma]


def split_wire(
    arrays: Sequence[np.ndarray], *, packed_cov: bool = False
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Inverse of :func:`join_wire`: (backbone arrays, mu (C, d), Sigma (d, d)).

    Raises:
        ValueError: fewer than two arrays, or trailing arrays of the wrong shapes.
    """
    if len(arrays) < 2:
        raise ValueError(f"a pFedFDA message ends with [means, cov]; got {len(arrays)} arrays")
    *backbone, mu, sigma = (np.asarray(a) for a in arrays)
    if mu.ndim != 2:
        raise ValueError(f"means must be 2-D (C, d), got shape {mu.shape}")
    if packed_cov:
        sigma = triu_to_cov(sigma, mu.shape[1])
    if sigma.shape != (mu.shape[1], mu.shape[1]):
        raise ValueError(f"cov must have shape ({mu.shape[1]}, {mu.shape[1]}), got {sigma.shape}")
    return backbone, mu, sigma


def cov_to_triu(cov: np.ndarray) -> np.ndarray:
    """Upper triangle (row-major, with diagonal) of a symmetric (d, d) matrix: d(d+1)/2 values."""
    sigma = np.asarray(cov)
    if sigma.ndim != 2 or sigma.shape[0] != sigma.shape[1]:
        raise ValueError(f"cov must be square, got shape {sigma.shape}")
    return sigma[np.triu_indices(sigma.shape[0])]


def triu_to_cov(values: np.ndarray, dim: int) -> np.ndarray:
    """Symmetric (d, d) matrix from its packed upper triangle (inverse of :func:`cov_to_triu`)."""
    v = np.asarray(values)
    if v.shape != (dim * (dim + 1) // 2,):
        raise ValueError(f"a packed {dim}x{dim} covariance has {dim * (dim + 1) // 2} values, got shape {v.shape}")
    out = np.zeros((dim, dim), dtype=v.dtype)
    out[np.triu_indices(dim)] = v
    return out + np.triu(out, 1).T


# --------------------------------------------------------------------------------------------
# Theorem 1 (App. E): bias and variance of the interpolated mean
# --------------------------------------------------------------------------------------------


def interpolated_mean_error(
    beta: float, client: int, means: np.ndarray, cov_traces: Sequence[float], counts: Sequence[int]
) -> float:
    """Exact E||mu_hat_i - theta_i||^2 of the interpolated mean (Theorem 1 setting, App. E).

    Client i' has n_i' samples z ~ N(theta_i', Sigma_i'); mu_i is client i's sample mean,
    mu_g = sum_i' n_i' mu_i' / N the pooled mean and mu_hat_i = beta mu_i + (1 - beta) mu_g.
    With gamma = beta + (1 - beta) n_i/N and theta_g = sum_i' n_i' theta_i' / N (App. E's
    decomposition mu_hat_i = gamma mu_i + (1 - beta) mu_bar):

        E = (1-beta)^2 ||theta_g - theta_i||^2 + gamma^2 Tr(Sigma_i)/n_i
            + (1-beta)^2 sum_{i' != i} n_i' Tr(Sigma_i') / N^2.

    The paper's high-probability bound adds an unknown constant c; this is its exact mean.

    Args:
        beta: in [0, 1]. client: index i. means: theta (M, d). cov_traces: Tr(Sigma_i') (M,).
        counts: n_i' (M,), > 0.
    """
    theta, traces, n = _theorem_inputs(client, means, cov_traces, counts)
    _check_real("beta", beta, low=0.0, high=1.0)
    bias2, var_local, var_others, p = _theorem_terms(client, theta, traces, n)
    gamma = beta + (1.0 - beta) * p
    return (1.0 - beta) ** 2 * (bias2 + var_others) + gamma**2 * var_local


def optimal_interpolation_beta(
    client: int, means: np.ndarray, cov_traces: Sequence[float], counts: Sequence[int]
) -> float:
    """The beta in [0, 1] minimizing :func:`interpolated_mean_error` (a quadratic in beta).

    With u = 1 - beta and p = n_i/N: u* = (1-p) V_i / (B + V_o + (1-p)^2 V_i), where
    B = ||theta_g - theta_i||^2, V_i = Tr(Sigma_i)/n_i, V_o = sum_{i'!=i} n_i' Tr(Sigma_i')/N^2;
    beta* = clip(1 - u*, 0, 1). It is never worse than beta = 0 or beta = 1.
    """
    theta, traces, n = _theorem_inputs(client, means, cov_traces, counts)
    bias2, var_local, var_others, p = _theorem_terms(client, theta, traces, n)
    denom = bias2 + var_others + (1.0 - p) ** 2 * var_local
    if denom <= 0:
        return 1.0
    return float(min(max(1.0 - (1.0 - p) * var_local / denom, 0.0), 1.0))


def _theorem_inputs(
    client: int, means: np.ndarray, cov_traces: Sequence[float], counts: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    theta = np.asarray(means, dtype=np.float64)
    traces = np.asarray(cov_traces, dtype=np.float64)
    n = np.asarray(counts, dtype=np.float64)
    if theta.ndim != 2 or traces.shape != (theta.shape[0],) or n.shape != (theta.shape[0],):
        raise ValueError(
            f"means must be (M, d) with M cov_traces and M counts; got {theta.shape}, {traces.shape}, {n.shape}"
        )
    if (n <= 0).any() or (traces < 0).any():
        raise ValueError("counts must be > 0 and cov_traces >= 0")
    if not 0 <= client < theta.shape[0]:
        raise ValueError(f"client must be in [0, {theta.shape[0]}), got {client}")
    return theta, traces, n


def _theorem_terms(
    client: int, theta: np.ndarray, traces: np.ndarray, n: np.ndarray
) -> tuple[float, float, float, float]:
    """(B, V_i, V_o, p) of :func:`interpolated_mean_error`."""
    total = n.sum()
    theta_g = (n[:, None] * theta).sum(0) / total
    others = np.arange(n.size) != client
    bias2 = float(((theta_g - theta[client]) ** 2).sum())
    var_local = float(traces[client] / n[client])
    var_others = float((n[others] * traces[others]).sum() / total**2)
    return bias2, var_local, var_others, float(n[client] / total)


# --------------------------------------------------------------------------------------------
# Communication (Table 8)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommunicationCost:
    """Parameters sent per client per round (Table 8).

    Attributes:
        backbone: backbone parameters. linear_head: C (d + 1) (+ any hidden head layer).
        gaussian: C d + (d^2 + d)/2 (means plus the distinct covariance entries).
        overhead: (gaussian - linear_head) / (backbone + linear_head), a fraction.
    """

    backbone: int
    linear_head: int
    gaussian: int
    overhead: float


def communication_cost(
    backbone_params: int, num_classes: int, dim: int, *, head_hidden_params: int = 0
) -> CommunicationCost:
    """Table 8's accounting of pFedFDA's upload against a linear head.

    Args:
        backbone_params: parameters of the feature extractor.
        num_classes: C. dim: feature width d entering the head.
        head_hidden_params: parameters of hidden head layers counted with the linear head
            (Table 8's MobileNetV3 row counts its 576 -> 1024 layer, 590,848, there).
    """
    for name, value in (("backbone_params", backbone_params), ("head_hidden_params", head_hidden_params)):
        _check_int(name, value, low=0)
    _check_int("num_classes", num_classes, low=1)
    _check_int("dim", dim, low=1)
    linear = head_hidden_params + num_classes * (dim + 1)
    gaussian = num_classes * dim + (dim * dim + dim) // 2
    return CommunicationCost(backbone_params, linear, gaussian, (gaussian - linear) / (backbone_params + linear))


__all__ = [
    "BetaMode",
    "BetaResult",
    "BetaSearch",
    "BetaSolver",
    "BetaStatus",
    "CVFold",
    "CVInfeasible",
    "ClassMoments",
    "CommunicationCost",
    "CovRegularization",
    "FLAT_KEYS",
    "GlobalMeanInit",
    "LDASolve",
    "PFedFDAConfig",
    "Personalization",
    "aggregate_statistics",
    "bernoulli_participation",
    "build_cv_folds",
    "check_client_statistics",
    "class_moments",
    "client_accuracy_summary",
    "communication_cost",
    "cov_to_triu",
    "cv_objective",
    "estimate_statistics",
    "gaussian_estimates",
    "global_statistics_summary",
    "golden_section_minimize",
    "init_global_statistics",
    "interpolate_statistics",
    "interpolated_mean_error",
    "join_wire",
    "label_counts",
    "label_priors",
    "lda_head",
    "lda_logits",
    "merge_class_moments",
    "nearest_pd_same_variance",
    "optimal_interpolation_beta",
    "personalize",
    "priors_from_counts",
    "regularize_covariance",
    "solve_beta",
    "split_wire",
    "stratified_kfold",
    "triu_to_cov",
]
