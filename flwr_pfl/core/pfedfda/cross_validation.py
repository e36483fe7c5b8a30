"""The cross-validated objective of Eq. 9 that selects beta.

:func:`stratified_kfold` splits the client's feature bank, :func:`build_cv_folds` estimates the
statistics of every training fold once, and :func:`cv_objective` is the held-out cross-entropy,
summed over the folds, of the LDA head built from the interpolated statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from flwr_pfl.core.pfedfda.checks import ArrayLike, _check_int, _float, _labels
from flwr_pfl.core.pfedfda.interpolation import _mix
from flwr_pfl.core.pfedfda.lda import _lda_head
from flwr_pfl.core.pfedfda.options import CovRegularization, LDASolve
from flwr_pfl.core.pfedfda.statistics import estimate_statistics


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
