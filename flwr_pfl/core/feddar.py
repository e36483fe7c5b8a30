"""FedDAR: Federated Domain-Aware Representation Learning (Zhong et al., ICLR 2023), the mathematics.

The model is a shared encoder phi plus one linear head per predefined domain; a sample (x, y, z)
is predicted by h_z(phi(x)). One FedDAR round (Algorithm 1) has two client round-trips:

* **head phase**: clients train the heads on frozen features, the server aggregates each domain's
  head by weighted averaging (WA) or second-order aggregation (SA, Eq. 8);
* **representation phase**: clients train the encoder with the heads frozen, on the domain
  re-weighted loss (Eq. 6, u_m = L / (L_m M)); the server averages encoders with weights L_i / L.

This module holds the pieces of that round as plain functions, split by where they run.

Client side (torch tensors in, float64 torch tensors out):
    :func:`domain_counts`, :func:`head_outputs`, :func:`per_sample_loss`, :func:`head_phase_loss`,
    :func:`reweighted_loss`, :func:`local_least_squares_heads`, :func:`hessian_point`,
    :func:`head_statistics`; for Algorithm 2 :func:`spectral_statistic`,
    :func:`linear_head_statistics`, :func:`linear_representation_gradient`.
Server side (NumPy arrays in and out, float64):
    :func:`domain_weights`, :func:`aggregate_heads_wa`, :func:`aggregate_heads_sa`,
    :func:`aggregate_heads`, :func:`aggregate_encoder`; for Algorithm 2 :func:`spectral_init`,
    :func:`solve_linear_heads`, :func:`representation_step`, :func:`principal_angle_distance`.

Client-side functions accept any number of leading batch dimensions (``...``) before the sample
dimension, so one call can also process a stack of clients that hold equally many samples.

**Head parameter layout.** A head is a linear map from k features to N outputs, weight W (N, k) and
optionally a bias b (N,). It travels as one flat vector of P = N (k + bias) numbers: the rows of
the augmented matrix [W | b] one after the other ("class-major" vec, :class:`HeadLayout`). Hessians
are (P, P) in the same order; for logits W phi the per-sample Hessian is then S kron (phi phi^T)
with S the (N, N) curvature of the loss in the logits.

**Hessian normalisation.** :func:`head_statistics` returns Hessians of the *mean* per-domain loss
R_{i,m} (the 1/L_{i,m}-normalised form of the paper's logistic example); SA then weights client i
by alpha_{i,m} = L_{i,m} (:attr:`SAWeighting.DOMAIN_COUNT`), which is the same as summing
un-normalised Hessians, and makes SA on squared loss equal pooled least squares.

There is no official FedDAR code; defaults marked "inferred" follow the project's specification.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch
from torch import Tensor

from flwr_pfl.core.aggregation import weighted_average

__all__ = [
    "HeadAggregation",
    "HeadLoss",
    "HessianAt",
    "SAWeighting",
    "SASolver",
    "SAOptions",
    "HeadLayout",
    "HeadStatistics",
    "HeadAggregationResult",
    "LinearHeadStatistics",
    "domain_counts",
    "domain_weights",
    "head_outputs",
    "per_sample_loss",
    "head_phase_loss",
    "reweighted_loss",
    "local_least_squares_heads",
    "hessian_point",
    "head_statistics",
    "aggregate_heads_wa",
    "aggregate_heads_sa",
    "aggregate_heads",
    "aggregate_encoder",
    "spectral_statistic",
    "spectral_init",
    "linear_head_statistics",
    "solve_linear_heads",
    "linear_representation_gradient",
    "representation_step",
    "principal_angle_distance",
]

# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


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

    ``DAMPED`` (default, a safeguard not in the paper): w = (A + lam I)^{-1} (b + lam w_prev) with
    lam = damping * trace(A) / P, a proximal pull toward the previous global head; finite for
    singular A (softmax heads, small domains) and equal to Eq. 8 when damping = 0.
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
        damping: relative damping for ``DAMPED`` (lam = damping * trace(A) / P), default 1e-6;
            0 reproduces the paper's undamped Eq. 8.
        fallback_to_wa: when the condition number of A exceeds ``cond_threshold``, use WA for
            that domain instead of solving (default False).
        cond_threshold: condition-number limit for ``fallback_to_wa`` and ``EXACT``, and
            1 / cond_threshold is the relative cutoff of ``PINV`` (default 1e12).
    """

    weighting: SAWeighting = SAWeighting.DOMAIN_COUNT
    solver: SASolver = SASolver.DAMPED
    damping: float = 1e-6
    fallback_to_wa: bool = False
    cond_threshold: float = 1e12

    def __post_init__(self) -> None:
        object.__setattr__(self, "weighting", SAWeighting(self.weighting))
        object.__setattr__(self, "solver", SASolver(self.solver))
        if not (np.isfinite(self.damping) and self.damping >= 0):
            raise ValueError(f"SAOptions.damping must be a finite number >= 0, got {self.damping}")
        if not self.cond_threshold > 1:
            raise ValueError(f"SAOptions.cond_threshold must be > 1, got {self.cond_threshold}")


@dataclass(frozen=True)
class HeadLayout:
    """Shape of one linear domain head and its flat wire layout.

    Attributes:
        num_outputs: N, 1 for regression / binary logistic, number of classes for softmax.
        feature_dim: k, the encoder's output dimension.
        bias: whether the head has a bias (handled by appending a constant 1 to the features;
            the paper does not say, so False by default, which gives the (kN) x (kN) Hessian that
            App. C counts).
    """

    num_outputs: int
    feature_dim: int
    bias: bool = False

    def __post_init__(self) -> None:
        for name in ("num_outputs", "feature_dim"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"HeadLayout.{name} must be a positive integer, got {value!r}")

    @property
    def in_dim(self) -> int:
        """Columns of the augmented weight [W | b]: k + 1 with a bias, else k."""
        return self.feature_dim + int(self.bias)

    @property
    def num_params(self) -> int:
        """P = N * in_dim, the length of a flat head and the side of its Hessian."""
        return self.num_outputs * self.in_dim

    def pack(self, weight: Tensor | np.ndarray, bias: Tensor | np.ndarray | None = None):
        """Flatten weight (..., N, k) and bias (..., N) into heads (..., P), class-major."""
        if tuple(weight.shape[-2:]) != (self.num_outputs, self.feature_dim):
            raise ValueError(
                f"head weight must end in shape ({self.num_outputs}, {self.feature_dim}), "
                f"got {tuple(weight.shape)}"
            )
        if self.bias:
            if bias is None or tuple(bias.shape) != tuple(weight.shape[:-1]):
                raise ValueError(
                    f"this layout has a bias: expected bias of shape {tuple(weight.shape[:-1])}, "
                    f"got {None if bias is None else tuple(bias.shape)}"
                )
            cat = torch.cat if isinstance(weight, Tensor) else np.concatenate
            weight = cat([weight, bias[..., None]], -1)
        elif bias is not None:
            raise ValueError("this layout has no bias, but a bias was given")
        return weight.reshape(*weight.shape[:-2], self.num_params)

    def unpack(self, heads: Tensor | np.ndarray):
        """Split heads (..., P) into (weight (..., N, k), bias (..., N) or None)."""
        if heads.shape[-1] != self.num_params:
            raise ValueError(f"heads must end in {self.num_params} parameters, got {tuple(heads.shape)}")
        full = heads.reshape(*heads.shape[:-1], self.num_outputs, self.in_dim)
        if self.bias:
            return full[..., : self.feature_dim], full[..., self.feature_dim]
        return full, None


@dataclass(frozen=True)
class HeadStatistics:
    """What a client computes about its heads in the head phase (all float64, zeros where a
    domain has no local samples).

    Attributes:
        counts: L_{i,m}, shape (..., M), int64.
        losses: mean loss R_{i,m} at the evaluation point, shape (..., M).
        gradients: gradient of R_{i,m}, shape (..., M, P).
        hessians: Hessian of R_{i,m} (mean-normalised), shape (..., M, P, P).
    """

    counts: Tensor
    losses: Tensor
    gradients: Tensor
    hessians: Tensor


@dataclass(frozen=True)
class HeadAggregationResult:
    """Aggregated heads and per-domain diagnostics (shape (M,) each, float64 unless stated).

    Attributes:
        heads: new global heads (M, P).
        updated: bool, False where no participating client had samples of the domain (the
            previous head was kept).
        condition_numbers: cond(A) of the summed Hessian (inf when singular; NaN for WA or
            domains not updated).
        min_eigenvalues: smallest eigenvalue of A (NaN for WA or domains not updated).
        damping: absolute lam used by the damped solve (0 otherwise).
        fell_back_to_wa: bool, True where WA replaced SA because cond(A) > cond_threshold.
    """

    heads: np.ndarray
    updated: np.ndarray
    condition_numbers: np.ndarray
    min_eigenvalues: np.ndarray
    damping: np.ndarray
    fell_back_to_wa: np.ndarray


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


# --------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------


def _check_domains(domains: Tensor, num_domains: int) -> Tensor:
    """Return domains as int64 after checking type and range [0, M)."""
    if not isinstance(num_domains, (int, np.integer)) or num_domains < 1:
        raise ValueError(f"num_domains must be a positive integer, got {num_domains!r}")
    domains = torch.as_tensor(domains)
    if domains.dtype == torch.bool or domains.is_floating_point() or domains.is_complex():
        raise ValueError(f"domain labels must be integers, got dtype {domains.dtype}")
    if domains.numel() and (int(domains.min()) < 0 or int(domains.max()) >= num_domains):
        raise ValueError(
            f"domain labels must lie in [0, {num_domains}), got values in "
            f"[{int(domains.min())}, {int(domains.max())}]"
        )
    return domains.long()


def _check_features(features: Tensor, domains: Tensor, layout: HeadLayout | None = None) -> tuple[Tensor, Tensor]:
    """Return (features as float64, domains on the features' device) after checking
    features (..., L, k) against domains (..., L)."""
    features = torch.as_tensor(features)
    if features.dim() < 2 or tuple(features.shape[:-1]) != tuple(domains.shape):
        raise ValueError(
            f"features must have shape (..., L, k) matching domains (..., L) = "
            f"{tuple(domains.shape)}, got {tuple(features.shape)}"
        )
    if layout is not None and features.shape[-1] != layout.feature_dim:
        raise ValueError(
            f"features have dimension {features.shape[-1]}, the head layout expects "
            f"k = {layout.feature_dim}"
        )
    return features.to(torch.float64), domains.to(features.device)


def _check_heads(heads: Tensor, layout: HeadLayout, name: str = "heads") -> tuple[Tensor, int]:
    """Return heads (..., M, P) as float64 and M, after checking the trailing dimension P."""
    heads = torch.as_tensor(heads)
    if heads.dim() < 2 or heads.shape[-1] != layout.num_params:
        raise ValueError(
            f"{name} must have shape (M, P) or (..., M, P) with P = {layout.num_params}, "
            f"got {tuple(heads.shape)}"
        )
    return heads.to(torch.float64), heads.shape[-2]


def _one_hot(domains: Tensor, num_domains: int) -> Tensor:
    """Domain indicator (..., L, M) in float64."""
    return torch.nn.functional.one_hot(domains, num_domains).to(torch.float64)


def _augment(features: Tensor, layout: HeadLayout) -> Tensor:
    """Append the constant-1 bias feature when the layout has a bias: (..., L, k) -> (..., L, in_dim)."""
    if not layout.bias:
        return features
    return torch.cat([features, features.new_ones(*features.shape[:-1], 1)], -1)


def _server_array(name: str, value, shape: tuple[int, ...] | None = None, ndim: int | None = None) -> np.ndarray:
    """Convert a wire array to float64, checking its shape and that it is finite."""
    arr = np.asarray(value, dtype=np.float64)
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {arr.shape}")
    if shape is not None and arr.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {arr.shape}")
    if not np.all(np.isfinite(arr)):
        bad = np.argwhere(~np.isfinite(arr))[0]
        raise ValueError(f"{name} contains NaN or Inf (first at index {tuple(int(b) for b in bad)})")
    return arr


def _count_table(counts, ndim: int = 2) -> np.ndarray:
    """Check a table of non-negative integer counts (n, M) (or (M,) with ndim=1)."""
    arr = _server_array("counts", counts, ndim=ndim)
    if np.any(arr < 0) or np.any(arr != np.round(arr)):
        raise ValueError("counts must be non-negative integers")
    return arr


# --------------------------------------------------------------------------------------------
# Client side: counts, predictions, losses
# --------------------------------------------------------------------------------------------


def domain_counts(domains: Tensor, num_domains: int) -> Tensor:
    """Per-domain sample counts L_{i,m} of a client (Sec. 2 notation).

    Args:
        domains: integer domain labels z in [0, M), shape (..., L).
        num_domains: M.

    Returns:
        int64 tensor (..., M). Raises ValueError for labels outside [0, M).
    """
    domains = _check_domains(domains, num_domains)
    return torch.nn.functional.one_hot(domains, num_domains).sum(-2)


def head_outputs(features: Tensor, domains: Tensor, heads: Tensor, layout: HeadLayout) -> Tensor:
    """Outputs h_z(phi(x)) of each sample's own domain head (f(x, z) of Sec. 3.1).

    Args:
        features: phi(x), shape (..., L, k).
        domains: z, shape (..., L).
        heads: flat heads, shape (M, P) shared or (..., M, P) per client (:class:`HeadLayout`).
        layout: the heads' layout.

    Returns:
        float64 tensor (..., L, N) of outputs (predictions or logits). Differentiable in
        ``features`` and ``heads``.
    """
    heads, num_domains = _check_heads(heads, layout)
    features, domains = _check_features(features, _check_domains(domains, num_domains), layout)
    per_sample = _one_hot(domains, num_domains) @ heads.to(features.device)  # (..., L, P)
    weights = per_sample.reshape(*per_sample.shape[:-1], layout.num_outputs, layout.in_dim)
    return torch.einsum("...lna,...la->...ln", weights, _augment(features, layout))


def _target_matrix(targets: Tensor, outputs: Tensor, loss: HeadLoss) -> Tensor:
    """Targets as a float64 (..., L, N) matrix (one-hot for softmax), with checks per loss."""
    loss = HeadLoss(loss)
    num_outputs = outputs.shape[-1]
    targets = torch.as_tensor(targets, device=outputs.device)
    if loss is HeadLoss.SOFTMAX:
        if num_outputs < 2:
            raise ValueError(f"softmax heads need N >= 2 outputs, got N = {num_outputs}")
        if targets.is_floating_point() or targets.dtype == torch.bool:
            raise ValueError(f"softmax targets must be integer class indices, got dtype {targets.dtype}")
        if tuple(targets.shape) != tuple(outputs.shape[:-1]):
            raise ValueError(f"targets must have shape {tuple(outputs.shape[:-1])}, got {tuple(targets.shape)}")
        if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= num_outputs):
            raise ValueError(f"softmax targets must lie in [0, {num_outputs})")
        return torch.nn.functional.one_hot(targets.long(), num_outputs).to(torch.float64)
    targets = targets.to(torch.float64)
    if loss is HeadLoss.LOGISTIC and num_outputs != 1:
        raise ValueError(f"logistic heads have N = 1 output, got N = {num_outputs}")
    if num_outputs == 1 and tuple(targets.shape) == tuple(outputs.shape[:-1]):
        targets = targets[..., None]
    if tuple(targets.shape) != tuple(outputs.shape):
        raise ValueError(f"targets must have shape {tuple(outputs.shape)}, got {tuple(targets.shape)}")
    if loss is HeadLoss.LOGISTIC and targets.numel() and (targets.min() < 0 or targets.max() > 1):
        raise ValueError("logistic targets must lie in [0, 1]")
    return targets


def _loss_terms(outputs: Tensor, targets: Tensor, loss: HeadLoss) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample loss (..., L), its gradient in the outputs (..., L, N) and its curvature in the
    outputs (..., L, N, N), for targets already in matrix form."""
    n = outputs.shape[-1]
    if loss is HeadLoss.SQUARED:
        resid = outputs - targets
        eye = torch.eye(n, dtype=outputs.dtype, device=outputs.device)
        return (resid**2).sum(-1), 2 * resid, (2 * eye).expand(*outputs.shape, n)
    if loss is HeadLoss.LOGISTIC:
        mu = torch.sigmoid(outputs)
        value = (torch.nn.functional.softplus(outputs) - targets * outputs).sum(-1)
        return value, mu - targets, (mu * (1 - mu))[..., None]
    p = torch.softmax(outputs, -1)
    value = torch.logsumexp(outputs, -1) - (targets * outputs).sum(-1)
    curvature = torch.diag_embed(p) - p[..., :, None] * p[..., None, :]
    return value, p - targets, curvature


def per_sample_loss(outputs: Tensor, targets: Tensor, loss: HeadLoss) -> Tensor:
    """Per-sample loss l(h_z(phi(x)), y) for the given head loss (see :class:`HeadLoss`).

    Args:
        outputs: (..., L, N) from :func:`head_outputs`.
        targets: (..., L) or (..., L, N) floats for squared loss; (..., L) in [0, 1] for logistic;
            (..., L) integer classes for softmax.
        loss: the head loss.

    Returns:
        float64 tensor (..., L), differentiable in ``outputs``.
    """
    loss = HeadLoss(loss)
    return _loss_terms(outputs, _target_matrix(targets, outputs, loss), loss)[0]


def _domain_means(values: Tensor, domains: Tensor, num_domains: int) -> Tensor:
    """Per-domain mean of per-sample values (..., L) -> (..., M); 0 for absent domains."""
    indicator = _one_hot(domains, num_domains)
    counts = indicator.sum(-2)
    sums = torch.einsum("...l,...lm->...m", values.to(torch.float64), indicator)
    return sums / counts.clamp(min=1)


def head_phase_loss(losses: Tensor, domains: Tensor, num_domains: int) -> Tensor:
    """Head-phase objective of a client: sum_m R_{i,m}, the sum over present domains of the mean
    loss of that domain's samples (Algorithm 1 head step, spec 9.6); no u_m re-weighting.

    The heads have disjoint parameters, so each head receives exactly the gradient of its own
    domain-mean loss. Use on a minibatch to get per-domain minibatch means.

    Args:
        losses: per-sample losses (..., L).
        domains: z (..., L).
        num_domains: M.

    Returns:
        float64 tensor (...), differentiable in ``losses``.
    """
    domains = _check_domains(domains, num_domains)
    if tuple(losses.shape) != tuple(domains.shape):
        raise ValueError(f"losses {tuple(losses.shape)} and domains {tuple(domains.shape)} must have the same shape")
    return _domain_means(losses, domains.to(losses.device), num_domains).sum(-1)


def reweighted_loss(losses: Tensor, domains: Tensor, weights: Tensor | np.ndarray) -> Tensor:
    """Domain re-weighted client risk for the representation phase (Eq. 6, spec 9.7).

    R_i = (1/|B|) sum_{j in B} u_{z_j} l_j. The normaliser is the batch size, not sum u, so the
    estimate is unbiased for R_i and the global objective is (1/M) sum_m R_m.

    Args:
        losses: per-sample losses (..., L).
        domains: z (..., L), in [0, M).
        weights: u, shape (M,) (from :func:`domain_weights`).

    Returns:
        float64 tensor (...), differentiable in ``losses``.
    """
    weights = torch.as_tensor(np.asarray(weights) if not isinstance(weights, Tensor) else weights)
    if weights.dim() != 1:
        raise ValueError(f"weights u must have shape (M,), got {tuple(weights.shape)}")
    domains = _check_domains(domains, weights.shape[0])
    if tuple(losses.shape) != tuple(domains.shape):
        raise ValueError(f"losses {tuple(losses.shape)} and domains {tuple(domains.shape)} must have the same shape")
    u = weights.to(device=losses.device, dtype=torch.float64)[domains.to(losses.device)]
    return (u * losses.to(torch.float64)).mean(-1)


# --------------------------------------------------------------------------------------------
# Client side: local heads and head statistics (head phase)
# --------------------------------------------------------------------------------------------


def _domain_gram(features: Tensor, domains: Tensor, num_domains: int) -> tuple[Tensor, Tensor]:
    """Per-domain Gram matrices sum_{j in S_m} phi_j phi_j^T (..., M, a, a) and counts (..., M)."""
    indicator = _one_hot(domains, num_domains)
    gram = torch.einsum("...lm,...la,...lb->...mab", indicator, features, features)
    return gram, indicator.sum(-2)


def local_least_squares_heads(
    features: Tensor, targets: Tensor, domains: Tensor, init_heads: Tensor, layout: HeadLayout
) -> Tensor:
    """Exact local head update for squared loss: the minimiser of R_{i,m} nearest to the start head.

    w_{i,m} = w_0 + P_m^+ (y_m - P_m w_0) per output, with P_m the client's (bias-augmented)
    domain-m features. It is the limit of local gradient descent on the head from w_0 (the
    tau_h -> infinity head phase of Algorithm 1 for a frozen encoder), well defined also when
    L_{i,m} < P (underdetermined, the case where WA fails and SA does not). Domains without local
    samples keep w_0.

    Args:
        features: phi(x), shape (..., L, k).
        targets: (..., L) or (..., L, N) real targets.
        domains: z, shape (..., L).
        init_heads: start heads w_0 (global heads), (M, P) or (..., M, P).
        layout: head layout.

    Returns:
        float64 tensor (..., M, P).
    """
    init_heads, num_domains = _check_heads(init_heads, layout, "init_heads")
    features, domains = _check_features(features, _check_domains(domains, num_domains), layout)
    init_heads = init_heads.to(features.device)
    outputs = head_outputs(features, domains, init_heads, layout)
    resid = _target_matrix(targets, outputs, HeadLoss.SQUARED) - outputs  # (..., L, N)
    indicator = _one_hot(domains, num_domains).transpose(-1, -2)[..., None]  # (..., M, L, 1)
    design = indicator * _augment(features, layout)[..., None, :, :]  # (..., M, L, a), zero rows off-domain
    delta = torch.linalg.pinv(design) @ (indicator * resid[..., None, :, :])  # (..., M, a, N)
    return init_heads + delta.transpose(-1, -2).reshape(*delta.shape[:-2], layout.num_params)


def hessian_point(hessian_at: HessianAt, local_heads: Tensor, global_heads: Tensor) -> Tensor:
    """Heads at which :func:`head_statistics` should evaluate the SA Hessian (spec 9.2).

    Returns ``local_heads`` for :attr:`HessianAt.LOCAL` (Algorithm 1, default) and
    ``global_heads`` for :attr:`HessianAt.GLOBAL` (Eq. 8 derivation); shapes (..., M, P).
    """
    return local_heads if HessianAt(hessian_at) is HessianAt.LOCAL else global_heads


def head_statistics(
    features: Tensor,
    targets: Tensor,
    domains: Tensor,
    heads: Tensor,
    layout: HeadLayout,
    loss: HeadLoss,
    *,
    max_hessian_params: int = 4096,
) -> HeadStatistics:
    """Per-domain count, mean loss, gradient and exact Hessian of a client's heads (Sec. 4.3).

    For domain m with L_{i,m} samples and features phi (bias-augmented when the layout has a
    bias), with S_j the output curvature of :class:`HeadLoss`:

        H_{i,m} = (1/L_{i,m}) sum_{j in S_{i,m}} S_j kron (phi_j phi_j^T)          (P x P)

    which is (2/L) P^T P for squared loss, (1/L) X^T diag(mu(1-mu)) X for the binary logistic
    head (the paper's example) and the Kronecker form for softmax. Computed in float64 on the
    features' device. Domains without local samples get zero count, loss, gradient and Hessian
    (they are skipped by the server).

    Args:
        features: phi(x) from the frozen encoder phi^{t-1}, shape (..., L, k).
        targets: see :func:`per_sample_loss`.
        domains: z, shape (..., L).
        heads: evaluation point (:func:`hessian_point`), (M, P) or (..., M, P).
        layout: head layout.
        loss: head loss.
        max_hessian_params: refuse (ValueError) heads with more than this many parameters: the
            Hessian has P^2 entries per domain (spec 8.5); project the features to a small k.

    Returns:
        :class:`HeadStatistics` with counts (..., M), losses (..., M), gradients (..., M, P)
        and hessians (..., M, P, P).
    """
    loss = HeadLoss(loss)
    if layout.num_params > max_hessian_params:
        raise ValueError(
            f"head has P = {layout.num_params} parameters, above max_hessian_params = "
            f"{max_hessian_params}; use a projection to a smaller feature dimension k"
        )
    heads, num_domains = _check_heads(heads, layout)
    features, domains = _check_features(features, _check_domains(domains, num_domains), layout)
    outputs = head_outputs(features, domains, heads, layout)
    values, resid, curvature = _loss_terms(outputs, _target_matrix(targets, outputs, loss), loss)
    phi = _augment(features, layout)
    indicator = _one_hot(domains, num_domains)
    counts = indicator.sum(-2)
    scale = 1.0 / counts.clamp(min=1)
    n, a = layout.num_outputs, layout.in_dim
    grads = torch.einsum("...lm,...lc,...la->...mca", indicator, resid, phi)
    if loss is HeadLoss.SQUARED:  # curvature is 2 I: H = 2 I kron Gram
        gram, _ = _domain_gram(phi, domains, num_domains)
        eye = torch.eye(n, dtype=torch.float64, device=phi.device)
        hess = torch.einsum("ce,...mab->...mcaeb", 2 * eye, gram)
    else:
        weighted = torch.einsum("...lm,...lce->...lmce", indicator, curvature)
        hess = torch.einsum("...lmce,...la,...lb->...mcaeb", weighted, phi, phi)
    p = layout.num_params
    return HeadStatistics(
        counts=counts.long(),
        losses=_domain_means(values, domains, num_domains),
        gradients=grads.reshape(*grads.shape[:-2], p) * scale[..., None],
        hessians=hess.reshape(*hess.shape[:-4], p, p) * scale[..., None, None],
    )


# --------------------------------------------------------------------------------------------
# Server side: re-weighting and aggregation
# --------------------------------------------------------------------------------------------


def domain_weights(counts) -> np.ndarray:
    """Domain re-weighting factors u_m = L / (L_m M) (Sec. 4.1, Eq. 6).

    With them the federated objective sum_i (L_i/L) R_i equals the domain average
    (1/M) sum_m R_m. A domain with no samples anywhere gets u_m = 0 (spec 9.12); M stays the
    number of predefined domains.

    Args:
        counts: per-domain totals L_m, shape (M,), or the count table L_{i,m}, shape (n, M)
            (summed over clients). Should cover all clients, not only those sampled this round.

    Returns:
        float64 array (M,).
    """
    arr = np.asarray(counts)
    table = _count_table(arr, ndim=arr.ndim if arr.ndim in (1, 2) else 2)
    totals = table if table.ndim == 1 else table.sum(0)
    if totals.sum() == 0:
        raise ValueError("domain_weights needs at least one sample; all counts are zero")
    u = np.zeros_like(totals)
    present = totals > 0
    u[present] = totals.sum() / (totals[present] * totals.shape[0])
    return u


def _head_inputs(local_heads, counts, prev_heads) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate (n, M, P) heads, (n, M) counts and (M, P) previous heads."""
    heads = _server_array("local_heads", local_heads, ndim=3)
    n, m, p = heads.shape
    table = _count_table(counts)
    if table.shape != (n, m):
        raise ValueError(f"counts must have shape (n, M) = {(n, m)} to match local_heads, got {table.shape}")
    prev = _server_array("prev_heads", prev_heads, shape=(m, p))
    return heads, table, prev


def aggregate_heads_wa(local_heads, counts, prev_heads) -> np.ndarray:
    """FedDAR-WA head aggregation: w_m = sum_i (L_{i,m} / L_m) w_{i,m} (Sec. 4.3).

    Args:
        local_heads: w_{i,m}, shape (n, M, P) (absent domains: any finite values, ignored).
        counts: L_{i,m}, shape (n, M).
        prev_heads: previous global heads (M, P), kept for domains with L_m = 0.

    Returns:
        float64 array (M, P).
    """
    heads, table, prev = _head_inputs(local_heads, counts, prev_heads)
    return _wa(heads, table, prev)


def _wa(heads: np.ndarray, table: np.ndarray, prev: np.ndarray) -> np.ndarray:
    """Count-weighted average per domain over clients with L_{i,m} > 0; prev where L_m = 0."""
    out = prev.copy()
    for m in np.flatnonzero(table.sum(0) > 0):
        (out[m],) = weighted_average([[h] for h in heads[:, m]], table[:, m])
    return out


def _spectrum(a: np.ndarray) -> tuple[float, float]:
    """(condition number, smallest eigenvalue) of a symmetric PSD matrix; cond = inf when it is
    numerically singular (smallest eigenvalue <= P * eps * largest)."""
    eig = np.linalg.eigvalsh(a)
    singular = eig[0] <= a.shape[0] * np.finfo(np.float64).eps * max(eig[-1], 0.0)
    return (np.inf if singular else float(eig[-1] / eig[0])), float(eig[0])


def _solve_system(a: np.ndarray, b: np.ndarray, prev: np.ndarray, cond: float, options: SAOptions, domain: int):
    """Solve A w = b for one domain per ``options.solver``; returns (w, lam)."""
    dim = a.shape[0]
    if options.solver is SASolver.DAMPED and options.damping > 0:
        trace = float(np.trace(a))
        lam = options.damping * (trace / dim if trace > 0 else 1.0)
        return np.linalg.solve(a + lam * np.eye(dim), b + lam * prev), lam
    if options.solver is SASolver.PINV:
        pinv = np.linalg.pinv(a, rcond=1.0 / options.cond_threshold, hermitian=True)
        return prev + pinv @ (b - a @ prev), 0.0
    if not cond <= options.cond_threshold:
        raise ValueError(
            f"domain {domain}: the summed head Hessian is singular or ill-conditioned "
            f"(condition number {cond:.3g} > cond_threshold {options.cond_threshold:g}); "
            "use solver 'damped' (damping > 0) or 'pinv', or fallback_to_wa=True"
        )
    return np.linalg.solve(a, b), 0.0


def _solve_domains(
    systems: np.ndarray,
    rhs: np.ndarray,
    active: np.ndarray,
    prev: np.ndarray,
    options: SAOptions,
    wa_heads: np.ndarray | None = None,
) -> HeadAggregationResult:
    """Per-domain solve of A_m w_m = b_m for active domains, keeping ``prev`` elsewhere; with
    ``options.fallback_to_wa``, domains whose cond(A_m) exceeds the threshold take ``wa_heads``."""
    num_domains = prev.shape[0]
    heads = prev.copy()
    cond = np.full(num_domains, np.nan)
    low = np.full(num_domains, np.nan)
    lam = np.zeros(num_domains)
    fell_back = np.zeros(num_domains, dtype=bool)
    for m in np.flatnonzero(active):
        a = 0.5 * (systems[m] + systems[m].T)
        cond[m], low[m] = _spectrum(a)
        if options.fallback_to_wa and wa_heads is not None and not cond[m] <= options.cond_threshold:
            heads[m], fell_back[m] = wa_heads[m], True
        else:
            heads[m], lam[m] = _solve_system(a, rhs[m], prev[m], cond[m], options, int(m))
    return HeadAggregationResult(heads, active.copy(), cond, low, lam, fell_back)


def aggregate_heads_sa(
    local_heads, hessians, counts, prev_heads, options: SAOptions = SAOptions()
) -> HeadAggregationResult:
    """FedDAR-SA second-order head aggregation (Eq. 8), per domain m:

        w_m = [sum_i alpha_{i,m} H_{i,m}]^{-1} sum_i alpha_{i,m} H_{i,m} w_{i,m}

    over clients with L_{i,m} > 0, with mean-normalised Hessians from :func:`head_statistics`
    and alpha per :class:`SAWeighting` (default alpha_{i,m} = L_{i,m}). For squared loss with
    exact local heads this equals pooled least squares over all clients' domain-m data, even
    when every client alone is underdetermined. Singular sums (softmax heads, tiny domains) are
    handled by ``options.solver`` / ``options.fallback_to_wa`` (spec 9.3). Domains with no
    samples among the clients keep their previous head.

    Args:
        local_heads: w_{i,m}, shape (n, M, P).
        hessians: H_{i,m}, shape (n, M, P, P) (zero where L_{i,m} = 0); float64 recommended.
        counts: L_{i,m}, shape (n, M).
        prev_heads: previous global heads (M, P).
        options: :class:`SAOptions`.

    Returns:
        :class:`HeadAggregationResult` with heads (M, P) and per-domain diagnostics.
    """
    heads, table, prev = _head_inputs(local_heads, counts, prev_heads)
    n, m, p = heads.shape
    hess = _server_array("hessians", hessians, shape=(n, m, p, p))
    if SAWeighting(options.weighting) is SAWeighting.DOMAIN_COUNT:
        alpha = table.copy()
    else:
        alpha = np.where(table > 0, table.sum(1, keepdims=True), 0.0)
    active = alpha.sum(0) > 0
    alpha = alpha / np.where(active, alpha.sum(0), 1.0)
    systems = np.einsum("im,impq->mpq", alpha, hess)
    rhs = np.einsum("im,impq,imq->mp", alpha, hess, heads)
    return _solve_domains(systems, rhs, active, prev, options, _wa(heads, table, prev))


def aggregate_heads(
    method: HeadAggregation,
    local_heads,
    counts,
    prev_heads,
    hessians=None,
    options: SAOptions = SAOptions(),
) -> HeadAggregationResult:
    """Server head aggregation of one head phase, WA or SA (Algorithm 1, HEADAGG).

    Args:
        method: :class:`HeadAggregation` (``"wa"`` or ``"sa"``).
        local_heads: (n, M, P); counts: (n, M); prev_heads: (M, P).
        hessians: (n, M, P, P), required for SA, ignored for WA.
        options: :class:`SAOptions` (SA only).

    Returns:
        :class:`HeadAggregationResult` (for WA the Hessian diagnostics are NaN).
    """
    method = HeadAggregation(method)
    if method is HeadAggregation.SA:
        if hessians is None:
            raise ValueError("SA head aggregation needs the clients' Hessians (n, M, P, P)")
        return aggregate_heads_sa(local_heads, hessians, counts, prev_heads, options)
    heads, table, prev = _head_inputs(local_heads, counts, prev_heads)
    num_domains = prev.shape[0]
    return HeadAggregationResult(
        heads=_wa(heads, table, prev),
        updated=table.sum(0) > 0,
        condition_numbers=np.full(num_domains, np.nan),
        min_eigenvalues=np.full(num_domains, np.nan),
        damping=np.zeros(num_domains),
        fell_back_to_wa=np.zeros(num_domains, dtype=bool),
    )


def aggregate_encoder(client_arrays: Sequence[Sequence[np.ndarray]], num_examples) -> list[np.ndarray]:
    """Representation-phase aggregation phi^t = sum_i (L_i / L) phi_i^t (Algorithm 1; the
    paper's "theta^{t-1}" on the right-hand side is a typo for theta_i^t).

    Args:
        client_arrays: per client, the list of encoder arrays (same shapes across clients),
            all finite.
        num_examples: L_i per client, shape (n,), non-negative integers with a positive sum.

    Returns:
        list of arrays, the weighted averages in each array's dtype
        (:func:`flwr_pfl.core.aggregation.weighted_average`).
    """
    weights = _count_table(num_examples, ndim=1)
    for i, arrays in enumerate(client_arrays):
        for k, array in enumerate(arrays):
            if not np.all(np.isfinite(array)):
                raise ValueError(f"client {i}: encoder array {k} contains NaN or Inf")
    return weighted_average(client_arrays, weights)


# --------------------------------------------------------------------------------------------
# Algorithm 2 (App. A.2): the analysed linear variant
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Evaluation: binary AUC (the EXAM tables' metric)
# --------------------------------------------------------------------------------------------


def binary_auc(scores, labels) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (Mann-Whitney U / (n+ n-),
    ties counted one half); NaN when only one class is present.

    Args:
        scores: (L,) real scores, higher meaning class 1.
        labels: (L,) in {0, 1}.
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels).ravel().astype(bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=np.float64)
    sorted_s = s[order]
    # average ranks over ties
    _, start, counts = np.unique(sorted_s, return_index=True, return_counts=True)
    avg = start + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
