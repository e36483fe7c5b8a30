"""Algorithm 2 (App. A.2): the analysed linear variant, y = x^T B w_z with a shared
representation B (d, k).

Clients: :func:`spectral_statistic` (initialisation), :func:`linear_head_statistics` (the head
step's sufficient statistics), :func:`linear_representation_gradient`. Server:
:func:`spectral_init`, :func:`solve_linear_heads` (per-domain least squares, as SA),
:func:`representation_step`, and :func:`principal_angle_distance` to the true representation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from flwr_pfl.core.feddar.aggregation import _solve_domains
from flwr_pfl.core.feddar.checks import _check_domains, _count_table, _one_hot, _server_array
from flwr_pfl.core.feddar.head_statistics import _domain_gram
from flwr_pfl.core.feddar.options import SAOptions, SASolver


@dataclass(frozen=True)
class LinearHeadStatistics:
    """Sufficient statistics of Algorithm 2's head step for one client (or a stack).

    Attributes:
        gram: A_{i,m} = B^T X_m^T X_m B, shape (..., M, k, k).
        moment: a_{i,m} = B^T X_m^T y_m, shape (..., M, k).
        counts: L_{i,m}, shape (..., M), int64.
    """

    gram: Tensor
    moment: Tensor
    counts: Tensor


def _check_linear_data(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Return x (..., L, d) and y (..., L) as float64 on x's device after checking shapes."""
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if x.dim() < 2 or tuple(y.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"x must be (..., L, d) and y (..., L); got {tuple(x.shape)} and {tuple(y.shape)}")
    return x.to(torch.float64), y.to(device=x.device, dtype=torch.float64)


def _check_linear_inputs(x: Tensor, y: Tensor, domains: Tensor, rep, num_domains: int):
    """Checked (x, y, domains, B) for Algorithm 2's client functions, all on x's device."""
    x, y = _check_linear_data(x, y)
    domains = _check_domains(domains, num_domains)
    if tuple(domains.shape) != tuple(y.shape):
        raise ValueError(f"domains must have shape {tuple(y.shape)}, got {tuple(domains.shape)}")
    rep = torch.as_tensor(rep, dtype=torch.float64, device=x.device)
    if rep.dim() != 2 or rep.shape[0] != x.shape[-1]:
        raise ValueError(f"rep B must have shape (d, k) with d = {x.shape[-1]}, got {tuple(rep.shape)}")
    return x, y, domains.to(x.device), rep


def spectral_statistic(x: Tensor, y: Tensor) -> Tensor:
    """Client initialisation statistic of Algorithm 2: Z_i = sum_j y_j^2 x_j x_j^T.

    Args:
        x: (..., L0, d); y: (..., L0).

    Returns:
        float64 tensor (..., d, d).
    """
    x, y = _check_linear_data(x, y)
    return torch.einsum("...l,...la,...lb->...ab", y**2, x, x)


def spectral_init(statistics, num_samples: int, rep_dim: int) -> np.ndarray:
    """Server initialisation of Algorithm 2: B^0 = top-k eigenvectors of (1/(n L0)) sum_i Z_i.

    Args:
        statistics: Z_i stacked, shape (n, d, d).
        num_samples: n L0, the total number of initialisation samples.
        rep_dim: k.

    Returns:
        float64 array (d, k) with orthonormal columns (rank-k SVD of the symmetric PSD matrix).
    """
    z = _server_array("statistics", statistics, ndim=3)
    if num_samples <= 0 or not 1 <= rep_dim <= z.shape[-1]:
        raise ValueError(f"need num_samples > 0 and 1 <= rep_dim <= d = {z.shape[-1]}")
    mean = z.sum(0) / num_samples
    _, vecs = np.linalg.eigh(0.5 * (mean + mean.T))
    return vecs[:, ::-1][:, :rep_dim].copy()


def linear_head_statistics(
    x: Tensor, y: Tensor, domains: Tensor, rep: Tensor, num_domains: int
) -> LinearHeadStatistics:
    """Client head statistics of Algorithm 2 for f_{i,m} = 1/2 sum_j (y_j - w_m^T B^T x_j)^2:
    grad_w f = A_{i,m} w - a_{i,m} with A_{i,m} = B^T X_m^T X_m B, a_{i,m} = B^T X_m^T y_m.

    A_{i,m} is the sum (un-normalised) Hessian of the head, so solving sum_i A w = sum_i a is SA.

    Args:
        x: fresh samples (..., L, d); y: (..., L); domains: (..., L); rep: B (d, k);
        num_domains: M.

    Returns:
        :class:`LinearHeadStatistics` with gram (..., M, k, k), moment (..., M, k), counts (..., M).
    """
    x, y, domains, rep = _check_linear_inputs(x, y, domains, rep, num_domains)
    feats = x @ rep
    gram, counts = _domain_gram(feats, domains, num_domains)
    moment = torch.einsum("...lm,...l,...la->...ma", _one_hot(domains, num_domains), y, feats)
    return LinearHeadStatistics(gram, moment, counts.long())


def solve_linear_heads(gram, moment, counts, prev_heads, options: SAOptions | None = None) -> np.ndarray:
    """Server head step of Algorithm 2: (sum_i A_{i,m}) w_m = sum_i a_{i,m} for every domain.

    Any solution is allowed by the algorithm; the default solver :attr:`SASolver.PINV` returns
    the exact solution when the sum is invertible and the one nearest to the previous head
    otherwise. Domains without samples keep their previous head.

    Args:
        gram: A_{i,m}, (n, M, k, k); moment: a_{i,m}, (n, M, k); counts: L_{i,m}, (n, M);
        prev_heads: (M, k); options: solver options (weighting is ignored).

    Returns:
        W^{t+1}, float64 array (M, k).
    """
    options = options or SAOptions(solver=SASolver.PINV)
    a = _server_array("gram", gram, ndim=4)
    n, m, k, _ = a.shape
    b = _server_array("moment", moment, shape=(n, m, k))
    table = _count_table(counts)
    if table.shape != (n, m):
        raise ValueError(f"counts must have shape {(n, m)}, got {table.shape}")
    prev = _server_array("prev_heads", prev_heads, shape=(m, k))
    return _solve_domains(a.sum(0), b.sum(0), table.sum(0) > 0, prev, options).heads


def linear_representation_gradient(
    x: Tensor, y: Tensor, domains: Tensor, rep: Tensor, heads: Tensor
) -> tuple[Tensor, Tensor]:
    """Client representation gradients of Algorithm 2, per domain:
    grad_B f_{i,m}(w_m, B) = X_m^T X_m B w_m w_m^T - X_m^T y_m w_m^T = X_m^T (X_m B w_m - y_m) w_m^T.

    Args:
        x: fresh samples (..., L, d); y: (..., L); domains: (..., L); rep: B^t (d, k);
        heads: W^{t+1} (M, k).

    Returns:
        (gradients (..., M, d, k) float64, counts L'_{i,m} (..., M) int64).
    """
    heads = torch.as_tensor(heads, dtype=torch.float64)
    if heads.dim() != 2 or heads.shape[0] < 1:
        raise ValueError(f"heads must be (M, k), got {tuple(heads.shape)}")
    num_domains = heads.shape[0]
    x, y, domains, rep = _check_linear_inputs(x, y, domains, rep, num_domains)
    if heads.shape[1] != rep.shape[1]:
        raise ValueError(f"heads must be (M, k) with k = {rep.shape[1]}, got {tuple(heads.shape)}")
    heads = heads.to(x.device)
    indicator = _one_hot(domains, num_domains)
    resid = (x @ rep @ heads.T) - y[..., None]  # (..., L, M): residual under every head
    grads = torch.einsum("...lm,...lm,...ld,mk->...mdk", indicator, resid, x, heads)
    return grads, indicator.sum(-2).long()


def representation_step(rep, gradients, counts, lr: float) -> np.ndarray:
    """Server representation step of Algorithm 2 with the domain-balanced gradient, then QR:

        B~ = B - lr (1/M) sum_m (1 / sum_i L'_{i,m}) sum_i grad_B f_{i,m};   B^{t+1} = Q(QR(B~)).

    (The paper's "1/m" is a typo for 1/M.) Domains without samples contribute nothing.

    Args:
        rep: B^t (d, k); gradients: (n, M, d, k); counts: L'_{i,m} (n, M); lr: eta > 0.

    Returns:
        float64 array (d, k) with orthonormal columns.
    """
    b = _server_array("rep", rep, ndim=2)
    g = _server_array("gradients", gradients, ndim=4)
    table = _count_table(counts)
    if g.shape[2:] != b.shape or table.shape != g.shape[:2]:
        raise ValueError(f"gradients {g.shape} and counts {table.shape} must be (n, M, *{b.shape}) and (n, M)")
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr}")
    totals = table.sum(0)
    scale = np.where(totals > 0, 1.0 / np.maximum(totals, 1), 0.0) / totals.shape[0]
    q, _ = np.linalg.qr(b - lr * np.einsum("m,imdk->dk", scale, g))
    return q


def principal_angle_distance(rep, rep_star) -> float:
    """Principal-angle distance dist(B, B*) = ||(I - Q Q^T) Q*||_2, with Q, Q* orthonormal bases
    of the column spaces of B and B* (Appendix A); 0 for equal subspaces, 1 for orthogonal ones.

    Args:
        rep: B (d, k); rep_star: B* (d, k).

    Returns:
        float.
    """
    b = _server_array("rep", rep, ndim=2)
    s = _server_array("rep_star", rep_star, shape=b.shape)
    q, _ = np.linalg.qr(b)
    q_star, _ = np.linalg.qr(s)
    return float(np.linalg.norm(q_star - q @ (q.T @ q_star), ord=2))
