"""pFedMe's mathematics (T. Dinh, Tran and Nguyen, NeurIPS 2020, "Personalized Federated Learning
with Moreau Envelopes", Alg. 1).

Client i's objective is the Moreau envelope of its loss f_i,

    F_i(w) = min_theta { f_i(theta) + (lambda / 2) ||theta - w||^2 }                     (Eq. 2)

whose minimiser is the personalized model theta_hat_i(w) = prox_{f_i / lambda}(w) (Eq. 3) and whose
gradient is grad F_i(w) = lambda (w - theta_hat_i(w)). Alg. 1, in round t, client i:

* for each local step r = 0 .. R - 1, on a mini-batch D_i, solves approximately (K gradient steps
  at the personal learning rate) the inner problem

      h~_i(theta; w_{i,r}, D_i) = f~_i(theta; D_i) + (lambda / 2) ||theta - w_{i,r}||^2     (Eq. 7)

  (:func:`inner_objective`, :func:`inner_step`, :func:`inner_solve`; Eq. 8 bounds the solution's
  gradient norm by nu, which K steps approximate), then takes a gradient step on F_i with the
  approximate theta~:

      w_{i,r+1} = w_{i,r} - eta lambda (w_{i,r} - theta~(w_{i,r}))               (Alg. 1, local update)

  (:func:`outer_step`), starting from w_{i,0} = w^t;
* the server mixes the average of the sampled clients' w_{i,R} with the previous global model,

      w^{t+1} = (1 - beta) w^t + beta * average_i w_{i,R}                      (Alg. 1, global update)

  (:func:`server_step`); beta = 1 is plain averaging, beta > 1 extrapolates (the paper uses
  beta = 1 and 2).

Choices where the paper leaves room, taken from the authors' code (CharlieDinh/pFedMe; PFLlib and
FL-bench agree): theta is warm-started, i.e. each inner solve starts from the previous solve's
theta (from w^t at the round's start); the inner solver is plain gradient descent on Eq. 7;
the proximal part is the shared FedProx term (:mod:`flwr_pfl.core.proximal`), not a new one.
Equation numbers follow the paper's arXiv/NeurIPS text.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from flwr_pfl.core.proximal import proximal_gradient, proximal_value

NDArrays = list[np.ndarray]
Params = Mapping[str, torch.Tensor]

#: the fit metric in which a client names its wire arrays that are buffers ('1') or parameters
#: ('0'), in wire order: :func:`server_step`'s ``moves`` are the parameters
BUFFER_MASK = "buffer_mask"


def check_lam(lam: float) -> float:
    """``lam`` as a float when it is a finite number > 0 (Eq. 2's lambda; 0 would leave the
    inner problem without its pull to w, and F_i with a zero gradient).

    Raises:
        ValueError: ``lam`` is not a finite number > 0.
    """
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not (lam > 0 and math.isfinite(lam)):
        raise ValueError(f"pFedMe's lambda must be a finite number > 0, got {lam!r}")
    return float(lam)


def inner_objective(local_loss: torch.Tensor, theta: Params, w: Params, lam: float) -> torch.Tensor:
    """h~_i(theta; w, D) = f~_i(theta; D) + (lambda / 2) ||theta - w||^2 (Eq. 7).

    Args:
        local_loss: f~_i(theta; D), differentiable in ``theta``.
        theta: the personalized model's parameters by name.
        w: the local model w_{i,r} by name (a constant).
        lam: lambda > 0.
    """
    return local_loss + proximal_value(theta, w, check_lam(lam))


def inner_step(theta: Params, local_grad: Params, w: Params, lam: float, lr: float) -> dict[str, torch.Tensor]:
    """One gradient step on Eq. 7: theta - lr (grad f~_i(theta) + lambda (theta - w)), per name."""
    prox = proximal_gradient(theta, w, check_lam(lam))
    return {name: theta[name].detach() - lr * (local_grad[name] + prox[name]) for name in theta}


def inner_solve(
    theta: Params,
    w: Params,
    local_loss: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    lam: float,
    lr: float,
    k: int,
) -> dict[str, torch.Tensor]:
    """The approximate theta~(w) of Alg. 1: ``k`` gradient steps on Eq. 7 (:func:`inner_step`) from
    ``theta`` (the warm start), on the same mini-batch.

    Args:
        theta: the starting personalized parameters by name.
        w: the local model w_{i,r} by name (the anchor; a constant).
        local_loss: f~_i(theta; D) of a dict of parameters, differentiable in them (autograd
            gives its gradient).
        lam: lambda > 0.
        lr: the personal learning rate > 0.
        k: the number of steps K >= 1.

    Raises:
        ValueError: ``k`` < 1 or ``lr`` <= 0.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"pFedMe's K must be an integer >= 1, got {k!r}")
    if not lr > 0:
        raise ValueError(f"pFedMe's personal learning rate must be > 0, got {lr!r}")
    current = {name: t.detach().clone() for name, t in theta.items()}
    for _ in range(k):
        leaves = {name: t.clone().requires_grad_(True) for name, t in current.items()}
        grads = torch.autograd.grad(local_loss(leaves), list(leaves.values()))
        current = inner_step(current, dict(zip(leaves, grads)), w, lam, lr)
    return current


def outer_step(w: Params, theta: Params, lam: float, eta: float) -> dict[str, torch.Tensor]:
    """Alg. 1's local update w - eta lambda (w - theta~), per name: a gradient step of size eta on
    the Moreau envelope F_i, whose gradient at w is lambda (w - theta_hat(w)) (Eq. 2-3)."""
    lam = check_lam(lam)
    return {name: w[name].detach() - eta * lam * (w[name].detach() - theta[name].detach()) for name in w}


def server_step(previous: Sequence[np.ndarray], average: Sequence[np.ndarray], beta: float,
                moves: Sequence[bool] | None = None) -> NDArrays:
    """Alg. 1's global update (1 - beta) w^t + beta * average, array by array, in float64 and
    cast back to each array's dtype.

    Args:
        previous: w^t, the global arrays the round sent.
        average: the average of the clients' w_{i,R} (same layout).
        beta: beta > 0 (1: the average itself).
        moves: one flag per array; an array whose flag is False takes ``average`` as it is (the
            model's buffers, e.g. BatchNorm statistics, which the authors' code leaves out of the
            beta step). None: every floating-point array moves. Integer arrays (step counters)
            never do: an extrapolated count means nothing.

    Raises:
        ValueError: the layouts or the flags do not match, or ``beta`` is not a finite number > 0.
    """
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not (beta > 0 and math.isfinite(beta)):
        raise ValueError(f"pFedMe's beta must be a finite number > 0, got {beta!r}")
    if len(previous) != len(average) or any(np.shape(p) != np.shape(a) for p, a in zip(previous, average)):
        raise ValueError("the previous global arrays and the average do not have the same layout")
    flags = [True] * len(average) if moves is None else list(moves)
    if len(flags) != len(average):
        raise ValueError(f"need one flag per array: {len(average)} arrays, {len(flags)} flags")
    out: NDArrays = []
    for prev, avg, move in zip(previous, average, flags):
        avg = np.asarray(avg)
        if not move or not np.issubdtype(avg.dtype, np.floating):
            out.append(avg.copy())
            continue
        mixed = (1.0 - beta) * np.asarray(prev, np.float64) + beta * avg.astype(np.float64)
        out.append(mixed.astype(avg.dtype))
    return out
