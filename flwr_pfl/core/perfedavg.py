"""Per-FedAvg's meta step (Fallah, Mokhtari and Ozdaglar, NeurIPS 2020, "Personalized Federated
Learning with Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach").

Per-FedAvg learns an initial model w from which every client adapts with one gradient step of
size alpha on its own data. Client i's meta-objective (the MAML objective of the paper's problem
statement) and its gradient are

    F_i(w) = f_i(w - alpha grad f_i(w))
    grad F_i(w) = (I - alpha hess f_i(w)) grad f_i(w - alpha grad f_i(w)),

and Alg. 1's local update estimates grad F_i with three independent batches D, D', D'':

    temp = w - alpha grad f_i(w; D)                                    (inner step)
    w   <- w - beta (I - alpha hess f_i(w; D'')) grad f_i(temp; D')    (outer step)

Section 5 of the paper gives two cheap versions of the outer direction:

* FO (first order): the Hessian term is dropped, the direction is grad f_i(temp; D');
* HF (Hessian-free): the Hessian-vector product hess f_i(w; D'') g, g = grad f_i(temp; D'), is
  replaced by the finite difference [grad f_i(w + delta g; D'') - grad f_i(w - delta g; D'')] /
  (2 delta). Here the product is computed **exactly** by double backward
  (:func:`hessian_vector_product`): the delta -> 0 limit of the paper's difference, with no
  delta to tune and about the cost of one more backward pass (FL-bench computes the finite
  difference with delta = 1e-3; PFLlib implements FO only).

The functions are written over a list of parameter tensors and "loss-at" callables (parameters
-> scalar loss on one fixed batch), so that they know nothing of models or loaders; the client
(:mod:`flwr_pfl.clients.perfedavg`) builds the callables with :func:`batch_loss`. The equation
numbers of the paper are not cited: its text is not in the suite's paper folder; the steps are
named as Alg. 1 and Section 5 name them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.func import functional_call

from flwr_pfl.data.types import Task
from flwr_pfl.training.loops import per_sample_loss

Variant = Literal["fo", "hf"]
#: the variants of Section 5: first-order and Hessian-free
VARIANTS: tuple[Variant, ...] = ("fo", "hf")
#: parameters -> scalar loss on one fixed batch
LossAt = Callable[[Sequence[torch.Tensor]], torch.Tensor]


def batches_per_step(variant: Variant) -> int:
    """Independent batches one meta step draws: D and D' (FO), and D'' too (HF)."""
    check_variant(variant)
    return 3 if variant == "hf" else 2


def check_variant(variant: str) -> Variant:
    """``variant`` when it is one of :data:`VARIANTS`.

    Raises:
        ValueError: naming the value and the allowed ones.
    """
    if variant not in VARIANTS:
        raise ValueError(f"Per-FedAvg's variant must be one of {', '.join(VARIANTS)}; got {variant!r}")
    return variant  # type: ignore[return-value]


def _gradient(loss: torch.Tensor, params: Sequence[torch.Tensor], create_graph: bool = False) -> list[torch.Tensor]:
    """d loss / d params, zeros for a parameter the loss does not depend on."""
    if not loss.requires_grad:
        return [torch.zeros_like(p) for p in params]
    return list(torch.autograd.grad(loss, list(params), create_graph=create_graph, allow_unused=True,
                                    materialize_grads=True))


def _leaves(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh leaves with the values of ``params`` that require a gradient (the graph of a
    meta step never reaches the caller's tensors)."""
    return [p.detach().requires_grad_(True) for p in params]


def inner_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], alpha: float) -> list[torch.Tensor]:
    """temp = w - alpha g: Alg. 1's inner (adaptation) step, detached from any graph."""
    return [(p - alpha * g).detach() for p, g in zip(params, grads)]


def outer_step(params: Sequence[torch.Tensor], direction: Sequence[torch.Tensor], beta: float) -> list[torch.Tensor]:
    """w - beta d: Alg. 1's outer step with plain SGD (the client takes it with the suite's
    optimizer, which is this step for ``sgd`` without momentum or weight decay)."""
    return [(p - beta * d).detach() for p, d in zip(params, direction)]


def hessian_vector_product(loss_at: LossAt, params: Sequence[torch.Tensor], vector: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """hess f(w) v by double backward: the gradient of <grad f(w), v> in w, v held constant.

    Exact (no finite difference); a parameter the loss does not reach, or reaches only
    linearly, gets zeros.

    Raises:
        RuntimeError: the model has an operation without a second derivative (torch's message,
            e.g. a custom ``autograd.Function`` marked ``once_differentiable``).
    """
    leaves = _leaves(params)
    grads = _gradient(loss_at(leaves), leaves, create_graph=True)
    dot = sum((g * v.detach()).sum() for g, v in zip(grads, vector))
    return [h.detach() for h in _gradient(dot, leaves)]


@dataclass(frozen=True)
class MetaStep:
    """One meta step's outer direction and the two losses it saw.

    Attributes:
        direction: the estimate of grad F_i(w), one tensor per parameter.
        loss: f_i(w; D), the loss before adaptation (what FedAvg's train loss measures).
        adapted_loss: f_i(temp; D'), the meta-objective's sample value after the inner step.
    """

    direction: list[torch.Tensor]
    loss: torch.Tensor
    adapted_loss: torch.Tensor


def meta_step(variant: Variant, losses: Sequence[LossAt], params: Sequence[torch.Tensor], alpha: float) -> MetaStep:
    """Alg. 1's outer direction at w = ``params`` from the batch losses ``losses`` =
    (f(.; D), f(.; D')) for FO, (f(.; D), f(.; D'), f(.; D'')) for HF:

        g    = grad f(temp; D'),  temp = w - alpha grad f(w; D)
        FO:  d = g
        HF:  d = g - alpha hess f(w; D'') g       (the product exact, :func:`hessian_vector_product`)

    Raises:
        ValueError: an unknown variant, or not :func:`batches_per_step` losses.
    """
    if len(losses) != batches_per_step(variant):
        raise ValueError(f"Per-FedAvg ({variant}) takes {batches_per_step(variant)} batch losses, got {len(losses)}")
    leaves = _leaves(params)
    loss = losses[0](leaves)
    temp = _leaves(inner_step(leaves, _gradient(loss, leaves), alpha))
    adapted_loss = losses[1](temp)
    direction = [g.detach() for g in _gradient(adapted_loss, temp)]
    if variant == "hf":
        product = hessian_vector_product(losses[2], params, direction)
        direction = [g - alpha * h for g, h in zip(direction, product)]
    return MetaStep(direction, loss.detach(), adapted_loss.detach())


def batch_loss(model: nn.Module, names: Sequence[str], x: torch.Tensor, y: torch.Tensor, d: torch.Tensor,
               task: Task = "classification") -> LossAt:
    """The mean supervised loss of ``model`` on the batch (x, y, d) as a function of the
    parameters ``names`` (``model.named_parameters()`` names, in the order the values come).

    The model runs with the given values in place of those parameters
    (:func:`torch.func.functional_call`); its buffers are its own, so a BatchNorm in train mode
    updates its running statistics at every call, as a plain forward pass would.
    """

    def loss_at(values: Sequence[torch.Tensor]) -> torch.Tensor:
        outputs = functional_call(model, dict(zip(names, values)), (x, d))
        return per_sample_loss(outputs, y, task).mean()

    return loss_at
