"""Client side, every round: the proximal term ``lambda ||theta - theta_hat||^2`` (Eq. 2 / Eq. 9).

Added to the loss (:func:`proximal_penalty`) or applied after the optimizer step as the official
code does (:func:`apply_proximal_correction_`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from flwr_pfl.core.fedora.options import TensorOrArray


def _as_list(params: TensorOrArray | Sequence[TensorOrArray]) -> list[TensorOrArray]:
    if isinstance(params, (torch.Tensor, np.ndarray)):
        return [params]
    return list(params)


def _paired(
    params: TensorOrArray | Sequence[TensorOrArray],
    aux_params: TensorOrArray | Sequence[TensorOrArray],
) -> list[tuple[TensorOrArray, TensorOrArray]]:
    a, b = _as_list(params), _as_list(aux_params)
    if len(a) != len(b):
        raise ValueError(f"{len(a)} parameter arrays but {len(b)} auxiliary arrays")
    for i, (x, y) in enumerate(zip(a, b)):
        if tuple(x.shape) != tuple(y.shape):
            raise ValueError(f"parameter {i} has shape {tuple(x.shape)} but its auxiliary "
                             f"counterpart has {tuple(y.shape)}")
    return list(zip(a, b))


def proximal_penalty(
    params: TensorOrArray | Sequence[TensorOrArray],
    aux_params: TensorOrArray | Sequence[TensorOrArray],
    lam: float | TensorOrArray,
    prox_factor: float = 2.0,
) -> torch.Tensor | float:
    """The proximal loss ``(f / 2) * lambda * ||theta - theta_hat||^2`` (Eq. 2, Eq. 9).

    Its gradient with respect to ``theta`` is ``f * lambda * (theta - theta_hat)``
    (:func:`proximal_gradient`). With ``f = 2`` (paper) this is exactly the paper's
    ``lambda ||theta - theta_hat||^2``; ``f = 1`` is the official code's effective regulariser.
    Add it to the task loss for ``ProxOptions.mode = "loss"``; ``theta_hat`` must be detached.

    Args:
        params: ``theta``: one tensor/array or a sequence (e.g. ``model.parameters()``).
        aux_params: ``theta_hat`` with the same shapes.
        lam: ``lambda`` >= 0 (scalar, or broadcastable against each array).
        prox_factor: ``f``.

    Returns:
        A scalar (a torch scalar tensor, differentiable, for torch inputs).
    """
    total: torch.Tensor | float = 0.0
    for theta, theta_hat in _paired(params, aux_params):
        total = total + (lam * (theta - theta_hat) ** 2).sum()
    return 0.5 * prox_factor * total


def proximal_gradient(
    theta: TensorOrArray, theta_hat: TensorOrArray, lam: float | TensorOrArray, prox_factor: float = 2.0
) -> TensorOrArray:
    """``f * lambda * (theta - theta_hat)``, the gradient of :func:`proximal_penalty` (Eq. 9).

    ``theta`` and ``theta_hat`` have the same shape; ``lam`` broadcasts against them (e.g.
    ``(K, 1, 1)`` for a ``(K, a, b)`` stack of client models).
    """
    return prox_factor * lam * (theta - theta_hat)


def apply_proximal_correction_(
    params: Sequence[torch.Tensor] | torch.Tensor,
    params_before: Sequence[TensorOrArray] | TensorOrArray,
    aux_params: Sequence[TensorOrArray] | TensorOrArray,
    lam: float | torch.Tensor,
    lr: float,
    prox_factor: float = 1.0,
) -> None:
    """In-place official-code proximal step: ``theta <- theta - lr f lambda (theta_b - theta_hat)``.

    ``ProxOptions.mode = "post_step"``: call after ``optimizer.step()`` (which applied the
    task-loss gradient with momentum and weight decay), with ``params_before`` the parameters
    saved just before that step. The correction bypasses momentum and weight decay. The code uses
    ``f = 1``.

    Args:
        params: the model's parameters ``theta`` (modified in place, without autograd).
        params_before: ``theta`` before the optimizer step, same shapes.
        aux_params: ``theta_hat``, same shapes.
        lam: ``lambda`` >= 0, scalar or broadcastable.
        lr: the learning rate of the step.
        prox_factor: ``f``.
    """
    pairs = _paired(params, aux_params)
    before = _as_list(params_before)
    if len(before) != len(pairs):
        raise ValueError(f"{len(pairs)} parameter arrays but {len(before)} saved arrays")
    with torch.no_grad():
        for (theta, theta_hat), theta_b in zip(pairs, before):
            theta -= lr * proximal_gradient(theta_b, theta_hat, lam, prox_factor)
