"""Ditto's personal objective (Li, Hu, Beirami and Smith, ICML 2021, Eq. 2 and Alg. 1).

Ditto couples a global objective, here FedAvg's (Eq. 1 with G the example-weighted mean of the
F_k), with a personal model v_k per client that minimises

    h_k(v_k; w*) = F_k(v_k) + (lambda / 2) ||v_k - w*||^2                              (Eq. 2)

Alg. 1 solves it inexactly: in round t, client k takes local steps on h_k(.; w^t) anchored at the
global model w^t it RECEIVED (not the one it sends back after its own global steps),

    v_k <- v_k - eta (grad F_k(v_k) + lambda (v_k - w^t)),                        (Alg. 1)

and v_k persists across rounds. lambda = 0 is local training of v_k; lambda -> infinity pins
v_k to w^t. The proximal part is FedProx's term (:mod:`flwr_pfl.core.proximal`), reused here,
not rewritten: Ditto differs from FedProx only in what it is applied to (the personal model,
not the model sent to the server).

The functions below are the objective and its gradient in closed form, over named parameters
(the tests check them against autograd and hand-computed steps), and the regularizer the client
passes to the training loop.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from flwr_pfl.core.proximal import proximal_gradient, proximal_regularizer, proximal_value
from flwr_pfl.training.loops import Regularizer


def check_lam(lam: float) -> float:
    """``lam`` as a float when it is a finite number >= 0 (Eq. 2's lambda).

    Raises:
        ValueError: ``lam`` is negative, NaN, infinite or not a number.
    """
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0 <= lam < float("inf"):
        raise ValueError(f"Ditto's lambda must be a finite number >= 0, got {lam!r}")
    return float(lam)


def personal_objective(
    local_loss: torch.Tensor,
    personal: Mapping[str, torch.Tensor],
    received: Mapping[str, torch.Tensor],
    lam: float,
) -> torch.Tensor:
    """h_k(v; w^t) = F_k(v) + (lambda / 2) ||v - w^t||^2 (Eq. 2).

    Args:
        local_loss: F_k(v), differentiable in ``personal``.
        personal: v, the personal model's parameters by name.
        received: w^t, the received global model's parameters by name (a constant).
        lam: lambda >= 0.
    """
    return local_loss + proximal_value(personal, received, check_lam(lam))


def personal_gradient(
    local_grad: Mapping[str, torch.Tensor],
    personal: Mapping[str, torch.Tensor],
    received: Mapping[str, torch.Tensor],
    lam: float,
) -> dict[str, torch.Tensor]:
    """grad h_k(v; w^t) = grad F_k(v) + lambda (v - w^t), per name: the direction of Alg. 1's
    personal update."""
    prox = proximal_gradient(personal, received, check_lam(lam))
    return {name: local_grad[name] + prox[name] for name in personal}


def personal_step(
    personal: Mapping[str, torch.Tensor],
    local_grad: Mapping[str, torch.Tensor],
    received: Mapping[str, torch.Tensor],
    lam: float,
    lr: float,
) -> dict[str, torch.Tensor]:
    """One personal update of Alg. 1: v - lr (grad F_k(v) + lambda (v - w^t)), per name."""
    direction = personal_gradient(local_grad, personal, received, lam)
    return {name: personal[name].detach() - lr * direction[name] for name in personal}


def personal_regularizer(received_model: nn.Module, lam: float) -> Regularizer | None:
    """The proximal part of Eq. 2 anchored at ``received_model``'s parameters AS THEY ARE NOW,
    for the training loop's ``regularizer`` hook; ``None`` when lambda is 0 (v_k then trains on
    F_k alone).

    Call it while the module holds the received global model w^t, before any training of this
    round: the anchor is a copy taken at the call, so the personal model can later be swapped
    into the same module and trained against it (the client does exactly that). Covers the
    parameters that train (not buffers such as BatchNorm's statistics, which are not optimised).
    """
    return proximal_regularizer(received_model, check_lam(lam))
