"""Server side, once: the graph ``W``, the transition ``P = D^-1 W`` and the propagation matrix
``M = (1 - kappa)(I - kappa P)^-1`` (Eq. 4 and Eq. 6; Algorithm 1 line 5).

:func:`build_propagation_graph` goes from the subspaces to a :class:`PropagationGraph`;
:func:`propagation_graph_from_similarity` from any similarity matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flwr_pfl.core.fedora.options import GraphOptions, PropagationOptions, alpha_from_kappa
from flwr_pfl.core.fedora.similarity import subspace_similarity


def _keep_mask(
    s: np.ndarray, candidates: np.ndarray, top_k: int | None
) -> np.ndarray:
    """For each row, mark the ``top_k`` largest candidate entries (all candidates if None).

    Ties are broken towards the lower column index (stable sort), which makes the graph
    reproducible; the official code's ``torch.topk`` leaves ties unspecified.
    """
    if top_k is None:
        return candidates.copy()
    order = np.argsort(np.where(candidates, -s, np.inf), axis=1, kind="stable")
    keep = np.zeros_like(candidates)
    rows = np.arange(s.shape[0])[:, None]
    keep[rows, order[:, :top_k]] = True
    return keep & candidates


def _graph_rows(
    s: np.ndarray, keep: np.ndarray, options: GraphOptions
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weights and row-normalised transition rows from similarities and a keep mask.

    Shared by the ``K x K`` graph and by a new client's single row (Algorithm 2).

    * identity: ``W = S * keep``, ``P = D^-1 W``;
    * exp: ``W = exp(tau (S - s_max)) * keep`` with ``s_max`` the largest kept similarity: this
      is the code's ``exp(tau S)`` up to the global factor ``exp(-tau s_max)``, which ``D^-1``
      cancels, so ``W <= 1`` never overflows. ``P`` is a per-row stable softmax over the kept
      entries, so no row underflows to zero.

    Returns:
        ``(W, P, isolated)``: ``(r, K)`` weights, ``(r, K)`` rows summing to 1 where not isolated
        (zero rows elsewhere), and the ``(r,)`` mask of rows with zero total weight.
    """
    if options.transform == "identity":
        w = np.where(keep, s, 0.0)
        total = w.sum(axis=1)
        isolated = total <= 0.0
        p = np.divide(w, total[:, None], out=np.zeros_like(w), where=~isolated[:, None])
        return w, p, isolated
    tau = options.temperature
    s_max = np.max(s[keep]) if keep.any() else 0.0
    w = np.where(keep, np.exp(tau * (np.where(keep, s, s_max) - s_max)), 0.0)
    row_max = np.max(np.where(keep, s, -np.inf), axis=1)
    isolated = ~keep.any(axis=1)
    row_max[isolated] = 0.0
    e = np.where(keep, np.exp(tau * (np.where(keep, s, 0.0) - row_max[:, None])), 0.0)
    total = e.sum(axis=1)
    p = np.divide(e, total[:, None], out=np.zeros_like(e), where=~isolated[:, None])
    return w, p, isolated


def similarity_graph(
    similarity: np.ndarray,
    options: GraphOptions = GraphOptions(),
    present: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Graph ``W`` and row-stochastic ``P = D^-1 W`` from similarities (Eq. 4; spec 3.2).

    Paper: ``W = S`` dense with self-loops. Official code: ``W = exp(10 S)``, zero diagonal, each
    row keeps its 2 largest entries (so ``W`` is in general not symmetric), ``P = D^-1 W``.

    Hazards handled: missing clients (``present[k] = False``) are never anyone's neighbour (with
    the ``exp`` transform an absent edge would otherwise weigh ``exp(0) = 1``); a row with no
    weight at all (a missing client, ``K = 1``, or an all-zero row under the identity transform)
    is *isolated* and gets ``P_kk = 1``, so ``theta_hat_k = theta_k`` (no propagation).

    Args:
        similarity: ``(K, K)`` finite; non-negative under the identity transform.
        options: see :class:`GraphOptions`.
        present: ``(K,)`` bool, default all True.

    Returns:
        ``(W, P)``, both ``(K, K)`` float64; rows of ``P`` sum to 1 and are non-negative.
    """
    s = np.asarray(similarity, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] != s.shape[1] or s.shape[0] < 1:
        raise ValueError(f"similarity must be a square (K, K) array, got shape {s.shape}")
    if not np.all(np.isfinite(s)):
        raise ValueError("similarity contains NaN or Inf")
    if options.transform == "identity" and np.any(s < 0):
        raise ValueError("the identity transform needs non-negative similarities (graph weights "
                         "must be >= 0); use transform='exp' or clip the similarity at 0")
    k_total = s.shape[0]
    mask = np.ones(k_total, dtype=bool) if present is None else np.asarray(present, dtype=bool)
    if mask.shape != (k_total,):
        raise ValueError(f"present must have shape ({k_total},), got {mask.shape}")
    eye = np.eye(k_total, dtype=bool)
    candidates = np.outer(mask, mask) & ~eye
    keep = _keep_mask(s, candidates, options.top_k)
    if options.self_loops:
        keep |= eye & mask[:, None]
    w, p, isolated = _graph_rows(s, keep, options)
    lonely = np.flatnonzero(isolated)
    p[lonely, lonely] = 1.0
    return w, p


def row_normalize(weights: np.ndarray) -> np.ndarray:
    """``P = D^-1 W`` for a user-supplied non-negative ``W`` (isolated rows get ``P_kk = 1``).

    The official code calls its version "symmetric normalisation" but row-normalises; so does
    this function. Returns a ``(K, K)`` float64 row-stochastic matrix.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] != w.shape[1]:
        raise ValueError(f"W must be a square (K, K) array, got shape {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("W must be finite and non-negative")
    _, p, isolated = _graph_rows(w, np.ones_like(w, dtype=bool), GraphOptions("identity", top_k=None))
    lonely = np.flatnonzero(isolated)
    p[lonely, lonely] = 1.0
    return p


def propagation_matrix(transition: np.ndarray, kappa: float) -> np.ndarray:
    """``M = (1 - kappa) (I - kappa P)^-1`` (Eq. 6), by one LU solve of a ``K x K`` system.

    ``I - kappa P`` is strictly diagonally dominant for row-stochastic ``P`` and
    ``kappa < 1``, so the solve is stable (infinity-norm condition number at most
    ``(1 + kappa) / (1 - kappa)``). Cost ``O(K^3)``, once per graph; every round then costs one
    ``K x K`` by ``K x P`` product (:func:`propagate`). Rows of ``M`` sum to 1 and are
    non-negative (``M = (1 - kappa) sum_i (kappa P)^i``), with ``M_kk >= 1 - kappa``.

    Args:
        transition: ``P``, ``(K, K)`` row-stochastic.
        kappa: in ``[0, 1)``.

    Returns:
        ``M``, ``(K, K)`` float64.
    """
    alpha_from_kappa(kappa)
    p = np.asarray(transition, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] != p.shape[1]:
        raise ValueError(f"P must be a square (K, K) array, got shape {p.shape}")
    if np.any(p < -1e-12) or np.max(np.abs(p.sum(axis=1) - 1.0)) > 1e-8:
        raise ValueError("P must be row-stochastic (non-negative rows summing to 1)")
    k_total = p.shape[0]
    eye = np.eye(k_total)
    return np.linalg.solve(eye - kappa * p, (1.0 - kappa) * eye)


@dataclass(frozen=True)
class PropagationGraph:
    """Everything the server computes once from the client subspaces (Algorithm 1 line 5).

    Attributes:
        similarity: ``S`` ``(K, K)``, ``s_kk' = sum cos zeta`` (Eq. 4).
        weights: ``W`` ``(K, K)`` after transform, top-k and self-loop rules.
        transition: ``P = D^-1 W`` ``(K, K)``, row-stochastic.
        propagation: ``M = (1 - kappa)(I - kappa P)^-1`` ``(K, K)`` (Eq. 6).
        kappa: the propagation probability used for ``M``.
        present: ``(K,)`` clients whose subspace was available.
        neighbours: for each client, the indices ``k' != k`` with ``P_kk' > 0``, by decreasing
            weight (log these; spec 10).
    """

    similarity: np.ndarray
    weights: np.ndarray
    transition: np.ndarray
    propagation: np.ndarray
    kappa: float
    present: np.ndarray
    neighbours: tuple[tuple[int, ...], ...]

    @property
    def num_clients(self) -> int:
        return int(self.transition.shape[0])

    @property
    def self_weights(self) -> np.ndarray:
        """``M_kk``, each client's weight on its own model (>= 1 - kappa)."""
        return np.diag(self.propagation).copy()


def propagation_graph_from_similarity(
    similarity: np.ndarray,
    graph: GraphOptions = GraphOptions(),
    propagation: PropagationOptions = PropagationOptions(),
    present: np.ndarray | None = None,
) -> PropagationGraph:
    """Build ``W``, ``P`` and ``M`` from any similarity matrix (subspace, cosine, random, user).

    See :func:`similarity_graph` and :func:`propagation_matrix`.
    """
    s = np.asarray(similarity, dtype=np.float64)
    mask = np.ones(s.shape[0], dtype=bool) if present is None else np.asarray(present, dtype=bool)
    w, p = similarity_graph(s, graph, mask)
    m = propagation_matrix(p, propagation.kappa)
    neighbours = []
    for k in range(p.shape[0]):
        row = p[k].copy()
        row[k] = 0.0
        nz = np.flatnonzero(row > 0)
        neighbours.append(tuple(int(j) for j in nz[np.argsort(-row[nz], kind="stable")]))
    return PropagationGraph(s, w, p, m, float(propagation.kappa), mask.copy(), tuple(neighbours))


def build_propagation_graph(
    subspaces: Sequence[np.ndarray | None],
    graph: GraphOptions = GraphOptions(),
    propagation: PropagationOptions = PropagationOptions(),
) -> PropagationGraph:
    """Server setup step: subspaces ``U_k`` -> ``S`` (Eq. 4-5) -> ``W``, ``P`` -> ``M`` (Eq. 6).

    Args:
        subspaces: ``K`` entries ``(d, p)`` or None for a missing client (see
            :func:`subspace_similarity`).
        graph, propagation: options.

    Returns:
        A :class:`PropagationGraph`.
    """
    s, present = subspace_similarity(subspaces)
    return propagation_graph_from_similarity(s, graph, propagation, present)
