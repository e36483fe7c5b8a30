"""Client side: per-domain counts L_{i,m}, the outputs h_z(phi(x)) of each sample's domain head
(Sec. 3.1), per-sample losses, the head-phase objective sum_m R_{i,m} (Algorithm 1 head step) and
the domain re-weighted risk of the representation phase (Eq. 6).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from flwr_pfl.core.feddar.checks import (
    _augment,
    _check_domains,
    _check_features,
    _check_heads,
    _one_hot,
)
from flwr_pfl.core.feddar.layout import HeadLayout
from flwr_pfl.core.feddar.options import HeadLoss


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
