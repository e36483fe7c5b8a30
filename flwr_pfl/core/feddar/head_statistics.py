"""Client side, head phase: the exact local least-squares heads, the point where the Hessian is
evaluated, and the per-domain losses, gradients and (mean-normalised) Hessians that SA needs
(Eq. 8).
"""

from __future__ import annotations

from dataclasses import dataclass

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
from flwr_pfl.core.feddar.losses import _domain_means, _loss_terms, _target_matrix, head_outputs
from flwr_pfl.core.feddar.options import HeadLoss, HessianAt


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
    n = layout.num_outputs
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
