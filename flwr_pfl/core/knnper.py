"""kNN-Per's mathematics (Marfoq, Neglia, Vidal and Kameni, *Personalized Federated Learning
through Local Memorization*, ICML 2022), as plain torch functions.

kNN-Per trains one global model h (FedAvg). At inference client m interpolates it with a local
k-nearest-neighbours model over a *datastore* S_m of (phi(x_i), y_i) pairs, phi being the global
model's representation (the input of its last layer) on the client's own training samples
(the paper's method; its equation numbers are not cited here because only the paper's abstract
and introduction could be consulted, and every detail below follows the authors' released code):

    p_m(y | x) = lambda_m p_kNN(y | x) + (1 - lambda_m) p_h(y | x),                     (mixture)

    p_kNN(y | x) = sum_{i in N_k(x)} 1[y_i = y] w_i / sum_{i in N_k(x)} w_i,
    w_i = exp(-||phi(x) - phi(x_i)||^2 / (D * T)),                                      (kernel)

where N_k(x) are the k datastore entries nearest to phi(x) in Euclidean distance, D is the
representation's width and T the kernel's scale. The kernel is the authors' code's
(github.com/omarfoq/knn-per at ee17520, ``client.py``, ``KNNPerClient.gather_knn_outputs``;
``eval_knnper.py``): faiss' ``IndexFlatL2`` returns *squared*
L2 distances and the similarities are ``exp(-distances / (features_dimension * scale))`` with
``scale = 1`` (its ``--kernel_length_scale`` default); FL-bench's ``knnper`` does the same. Since
the weights are normalised, p_kNN is a softmax of ``-d_i / (D T)`` over the neighbours, which
is how it is computed here (no underflow when every distance is large). A datastore with fewer
than k entries uses all of them (faiss pads the missing neighbours with infinite distances,
i.e. zero weight). Ties in distance are broken by datastore order (lower index first).

lambda_m is chosen per client from a grid (the authors' ``eval_knnper.py`` sweeps
``np.arange(0, 1 + 1e-6, resolution)``) by :func:`select_lambda`. The capacity experiments of
the paper keep a random fraction of the training samples in the datastore
(:func:`datastore_indices`, the authors' ``DataStore.build`` with strategy ``random``).

Probabilities are combined in log space (``logaddexp``), so that lambda = 0 gives the global
model's log-softmax and lambda = 1 the kNN's log-probabilities exactly. The negative
log-likelihood of a sample is capped at ``-log(PROBABILITY_FLOOR)`` (a class that no neighbour
holds has p_kNN = 0, and with lambda = 1 its loss would be infinite).

The released ``eval_knnper.py`` declares ``--interpolate_logits`` with ``default="store_true"``
and no ``action``: the default is a non-empty string, so its model outputs are *not* passed
through a softmax and lambda p_kNN is added to raw logits. The flag's own help ("if selected
logits are interpolated instead of probabilities") makes probabilities the intended default,
and this module interpolates probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: a sample's mixture probability of its label is floored here for the loss (never for predictions)
PROBABILITY_FLOOR = 1e-12
#: the distance search handles at most this many (query, entry) pairs at once (memory bound)
MAX_PAIRS = 1 << 22


@dataclass(frozen=True)
class Datastore:
    """A client's memory: representations (n, D) and their labels (n,), in datastore order."""

    features: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        if self.features.dim() != 2 or self.labels.dim() != 1 or len(self.features) != len(self.labels):
            raise ValueError(f"a datastore needs features (n, D) and labels (n,); got {tuple(self.features.shape)} "
                             f"and {tuple(self.labels.shape)}")

    @property
    def size(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class LambdaChoice:
    """The selected lambda and how the mixture scored with it on the selection samples
    (``correct`` of ``count``, mean negative log-likelihood ``loss``; NaN when ``count`` is 0)."""

    lam: float
    correct: int
    count: int
    loss: float


# ---------------------------------------------------------------------------- datastore
def datastore_size(n: int, capacity: float) -> int:
    """Entries a datastore of ``capacity`` (a fraction in (0, 1]) keeps of ``n`` training samples:
    ``floor(capacity * n)`` as the authors' ``capacity`` setter, but at least 1 (the authors' empty
    datastore falls back to the global model; here the smallest memory is one sample).

    Raises:
        ValueError: ``capacity`` outside (0, 1] or ``n`` < 1.
    """
    if not 0 < capacity <= 1:
        raise ValueError(f"capacity must lie in (0, 1], got {capacity}")
    if n < 1:
        raise ValueError(f"a datastore needs at least one training sample, got {n}")
    return max(1, min(n, math.floor(capacity * n + 1e-9)))


def datastore_indices(n: int, capacity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Which of ``n`` training samples the datastore keeps, in increasing order: all of them at
    capacity 1, else a uniformly random subset of :func:`datastore_size` samples drawn without
    replacement from ``generator`` (the authors' ``random`` strategy)."""
    m = datastore_size(n, capacity)
    if m == n:
        return torch.arange(n)
    return torch.randperm(n, generator=generator)[:m].sort().values


# ---------------------------------------------------------------------------- the kNN model
def nearest_neighbours(
    queries: torch.Tensor,
    keys: torch.Tensor,
    k: int,
    exclude: torch.Tensor | None = None,
    max_pairs: int = MAX_PAIRS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``min(k, n)`` datastore entries nearest to each query: (squared Euclidean distances
    (Q, k'), entry indices (Q, k')), nearest first, ties by entry index.

    ``exclude[q] = j >= 0`` removes entry j from query q's candidates (its distance is reported
    as +inf and it sorts last; a leave-one-out query on the datastore's own entries). Queries
    are handled in batches of at most ``max_pairs`` (query, entry) pairs: ``torch.cdist`` then a
    stable sort of each row (``topk`` does not define the order of ties).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n = len(keys)
    if n == 0:
        raise ValueError("the datastore is empty")
    width = min(k, n)
    rows = max(1, max_pairs // n)
    distances, indices = [], []
    for start in range(0, len(queries), rows):
        q = queries[start:start + rows]
        d = torch.cdist(q.to(keys.dtype), keys).pow(2)
        if exclude is not None:
            e = exclude[start:start + rows].to(d.device)
            hit = e >= 0
            d[hit.nonzero().squeeze(1), e[hit]] = math.inf
        order = torch.sort(d, dim=1, stable=True).indices[:, :width]
        distances.append(torch.gather(d, 1, order))
        indices.append(order)
    if not distances:
        return keys.new_zeros((0, width)), torch.zeros((0, width), dtype=torch.long, device=keys.device)
    return torch.cat(distances), torch.cat(indices)


def kernel_weights(distances: torch.Tensor, feature_dim: int, temperature: float) -> torch.Tensor:
    """Normalised neighbour weights w_i / sum_j w_j with w_i = exp(-d_i / (D T)) (the authors'
    Gaussian kernel on squared distances), as a softmax in float64; an infinite distance (an
    excluded entry) weighs 0.

    Raises:
        ValueError: a row has no finite distance (no neighbour at all).
    """
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    scaled = -distances.double() / (feature_dim * temperature)
    if len(scaled) and not bool(torch.isfinite(scaled).any(1).all()):
        raise ValueError("a query has no neighbour in the datastore (every candidate was excluded)")
    return torch.softmax(scaled, dim=1)


def knn_probabilities(
    queries: torch.Tensor,
    store: Datastore,
    *,
    k: int,
    num_classes: int,
    temperature: float = 1.0,
    exclude: torch.Tensor | None = None,
    max_pairs: int = MAX_PAIRS,
) -> torch.Tensor:
    """p_kNN(y | x) of every query (Q, C), float64: the kernel-weighted vote of its k nearest
    datastore entries (see the module docstring; ``exclude`` as :func:`nearest_neighbours`).

    Raises:
        ValueError: a datastore label outside [0, num_classes), or a query without neighbours.
    """
    labels = store.labels.long()
    if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"datastore labels must lie in [0, {num_classes}); got values in "
                         f"[{int(labels.min())}, {int(labels.max())}]")
    distances, indices = nearest_neighbours(queries, store.features, k, exclude, max_pairs)
    weights = kernel_weights(distances, store.features.shape[1], temperature)
    probs = torch.zeros(len(queries), num_classes, dtype=torch.float64, device=weights.device)
    return probs.scatter_add_(1, labels.to(indices.device)[indices], weights)


# ---------------------------------------------------------------------------- the mixture
def _log(value: float) -> float:
    return -math.inf if value == 0 else math.log(value)


def check_lambda(lam: float) -> None:
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0 <= lam <= 1:
        raise ValueError(f"lambda must be a number in [0, 1], got {lam!r}")


def mixture_log_probs(knn_probs: torch.Tensor, logits: torch.Tensor, lam: float) -> torch.Tensor:
    """log p_m(y | x) = log(lam p_kNN + (1 - lam) softmax(logits)), (Q, C) float64.

    The global model's log-probabilities are ``log_softmax`` in the logits' own dtype (what its
    cross-entropy uses), then float64; lam = 0 returns them unchanged and lam = 1 returns
    ``log p_kNN`` (``-inf`` where it is 0).
    """
    check_lambda(lam)
    if knn_probs.shape != logits.shape:
        raise ValueError(f"kNN probabilities {tuple(knn_probs.shape)} and logits {tuple(logits.shape)} differ in shape")
    log_global = F.log_softmax(logits, dim=1).double()
    log_knn = knn_probs.double().log()
    return torch.logaddexp(_log(lam) + log_knn, _log(1.0 - lam) + log_global)


def mixture_losses(log_probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sample negative log-likelihood -log p_m(y | x), capped at -log(PROBABILITY_FLOOR)."""
    picked = log_probs.gather(1, labels.long().reshape(-1, 1).to(log_probs.device)).squeeze(1)
    return -picked.clamp_min(math.log(PROBABILITY_FLOOR))


def lambda_grid(step: float) -> list[float]:
    """0, step, 2 step, ... up to 1 (included when 1 / step is a whole number): the authors'
    ``np.arange(0, 1 + 1e-6, weights_grid_resolution)``.

    Raises:
        ValueError: ``step`` outside (0, 1].
    """
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not 0 < step <= 1:
        raise ValueError(f"the lambda grid's step must lie in (0, 1], got {step!r}")
    return [min(1.0, round(float(i * step), 12)) for i in range(math.floor(1.0 / step + 1e-6) + 1)]


def select_lambda(knn_probs: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                  grid: Sequence[float]) -> LambdaChoice:
    """The lambda of ``grid`` whose mixture classifies the selection samples best: the most
    correct predictions; among equals, the lowest mean negative log-likelihood; among those,
    the smallest lambda (the one closest to the global model). With no selection sample every
    candidate ties and the smallest lambda is chosen.

    The samples must be held out from what they are scored against: a validation split (the
    client's normal case), or datastore entries each excluded from its own neighbours.
    """
    if not grid:
        raise ValueError("the lambda grid is empty")
    candidates = sorted(float(g) for g in grid)
    count = len(labels)
    if count == 0:
        return LambdaChoice(candidates[0], 0, 0, math.nan)
    labels = labels.long().reshape(-1).to(logits.device)
    best: LambdaChoice | None = None
    for lam in candidates:
        log_probs = mixture_log_probs(knn_probs, logits, lam)
        correct = int((log_probs.argmax(1) == labels).sum())
        loss = float(mixture_losses(log_probs, labels).mean())
        if best is None or correct > best.correct or (correct == best.correct and loss < best.loss):
            best = LambdaChoice(lam, correct, count, loss)
    assert best is not None
    return best
