"""The proximal term of FedProx (Li et al., MLSys 2020, Eq. 2), shared by every algorithm that uses it.

FedProx's client k minimises, from the global model w^t,

    h_k(w; w^t) = F_k(w) + (mu / 2) ||w - w^t||^2                                     (Eq. 2)

whose proximal part has the gradient mu (w - w^t). The term is written once here, over named
parameters: FedProx and FedProx + fine-tuning (:mod:`flwr_pfl.clients.fedprox`) and FMTL's
``FedProx+FMTL`` variant (:mod:`flwr_pfl.clients.fmtl`) add :func:`proximal_regularizer` to their
local loss through the training loop's ``regularizer`` hook.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn


def _check_mu(mu: float) -> None:
    if not mu >= 0:
        raise ValueError(f"the proximal coefficient mu must be >= 0, got {mu}")


def proximal_value(params: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor], mu: float) -> torch.Tensor:
    """(mu / 2) sum_name ||params[name] - anchor[name]||^2: the proximal part of Eq. 2.

    Differentiable in ``params``; ``anchor`` (w^t) is treated as a constant. Empty ``params``
    give a zero scalar.

    Raises:
        ValueError: ``mu`` < 0, or a name of ``params`` is missing from ``anchor``.
    """
    _check_mu(mu)
    missing = sorted(set(params) - set(anchor))
    if missing:
        raise ValueError(f"the anchor has no value for {missing}")
    terms = [(p - anchor[name].detach()).pow(2).sum() for name, p in params.items()]
    return 0.5 * mu * torch.stack(terms).sum() if terms else torch.zeros(())


def proximal_gradient(
    params: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor], mu: float
) -> dict[str, torch.Tensor]:
    """mu (params[name] - anchor[name]) per name: the gradient of :func:`proximal_value` (Eq. 2)."""
    _check_mu(mu)
    return {name: mu * (p.detach() - anchor[name].detach()) for name, p in params.items()}


def proximal_regularizer(model: nn.Module, mu: float) -> Callable[[nn.Module], torch.Tensor] | None:
    """The proximal part of Eq. 2 anchored at ``model``'s parameters as they are now (w^t).

    Returns a function of the model being trained giving :func:`proximal_value` over its
    parameters that require a gradient (the ones the current phase trains; frozen parameters
    do not move and add nothing), for the training loop's ``regularizer`` hook; ``None`` when
    ``mu`` is 0 (FedAvg's objective, no extra work per step).
    """
    _check_mu(mu)
    if mu == 0:
        return None
    anchor = {name: p.detach().clone() for name, p in model.named_parameters()}

    def regularizer(trained: nn.Module) -> torch.Tensor:
        params = {name: p for name, p in trained.named_parameters() if p.requires_grad}
        return proximal_value(params, anchor, mu)

    return regularizer
