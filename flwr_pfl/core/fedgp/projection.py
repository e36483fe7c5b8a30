"""Projection primitives: the target update projected on the positive direction of a source update
(Definition 4.3, :func:`proj_pos`), the cosine similarity, and the per-layer cosine-scaled
component of App. C.9 and the official code.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from flwr_pfl.core.fedgp.config import FDAConfig
from flwr_pfl.core.fedgp.options import Projection, Rule
from flwr_pfl.core.fedgp.weights import _positive_vector


def _pair_terms(
    dot: np.ndarray, nt2: np.ndarray, ns2: np.ndarray, config: FDAConfig, align: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Coefficient c with P = c * Delta_S, the cosine, and the filter mask, from inner products.

    Shapes broadcast: dot, ns2 (N, L); nt2 (L,); align (N,) or None. The one place where both
    FedGP forms (and FedDA) are defined, shared by the primitives and :func:`fda_aggregate`.
    """
    eps = config.cosine_eps
    nt, ns = np.sqrt(nt2), np.sqrt(ns2)
    cos = dot / (np.maximum(nt, eps) * np.maximum(ns, eps)) if eps > 0 else np.divide(
        dot, nt * ns, out=np.zeros(np.broadcast_shapes(np.shape(dot), np.shape(nt * ns))), where=(nt * ns) > 0
    )
    a = np.ones(dot.shape[0]) if align is None else align
    if config.rule is Rule.FEDDA:
        coef = np.broadcast_to((a if config.align_fedda else np.ones_like(a))[:, None], dot.shape).copy()
        return coef, cos, np.ones(dot.shape, dtype=bool)
    if config.projection is Projection.EXACT:
        coef = np.divide(dot, ns2, out=np.zeros(dot.shape), where=ns2 > 0)
        kept = (dot > 0) & (ns2 > 0)
    else:
        coef = a[:, None] * cos
        kept = cos > 0
    if config.filter_negative:
        coef = np.where(kept, coef, 0.0)
    else:
        kept = np.ones(dot.shape, dtype=bool)
    return coef, cos, kept


def _pair_on_vectors(
    a: Any, b: Any, names: tuple[str, str], projection: Projection, filter_negative: bool, eps: float,
    align: np.ndarray | None = None,
) -> tuple[float, float, np.ndarray]:
    """:func:`_pair_terms` for one pair of arrays: (coefficient c, cosine, b as float64)."""
    x, y = _as_vector_pair(a, b, *names)
    xf, yf = x.ravel(), y.ravel()
    cfg = FDAConfig(rule=Rule.FEDGP, projection=projection, filter_negative=filter_negative, cosine_eps=eps)
    coef, cos, _ = _pair_terms(np.array([[xf @ yf]]), np.array([xf @ xf]), np.array([[yf @ yf]]), cfg, align)
    return float(coef[0, 0]), float(cos[0, 0]), y


def _as_vector_pair(a: Any, b: Any, name_a: str, name_b: str) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"{name_a} has shape {x.shape} but {name_b} has shape {y.shape}; they must match")
    for v, name in ((x, name_a), (y, name_b)):
        if not np.all(np.isfinite(v)):
            raise ValueError(f"{name} contains NaN or Inf")
    return x, y


def cosine_similarity(a: np.ndarray, b: np.ndarray, eps: float = 1e-8) -> float:
    """<a, b> / (max(||a||, eps) max(||b||, eps)) on the flattened arrays, as
    ``torch.nn.CosineSimilarity(dim=0, eps)`` (the official code's per-layer cosine). A zero
    array gives 0; ``eps = 0`` gives the exact cosine (0 for a zero array)."""
    if not (0.0 <= eps < math.inf):
        raise ValueError(f"eps must be finite and >= 0; got {eps}")
    return _pair_on_vectors(a, b, ("a", "b"), Projection.EXACT, True, eps)[1]


def proj_pos(g_target: np.ndarray, g_source: np.ndarray, filter_negative: bool = True) -> np.ndarray:
    """Proj_+(g_T | g_S) = max(<g_T, g_S>, 0) / ||g_S||^2 * g_S (Definition 4.3).

    The projection of the target update onto the positive direction of the source update: its
    magnitude comes from the target, it is invariant to rescaling g_S by any c > 0, and the
    residual g_T - Proj is orthogonal to g_S when <g_T, g_S> > 0. ``filter_negative=False``
    drops the max (the "w proj" ablation). A zero g_S has no direction: the result is 0.

    Args:
        g_target, g_source: arrays of one shape (any).

    Returns:
        Array of that shape (float64).
    """
    names = ("g_target", "g_source")
    coef, _, s = _pair_on_vectors(g_target, g_source, names, Projection.EXACT, filter_negative, 1e-8)
    return coef * s


def cosine_scaled_component(
    delta_target: np.ndarray, delta_source: np.ndarray, align: float, filter_negative: bool = True, eps: float = 1e-8
) -> np.ndarray:
    """FedGP's per-layer source component of App. C.9 / the official code:
    1[c > 0] * c * a * Delta_S with c = cos(Delta_T, Delta_S) (see :func:`cosine_similarity`).

    Equals :func:`proj_pos` exactly when a ||Delta_S|| = ||Delta_T||.

    Args:
        delta_target, delta_source: arrays of one shape.
        align: a > 0 from :func:`alignment_factors`.
    """
    a = _positive_vector(align, "align", 1)
    names = ("delta_target", "delta_source")
    coef, _, s = _pair_on_vectors(
        delta_target, delta_source, names, Projection.COSINE_SCALED, filter_negative, eps, a
    )
    return coef * s
