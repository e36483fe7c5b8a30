"""Theory and accounting: the bias and variance of the interpolated mean (Theorem 1, App. E) and
the parameters sent per client per round (Table 8).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flwr_pfl.core.pfedfda.checks import _check_int, _check_real


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
