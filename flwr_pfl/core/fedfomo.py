"""FedFomo's mathematics (Zhang, Sapra, Fidler, Yeung and Alvarez, *Personalized Federated
Learning with First Order Model Optimization*, ICLR 2021, Sec. 3), as plain NumPy functions.

* The first-order model weights: client i weighs a downloaded model theta_n by
  ``w_n = (L_i(theta_i) - L_i(theta_n)) / ||theta_n - theta_i||``, ``L_i`` its loss on its own
  validation split: the slope of its loss along the step from its model to theta_n.
* Their normalisation: ``max(w_n, 0) / sum_m max(w_m, 0)``; only models that lower the loss
  count; when none does, the client keeps its model.
* The federated update: ``theta_i <- theta_i + sum_n w_n (theta_n - theta_i)``.
* Model download: the server keeps an affinity matrix ``P`` (N x N); row i adds up the weights
  client i computed for the models it was sent. Each round client i is sent M models, chosen
  epsilon-greedily: per slot, with probability ``epsilon_t`` a random one, otherwise the one of
  highest affinity not chosen yet; ``epsilon_t`` decays linearly by round.

The paper's full text could not be consulted offline when this was written, so its formulas are
cited by name rather than by equation number. Where a detail is open, the authors' code
(github.com/NVlabs/FedFomo, ``federation.py``, ``client.py``) or FL-bench's ``fedfomo``
(``src/server/fedfomo.py``, ``src/client/fedfomo.py``) decides; each function says which.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NDArrays = list[np.ndarray]


def exploration_rate(epsilon: float, decay: float, server_round: int) -> float:
    """``epsilon_t = max(0, epsilon - decay * (t - 1))`` for the run's round ``t`` (1-based).

    The authors' code explores with probability ``epsilon - epoch * epsilon_decay`` in its
    round ``epoch``; its round 0 only trains locally (there is nothing to download yet), as this
    suite's round 1 does, so its round ``epoch`` is this suite's round ``epoch + 1``.
    """
    if server_round < 1:
        raise ValueError(f"server_round must be >= 1, got {server_round}")
    return max(0.0, float(epsilon) - float(decay) * (server_round - 1))


def select_candidates(
    affinity_row: np.ndarray, pool: Sequence[int], num_models: int, epsilon: float, rng: np.random.Generator
) -> list[int]:
    """The models client i is sent (model download): ``min(num_models, len(pool))`` distinct ids of
    ``pool`` (i itself must not be in it), in the order chosen.

    The authors' ``get_federating_clients`` (``e_greedy``): the pool ranked by affinity
    ``affinity_row[j]``, highest first, ties in a random order; a random order of the pool; then
    per slot one uniform draw ``u``: ``u < epsilon`` takes the next of the random order,
    otherwise the next of the ranking, skipping ids already taken. With ``epsilon = 0`` this is
    the top ``num_models`` by affinity. Draws from ``rng``: the tie-breaking permutation, the
    random order, one uniform per slot.
    """
    ids = np.asarray(list(pool), dtype=np.int64)
    if len(set(ids.tolist())) != len(ids):
        raise ValueError(f"the candidate pool repeats an id: {ids.tolist()}")
    count = min(int(num_models), len(ids))
    if count <= 0:
        return []
    shuffled = ids[rng.permutation(len(ids))]  # random tie-breaking (authors: lexsort on random keys)
    ranked = list(shuffled[np.argsort(-np.asarray(affinity_row, dtype=np.float64)[shuffled], kind="stable")])
    random_order = list(ids[rng.permutation(len(ids))])
    chosen: list[int] = []
    for _ in range(count):
        source = random_order if rng.uniform() < epsilon else ranked
        while True:
            pick = int(source.pop(0))
            if pick not in chosen:
                chosen.append(pick)
                break
    return chosen


def parameter_distance(own: Sequence[np.ndarray], other: Sequence[np.ndarray], mask: Sequence[bool]) -> float:
    """``||theta_n - theta_i||``: the Euclidean norm, in float64, over the arrays where ``mask``
    is True (the model's trainable parameters: the authors' ``compute_parameter_difference``
    iterates over ``model.parameters()``, so BatchNorm statistics do not count)."""
    if not len(own) == len(other) == len(mask):
        raise ValueError(f"{len(own)} own arrays, {len(other)} other arrays and {len(mask)} mask entries")
    total = 0.0
    for a, b, used in zip(own, other, mask):
        if used:
            diff = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
            total += float(np.dot(diff.ravel(), diff.ravel()))
    return float(np.sqrt(total))


def first_order_weights(own_loss: float, losses: Sequence[float], distances: Sequence[float]) -> np.ndarray:
    """The raw first-order weights ``(L_i(theta_i) - L_i(theta_n)) / ||theta_n - theta_i||``
    (float64, negative where theta_n is worse), with two guards: a model at distance 0 (the same
    parameters: no direction to step in) and a non-finite quotient (a loss of NaN or Inf) weigh
    0. FL-bench adds 1e-5 to every distance instead; the guard leaves the other weights exact."""
    losses = np.asarray(losses, dtype=np.float64)
    distances = np.asarray(distances, dtype=np.float64)
    if losses.shape != distances.shape or losses.ndim != 1:
        raise ValueError(f"need one loss per distance, got shapes {losses.shape} and {distances.shape}")
    if (distances < 0).any():
        raise ValueError(f"distances must be >= 0, got {distances.tolist()}")
    with np.errstate(divide="ignore", invalid="ignore"):
        raw = (float(own_loss) - losses) / distances
    return np.where(np.isfinite(raw), raw, 0.0)  # a distance of 0 gives +-inf or NaN: both guards at once


def normalized_weights(raw: np.ndarray) -> np.ndarray:
    """The normalisation: ``max(w_n, 0) / sum_m max(w_m, 0)``; all zeros when no weight is
    positive (then the update keeps theta_i: the authors' code falls back to the own model)."""
    positive = np.maximum(np.asarray(raw, dtype=np.float64), 0.0)
    total = positive.sum()
    return positive / total if total > 0 else np.zeros_like(positive)


def fomo_update(own: Sequence[np.ndarray], candidates: Sequence[Sequence[np.ndarray]], weights: np.ndarray) -> NDArrays:
    """The federated update: ``theta_i + sum_n w_n (theta_n - theta_i)``, array by array, in
    float64 and cast back to each array's dtype; over every floating-point entry of the state
    (BatchNorm's running statistics too, as the authors' code updates every ``state_dict``
    entry). Integer entries (BatchNorm's step counter) keep the client's own value."""
    weights = np.asarray(weights, dtype=np.float64)
    if weights.shape != (len(candidates),):
        raise ValueError(f"need one weight per candidate: {len(candidates)} candidates, weights of shape {weights.shape}")
    out: NDArrays = []
    for i, mine in enumerate(own):
        mine = np.asarray(mine)
        if not np.issubdtype(mine.dtype, np.floating):
            out.append(mine.copy())
            continue
        base = mine.astype(np.float64)
        step = np.zeros_like(base)
        for w, model in zip(weights, candidates):
            if w != 0.0:
                step += w * (np.asarray(model[i], dtype=np.float64) - base)
        out.append((base + step).astype(mine.dtype))
    return out


def update_affinity(affinity: np.ndarray, client: int, candidates: Sequence[int], raw: np.ndarray) -> None:
    """The affinity update: add client ``client``'s raw weights (before clipping and normalisation,
    negatives included) into its row of ``affinity``, in place: ``P[i, c_n] += w_n``. FL-bench
    and PFLlib add the raw weights; the authors' code adds them divided by ``|sum_n w_n|``."""
    raw = np.asarray(raw, dtype=np.float64)
    if raw.shape != (len(candidates),):
        raise ValueError(f"need one weight per candidate: {len(candidates)} candidates, weights of shape {raw.shape}")
    for c, w in zip(candidates, raw):
        affinity[client, int(c)] += w
