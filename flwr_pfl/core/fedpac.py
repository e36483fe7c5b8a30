"""FedPAC's mathematics (Xu, Tong and Huang, *Personalized Federated Learning with Feature
Alignment and Classifier Collaboration*, ICLR 2023), as plain torch / NumPy functions.

* Feature alignment (Sec. 4.2, Eq. 7): the body is trained with cross-entropy plus ``lam`` times
  the squared distance of each sample's feature to its class's global prototype.
* Global prototypes (Sec. 4.2): per class, the sample-weighted mean of the clients' local
  prototypes (per-class mean features).
* Classifier collaboration (Sec. 4.3, Eq. 10-12): client i's new head is sum_j alpha_ij head_j
  with alpha_i the minimiser of ``alpha^T P_i alpha`` over the probability simplex, where
  ``P_i = diag(V) + G_i``, ``V_j`` is client j's feature variance term and
  ``G_i[j, l] = <h_i - h_j, h_i - h_l>`` the bias term, ``h_j[k] = pi_jk mu_jk`` the label-prior
  weighted class means.

Where the paper leaves a detail open the authors' code (github.com/JianXu95/FedPAC,
``tools.py`` and ``methods/fedpac.py``) decides, and each function says so. The authors solve
the QP with cvxpy; :func:`solve_simplex_qp` solves it exactly here without it (projected
gradient, then an active-set method that ends on the KKT conditions).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from flwr_pfl.core.fedrod import class_counts

#: wire protocol (see :mod:`flwr_pfl.strategies.fedpac`): the instruction config key saying whether
#: the head arrays are the client's combined head (True) or a placeholder it ignores (False)
HEAD_KEY = "fedpac-head"
#: the fit-reply metric: how many of the model arrays are the head's (the server splits by it)
HEAD_ARRAYS = "head_arrays"
#: combination weights below this are set to 0 and the rest renormalised (authors' ``eps``)
PRUNE_BELOW = 1e-3
#: eigenvalues kept when an indefinite QP matrix is repaired (authors' numerical fix)
EIGEN_FLOOR = 0.01


# ---------------------------------------------------------------------------- prototypes
def class_means(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local prototypes: per-class mean feature ``mu_k`` (C, d; zero rows for absent classes) and
    the class counts ``n_k`` (C,, float64) of ``features`` (N, d) with ``labels`` (N,)."""
    counts = class_counts(labels, num_classes).to(features.device)
    sums = torch.zeros(num_classes, features.shape[1], dtype=torch.float64, device=features.device)
    sums.index_add_(0, labels.reshape(-1).long(), features.double())
    means = sums / counts.clamp(min=1.0)[:, None]
    return means, counts


def feature_variance(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> float:
    """The variance term ``V_i`` of Sec. 4.3 as the authors' code computes it
    (``statistics_extraction``): ``(sum_k pi_k E[||z||^2 | k] - pi_k^2 ||mu_k||^2) / n_i``, with
    ``pi_k = n_k / n_i`` the local label prior. It includes the ``1 / n_i`` of the estimator's
    variance, so the QP's diagonal is ``V`` itself."""
    n = features.shape[0]
    means, counts = class_means(features, labels, num_classes)
    priors = counts / n
    sq = torch.zeros(num_classes, dtype=torch.float64, device=features.device)
    sq.index_add_(0, labels.reshape(-1).long(), features.double().pow(2).sum(1))
    second = sq / counts.clamp(min=1.0)  # E[||z||^2 | k]
    return float(((priors * second) - priors.pow(2) * means.pow(2).sum(1)).sum() / n)


def prior_weighted_means(means: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``h[k] = pi_k mu_k`` (C, d): the class means weighted by the label prior
    ``pi_k = n_k / sum n`` (the authors' ``h_ref``)."""
    counts = np.asarray(counts, dtype=np.float64)
    return np.asarray(means, dtype=np.float64) * (counts / counts.sum())[:, None]


def aggregate_prototypes(means: Sequence[np.ndarray], counts: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Global prototypes (Sec. 4.2): per class k, ``sum_i n_ik mu_ik / sum_i n_ik`` over the clients
    that hold class k (rows of classes nobody holds are 0), and the total counts ``sum_i n_ik``."""
    weights = np.stack([np.asarray(c, dtype=np.float64) for c in counts])  # (m, C)
    stacked = np.stack([np.asarray(m, dtype=np.float64) for m in means])  # (m, C, d)
    total = weights.sum(0)
    summed = np.einsum("mc,mcd->cd", weights, stacked)
    return summed / np.maximum(total, 1.0)[:, None], total


# ---------------------------------------------------------------------------- alignment
def alignment_targets(
    labels: torch.Tensor, global_protos: torch.Tensor, global_counts: torch.Tensor, local_protos: torch.Tensor
) -> torch.Tensor:
    """Each sample's alignment target ``c_{y}`` (N, d): its class's global prototype, or, for a
    class without one (no participating client held it), the client's own prototype of that
    class from before local training (the authors' ``local_protos1`` fallback)."""
    has_global = global_counts[labels] > 0
    return torch.where(has_global[:, None], global_protos[labels], local_protos[labels])


def alignment_loss(features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample feature-alignment loss (Eq. 7): ``mean_d (z_d - c_d)^2`` (N,).

    The authors' code uses ``nn.MSELoss`` (mean over batch *and* feature dimensions); Eq. 7
    writes the squared norm, which is ``d`` times this. The batch mean of this is the authors'
    loss, so ``lam`` keeps the meaning of their ``--lam`` (the value the papers tuned)."""
    return (features - targets.detach()).pow(2).mean(1)


# ---------------------------------------------------------------------------- classifier QP
def qp_matrix(i: int, variances: Sequence[float], h: Sequence[np.ndarray]) -> np.ndarray:
    """``P_i = diag(V) + G_i`` (m, m) for client ``i`` among ``m`` clients (Sec. 4.3, Eq. 10-12):
    ``G_i[j, l] = sum_k <h_i[k] - h_j[k], h_i[k] - h_l[k]>``, the bias term, whose quadratic
    form is ``||sum_j alpha_j (h_i - h_j)||^2`` on the simplex."""
    flat = np.stack([np.asarray(x, dtype=np.float64).reshape(-1) for x in h])
    diff = flat[i] - flat  # row j: h_i - h_j
    return np.diag(np.asarray(variances, dtype=np.float64)) + diff @ diff.T


def repair_psd(p: np.ndarray, floor: float = EIGEN_FLOOR) -> np.ndarray:
    """The authors' numerical fix: a matrix with a negative eigenvalue (rounding; ``P`` is PSD in
    exact arithmetic) is rebuilt from its eigenpairs with eigenvalue >= ``floor``; a PSD one
    is returned symmetrised and otherwise unchanged."""
    p = (p + p.T) / 2
    values, vectors = np.linalg.eigh(p)
    if values.min() >= 0:
        return p
    keep = values >= floor
    return (vectors[:, keep] * values[keep]) @ vectors[:, keep].T


def project_simplex(v: np.ndarray) -> np.ndarray:
    """The Euclidean projection of ``v`` onto ``{a >= 0, sum a = 1}`` (sort-based)."""
    u = np.sort(v)[::-1]
    cumulative = np.cumsum(u) - 1.0
    ranks = np.arange(1, len(v) + 1)
    rho = np.nonzero(u - cumulative / ranks > 0)[0][-1]
    return np.maximum(v - cumulative[rho] / (rho + 1), 0.0)


def _equality_minimiser(p: np.ndarray, free: np.ndarray) -> np.ndarray:
    """The minimiser of ``a^T P a`` with ``sum a = 1`` and ``a_j = 0`` off ``free``: the KKT system
    ``2 P_FF a_F = lambda 1, 1^T a_F = 1`` (least squares: consistent for a PSD ``P``, whose
    quadratic form attains its minimum on an affine set; the minimal-norm solution if several)."""
    k = len(free)
    system = np.zeros((k + 1, k + 1))
    system[:k, :k] = 2 * p[np.ix_(free, free)]
    system[:k, k] = -1.0
    system[k, :k] = 1.0
    rhs = np.zeros(k + 1)
    rhs[k] = 1.0
    out = np.zeros(p.shape[0])
    out[free] = np.linalg.lstsq(system, rhs, rcond=None)[0][:k]
    return out


def _active_set(p: np.ndarray, x: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """The primal active-set method for the simplex QP from the feasible ``x`` (Nocedal and
    Wright, Alg. 16.3): the working set holds the bounds ``a_j = 0`` taken as active; each
    step minimises on the others, moves towards that minimiser until a bound blocks, or, at
    the minimiser, releases the bound with the most negative multiplier ``(2 P a)_j - lambda``.
    Exact (up to rounding) once the working set is the optimal one."""
    m = len(x)
    working = x <= tol
    x = np.where(working, 0.0, x)
    x /= x.sum()
    for _ in range(20 * m + 50):
        free = np.nonzero(~working)[0]
        target = _equality_minimiser(p, free)
        step = target - x
        if np.abs(step).max() <= 1e-13:
            g = 2 * p @ x
            lam = float(g[free].mean())
            multipliers = np.where(working, g - lam, np.inf)
            j = int(np.argmin(multipliers))
            if multipliers[j] >= -1e-12 * max(1.0, abs(lam)):
                return x
            working[j] = False
            continue
        shrinking = (~working) & (step < 0)
        ratios = np.where(shrinking, x / np.where(shrinking, -step, 1.0), np.inf)
        j = int(np.argmin(ratios))
        t = min(1.0, float(ratios[j]))
        x = np.maximum(x + t * step, 0.0)
        if t < 1.0:
            working[j] = True
            x[j] = 0.0
        x /= x.sum()
    return x


def solve_simplex_qp(p: np.ndarray, *, iterations: int = 500) -> np.ndarray:
    """``argmin_a a^T P a`` over the probability simplex, for a PSD ``P`` (m, m).

    A warm start by accelerated projected gradient (FISTA, step ``1 / (2 lambda_max)``), then
    the primal active-set method (:func:`_active_set`), which ends at a point meeting the KKT
    conditions. Replaces the authors' cvxpy call (``cvx.Minimize(cvx.quad_form(a, P))``,
    ``sum a = 1``, ``a >= 0``). With a singular ``P`` the minimiser may not be unique; one of
    them is returned.
    """
    p = np.asarray(p, dtype=np.float64)
    p = (p + p.T) / 2
    m = p.shape[0]
    if m == 1:
        return np.ones(1)
    lipschitz = 2 * max(float(np.linalg.eigvalsh(p).max()), 1e-300)
    alpha = np.full(m, 1.0 / m)
    y, t = alpha.copy(), 1.0
    for _ in range(iterations):
        nxt = project_simplex(y - (2 * p @ y) / lipschitz)
        t_next = (1 + np.sqrt(1 + 4 * t * t)) / 2
        y = nxt + ((t - 1) / t_next) * (nxt - alpha)
        alpha, t = nxt, t_next
    return _active_set(p, alpha)


def combination_weights(p: np.ndarray, prune_below: float = PRUNE_BELOW) -> np.ndarray:
    """Client i's head weights ``alpha_i`` (Eq. 10-12): the simplex QP on the repaired ``P_i``, then,
    as the authors' code does, weights below ``prune_below`` set to 0 and the rest renormalised
    to sum 1 (``agg_classifier_weighted_p`` divides by their sum)."""
    alpha = solve_simplex_qp(repair_psd(np.asarray(p, dtype=np.float64)))
    pruned = np.where(alpha > prune_below, alpha, 0.0)
    return pruned / pruned.sum() if pruned.sum() > 0 else alpha


def combine_heads(weights: np.ndarray, heads: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """``sum_j weights[j] heads[j]``, array by array, in each array's dtype."""
    out = []
    for arrays in zip(*heads):
        mixed = sum(float(w) * np.asarray(a, dtype=np.float64) for w, a in zip(weights, arrays))
        out.append(np.asarray(mixed, dtype=arrays[0].dtype))
    return out
