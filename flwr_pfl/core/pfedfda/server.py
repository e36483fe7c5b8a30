"""The server step (Alg. 1 lines 1-2 and 15): initial global statistics, client sampling, the
n_i-weighted average of the clients' statistics, and checks and summaries of what arrives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from flwr_pfl.core.aggregation import weighted_average
from flwr_pfl.core.metrics import summarize
from flwr_pfl.core.pfedfda.checks import _check_counts, _check_int, _check_real
from flwr_pfl.core.pfedfda.options import GlobalMeanInit


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


def nearest_psd(cov: np.ndarray) -> np.ndarray:
    """The positive semi-definite matrix nearest to ``cov``'s symmetric part in the Frobenius norm
    (Higham 1988): V max(Lambda, 0) V^T of its eigendecomposition; the symmetric part itself when
    no eigenvalue is negative.

    For a released Sigma_g that noise made indefinite (client-level DP adds Gaussian noise to
    every entry): a covariance must be PSD for the clients' interpolation and LDA head, and a
    function of the released matrix alone is post-processing, which keeps the DP guarantee.
    float64 inside; returns ``cov``'s dtype.

    Raises:
        ValueError: not square, or not finite.
    """
    sigma = np.asarray(cov)
    if sigma.ndim != 2 or sigma.shape[0] != sigma.shape[1]:
        raise ValueError(f"cov must be square, got shape {sigma.shape}")
    if not np.isfinite(sigma).all():
        raise ValueError("cov has NaN or Inf entries")
    sym = 0.5 * (sigma.astype(np.float64) + sigma.astype(np.float64).T)
    values, vectors = np.linalg.eigh(sym)
    if values.size == 0 or values[0] >= 0:
        return sym.astype(sigma.dtype)
    return ((vectors * np.maximum(values, 0.0)) @ vectors.T).astype(sigma.dtype)


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


#: a :func:`class_separation` below this means the backbone's features have collapsed: at the end
#: of the runs whose accuracy froze at a constant it was 0.003-0.018, of the runs that trained
#: 0.45-4.8 (docs/reproduce/README.md, the pFedFDA learning-rate sweep)
COLLAPSED_SEPARATION = 0.05


def class_separation(means: np.ndarray, cov: np.ndarray) -> float:
    """How far apart the global class means are, at the features' own scale.

    The mean distance of the class means mu_c from their centroid, divided by the features'
    root-mean-square standard deviation sqrt(tr(Sigma) / d); NaN for fewer than 2 classes.
    Scale-free: multiplying the features by a (means by a, Sigma by a^2) leaves it unchanged.

    Why it is watched: near 0 the features no longer tell the classes apart, and the state is
    absorbing. The LDA head built from the means, W = Sigma^-1 mu (Eq. 3), then has (nearly)
    equal rows w, so the gradient it passes back to the backbone, W^T (p - y) = w sum_c (p_c - y_c)
    = 0, vanishes, and local training cannot separate the features again; the accuracy freezes at
    what the label prior alone predicts.
    """
    mu, sigma = np.asarray(means, dtype=np.float64), np.asarray(cov, dtype=np.float64)
    if mu.ndim != 2 or mu.shape[0] < 2:
        return math.nan
    spread = float(np.linalg.norm(mu - mu.mean(axis=0), axis=1).mean())
    scale = math.sqrt(max(float(np.trace(sigma)), 0.0) / mu.shape[1])
    if scale == 0.0:  # no variance at all: separated only if the means differ
        return math.inf if spread > 0 else 0.0
    return spread / scale


def global_statistics_summary(means: np.ndarray, cov: np.ndarray) -> dict[str, float]:
    """Per-round log scalars (spec §10): ||mu_g||_F, tr(Sigma_g) and the condition number of
    Sigma_g, plus the class means' separation (:func:`class_separation`), which shows a collapse
    of the backbone's features."""
    mu, sigma = np.asarray(means, dtype=np.float64), np.asarray(cov, dtype=np.float64)
    evals = np.linalg.eigvalsh(0.5 * (sigma + sigma.T))
    cond = float(evals[-1] / evals[0]) if evals[0] > 0 else math.inf
    return {"mu_g_norm": float(np.linalg.norm(mu)), "sigma_g_trace": float(np.trace(sigma)), "sigma_g_cond": cond,
            "mu_g_separation": class_separation(mu, sigma)}


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
