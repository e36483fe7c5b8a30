"""FedAMP's attentive message passing (Huang, Chu, Zhou, Wang, Liu, Pei and Zhang, *Personalized
Cross-Silo Federated Learning on Non-IID Data*, AAAI 2021; arXiv 2007.03797).

Every client i keeps a personalized model w_i. The objective couples them through an
attention-inducing function A of their squared distances,

    G(W) = sum_i F_i(w_i) + lambda sum_{i<j} A(||w_i - w_j||^2),                        (Eq. 1-2)

with A increasing, concave, A(0) = 0; the paper's experiments use A(x) = 1 - exp(-x / sigma).
FedAMP alternates a gradient step on the attention term, done by the server, with a proximal
step on the clients' losses, done by the clients:

    U^k = W^{k-1} - alpha_k grad A(W^{k-1}),                                             (Eq. 3)
    W^k = argmin_W F(W) + lambda / (2 alpha_k) ||W - U^k||^2.                            (Eq. 4)

Row by row, the server's step gives each client its personalized cloud model

    u_i^k = xi_i1 w_1^{k-1} + ... + xi_im w_m^{k-1},                                     (Eq. 5)
    xi_ij = alpha_k A'(||w_i^{k-1} - w_j^{k-1}||^2)  (j != i),   xi_ii = 1 - sum_{j != i} xi_ij,

and client i solves (approximately, by local SGD)

    w_i^k = argmin_w F_i(w) + lambda / (2 alpha_k) ||w - u_i^k||^2.                      (Eq. 6)

With A(x) = 1 - exp(-x / sigma), A'(x) = exp(-x / sigma) / sigma: a close model (small distance)
gets a large weight, a far one a weight near 0, and sigma scales both the distances and the
weights. The weights sum to 1 by construction; they are all >= 0 (u_i is a convex combination)
when alpha_k sum_{j != i} A'(.) <= 1, which holds for every distance when
alpha_k (m - 1) / sigma <= 1 (:func:`self_weight_lower_bound`). Eq. 5 is the gradient step of
Eq. 3 with the factor 2 of d/dw_i ||w_i - w_j||^2 absorbed into alpha_k, as printed in the paper
(and as PFLlib, fluke and FLGo compute it).

The proximal term of Eq. 6 is FedProx's term with mu = lambda / alpha_k
(:func:`proximal_coefficient`; :mod:`flwr_pfl.core.proximal`), reused, not rewritten.

Arrays: the server holds every client's model as a list of stacked arrays, ``stacks[a]`` of shape
``(m, *shape_a)`` (row i = client i's array a, in the model's wire order), and a boolean ``mask``
saying which arrays are model parameters. Distances and the combination are over the parameters
(the paper's w); the other arrays (BatchNorm running statistics and step counter) are not
parameters: u_i carries client i's own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from flwr_pfl.core.proximal import proximal_regularizer
from flwr_pfl.errors import ConfigError

NDArrays = list[np.ndarray]

#: fit-config keys: the server's step alpha_k and lambda, which set the client's proximal term
ALPHA_KEY = "fedamp-alpha-k"
LAM_KEY = "fedamp-lam"
#: the extra array closing every fit reply: 1.0 where the wire array is a model parameter
MASK_NAME = "fedamp:parameter-mask"
#: float64 values one block of rows may hold while distances and combinations are computed
BLOCK_VALUES = 1 << 22


def _finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def check_hyperparameters(alpha_k: object, lam: object, sigma: object, key: Callable[[str], str] = str) -> None:
    """Refuse bad hyperparameters, naming each by ``key(<kebab-case name>)``.

    Raises:
        ConfigError: ``alpha-k`` or ``sigma`` is not a finite number > 0, or ``lam`` not a finite
            number >= 0 (0: no proximal pull, the client trains F_i alone from u_i).
    """
    if not _finite(alpha_k) or not alpha_k > 0:  # type: ignore[operator]
        raise ConfigError(f"{key('alpha-k')} must be a finite number > 0 (the message-passing step alpha_k); got {alpha_k!r}")
    if not _finite(lam) or not lam >= 0:  # type: ignore[operator]
        raise ConfigError(f"{key('lam')} must be a finite number >= 0 (Eq. 6's lambda); got {lam!r}")
    if not _finite(sigma) or not sigma > 0:  # type: ignore[operator]
        raise ConfigError(f"{key('sigma')} must be a finite number > 0 (the scale of A(x) = 1 - exp(-x / sigma)); "
                          f"got {sigma!r}")


# ------------------------------------------------------------------------------ the attention function
def attention(x: np.ndarray | float, sigma: float) -> np.ndarray:
    """A(x) = 1 - exp(-x / sigma), the paper's attention-inducing function (Sec. 5)."""
    return -np.expm1(-np.asarray(x, np.float64) / sigma)


def attention_derivative(x: np.ndarray | float, sigma: float) -> np.ndarray:
    """A'(x) = exp(-x / sigma) / sigma: the weight per unit alpha_k of Eq. 5."""
    return np.exp(-np.asarray(x, np.float64) / sigma) / sigma


def self_weight_lower_bound(num_clients: int, alpha_k: float, sigma: float) -> float:
    """1 - alpha_k (m - 1) / sigma: the least xi_ii can be (A' <= 1 / sigma); u_i is a convex
    combination for every distance when it is >= 0."""
    return 1.0 - alpha_k * (num_clients - 1) / sigma


def message_weights(squared_distances: np.ndarray, index: int, alpha_k: float, sigma: float) -> np.ndarray:
    """xi_i of Eq. 5 for client ``index``: alpha_k A'(d_ij) for j != i, 1 - their sum for j = i.

    Args:
        squared_distances: ``(m,)`` the ||w_i - w_j||^2 of client i to every client (its own entry
            is ignored).
        index: i.
    """
    d = np.asarray(squared_distances, np.float64)
    xi = alpha_k * attention_derivative(d, sigma)
    xi[index] = 0.0
    xi[index] = 1.0 - xi.sum()
    return xi


# ------------------------------------------------------------------------------ distances and cloud models
def _blocks(rows: int, size: int) -> Iterator[slice]:
    """Row blocks of at most :data:`BLOCK_VALUES` float64 values (memory O(P), not O(m P))."""
    step = max(1, BLOCK_VALUES // max(size, 1))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def _parameter_arrays(stacks: Sequence[np.ndarray], mask: Sequence[bool]) -> Iterator[np.ndarray]:
    if len(mask) != len(stacks):
        raise ValueError(f"the mask has {len(mask)} entries for {len(stacks)} arrays")
    for stack, is_parameter in zip(stacks, mask):
        if is_parameter:
            yield stack.reshape(stack.shape[0], -1)


def squared_distances(stacks: Sequence[np.ndarray], index: int, mask: Sequence[bool]) -> np.ndarray:
    """``(m,)`` ||w_i - w_j||^2 over the parameter arrays (``mask``), in float64, for i = ``index``."""
    rows = stacks[0].shape[0]
    out = np.zeros(rows, np.float64)
    for flat in _parameter_arrays(stacks, mask):
        own = flat[index].astype(np.float64)
        for block in _blocks(rows, flat.shape[1]):
            diff = flat[block].astype(np.float64) - own
            out[block] += np.einsum("ij,ij->i", diff, diff)
    return out


def cloud_model(stacks: Sequence[np.ndarray], index: int, weights: np.ndarray, mask: Sequence[bool]) -> NDArrays:
    """u_i of Eq. 5 as the model's arrays, for i = ``index`` and ``weights`` = xi_i.

    Parameter arrays: w_i + sum_{j != i} xi_ij (w_j - w_i), which is sum_j xi_ij w_j because the
    weights sum to 1, computed in float64 so that u_i = w_i exactly when every model equals w_i
    (or every other weight is 0); cast back to each array's dtype. Other arrays: w_i's.
    """
    xi = np.asarray(weights, np.float64).copy()
    if abs(xi.sum() - 1.0) > 1e-9 * max(1.0, float(np.abs(xi).sum())):
        raise ValueError(f"the weights of Eq. 5 must sum to 1; they sum to {xi.sum()!r}")
    xi[index] = 0.0
    out: NDArrays = []
    for stack, is_parameter in zip(stacks, mask, strict=True):
        own = stack[index]
        if not is_parameter:
            out.append(own.copy())
            continue
        flat = stack.reshape(stack.shape[0], -1)
        acc = flat[index].astype(np.float64)
        for block in _blocks(flat.shape[0], flat.shape[1]):
            acc += xi[block] @ (flat[block].astype(np.float64) - flat[index].astype(np.float64))
        out.append(acc.reshape(own.shape).astype(stack.dtype))
    return out


# ------------------------------------------------------------------------------ the client's objective
def proximal_coefficient(lam: float, alpha_k: float) -> float:
    """mu = lambda / alpha_k: Eq. 6's term lambda / (2 alpha_k) ||w - u_i||^2 is (mu / 2) ||w - u_i||^2."""
    return float(lam) / float(alpha_k)


def client_regularizer(model: nn.Module, lam: float, alpha_k: float) -> Callable[[nn.Module], torch.Tensor] | None:
    """Eq. 6's proximal term anchored at ``model``'s parameters as they are now (u_i, just loaded):
    FedProx's :func:`~flwr_pfl.core.proximal.proximal_regularizer` with mu = lambda / alpha_k
    (None when lambda = 0)."""
    return proximal_regularizer(model, proximal_coefficient(lam, alpha_k))
