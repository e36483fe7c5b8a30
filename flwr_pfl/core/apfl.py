"""APFL's mixed model and its updates (Deng, Kamani and Mahdavi, "Adaptive Personalized Federated
Learning", arXiv:2003.13461, 2020).

Each client i keeps, beside its local copy w_i of the global model, a personal model v_i and a
mixing weight alpha_i in [0, 1]. Its personalized model is the parameter mixture

    v_bar_i = alpha_i v_i + (1 - alpha_i) w_i                            (Sec. 3, the mixed model)

Alg. 1 ("local descent APFL"), at each local step t on one sample (batch) xi_i^t, updates, all
from the iterates of step t - 1 (no update sees another's result of the same step):

    w_i^t = w_i^{t-1} - eta_t grad f_i(w_i^{t-1}; xi)                      (the global copy)
    v_i^t = v_i^{t-1} - eta_t grad_v f_i(v_bar_i^{t-1}; xi)                (the personal model)
          = v_i^{t-1} - eta_t alpha_i grad f_i(v_bar_i^{t-1}; xi)           (chain rule)

and, with the adaptive mixing weight (the paper's alpha update, Sec. "adaptive alpha"),

    alpha_i^t = alpha_i^{t-1} - eta_t grad_alpha f_i(v_bar_i^{t-1}; xi),
    grad_alpha f_i(v_bar) = < v_i - w_i, grad f_i(v_bar) >,

projected onto [0, 1]. The server averages the w_i (FedAvg). The functions below are these
formulas on named tensors; the client applies them to the model's parameters
(:mod:`flwr_pfl.clients.apfl`), and the tests check them against autograd and closed forms.

Where the authors' code (MLOPTPSU/FedTorch ``train_and_validate_federated_apfl``) departs from the
paper, the paper is followed, and the departures are named: it mixes the two models' OUTPUTS
(alpha v(x) + (1 - alpha) w(x)) instead of their parameters; it takes v's step after w's step on
the same batch (so v's gradient is taken at the updated w); it updates alpha once per round (the
first step) with an extra ``0.02 * alpha`` term in its gradient. PFLlib and FL-bench copy the
alpha update with its 0.02 term (every step); PFLlib trains v on its own loss, not the mixed one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch


def check_alpha(alpha: float, what: str = "APFL's alpha") -> float:
    """``alpha`` as a float when it is a number in [0, 1].

    Raises:
        ValueError: ``alpha`` is not a number in [0, 1] (``what`` names it).
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"{what} must be a number in [0, 1], got {alpha!r}")
    return float(alpha)


def mix(
    personal: Mapping[str, torch.Tensor], global_: Mapping[str, torch.Tensor], alpha: float
) -> dict[str, torch.Tensor]:
    """The mixed model's parameters alpha v + (1 - alpha) w (Sec. 3), per name of ``personal``."""
    return {name: alpha * v + (1 - alpha) * global_[name] for name, v in personal.items()}


def mixed_state(
    personal: Mapping[str, torch.Tensor],
    global_: Mapping[str, torch.Tensor],
    alpha: float,
    parameter_names: Iterable[str],
) -> dict[str, torch.Tensor]:
    """A whole ``state_dict`` of the mixed model: :func:`mix` on ``parameter_names``, every other
    entry (buffers: BatchNorm's running statistics and step counter) the personal model's own.

    The paper mixes parameters and says nothing of buffers. The personal model's are taken: in
    training they are the statistics the mixed forward passes update (the global copy's are
    FedAvg's, averaged by the server), so they describe the features the mixed model produces.
    """
    names = set(parameter_names)
    mixed = mix({k: v for k, v in personal.items() if k in names}, global_, alpha)
    return {k: mixed[k] if k in names else personal[k] for k in personal}


def personal_gradient(grad_at_mix: Mapping[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """grad_v f(v_bar) = alpha grad f(v_bar) (Alg. 1's personal update, by the chain rule through
    v_bar = alpha v + (1 - alpha) w, w held fixed), per name."""
    return {name: alpha * g for name, g in grad_at_mix.items()}


def alpha_gradient(
    personal: Mapping[str, torch.Tensor],
    global_: Mapping[str, torch.Tensor],
    grad_at_mix: Mapping[str, torch.Tensor],
) -> float:
    """grad_alpha f(v_bar) = < v - w, grad f(v_bar) >, summed over every parameter (the paper's
    alpha update), with v, w and the gradient all taken at the same step's iterates."""
    total = 0.0
    for name, g in grad_at_mix.items():
        total += float(((personal[name].detach() - global_[name].detach()) * g).sum())
    return total


def alpha_step(alpha: float, gradient: float, lr: float) -> float:
    """One projected step: alpha - lr * gradient, clipped to [0, 1].

    Raises:
        FloatingPointError: the step is not finite (a diverged gradient would otherwise be
            clipped to 0 or 1 silently).
    """
    stepped = alpha - lr * gradient
    if not math.isfinite(stepped):
        raise FloatingPointError(f"APFL's alpha update became {stepped} (gradient {gradient}, lr {lr})")
    return min(1.0, max(0.0, stepped))
