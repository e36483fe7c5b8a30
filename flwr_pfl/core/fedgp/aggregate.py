"""The aggregation rule: FedDA's convex combination (Definition 4.1) and FedGP's gradient
projection (Definition 4.3, whole-model or per-layer as in App. C.9), over the sources with
their weights and betas (:func:`fda_aggregate`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flwr_pfl.core.aggregation import weighted_average
from flwr_pfl.core.fedgp.config import FDAConfig
from flwr_pfl.core.fedgp.options import Granularity, Projection, Rule, TensorRole
from flwr_pfl.core.fedgp.projection import _pair_terms
from flwr_pfl.core.fedgp.tensors import (
    NDArrays,
    _check_finite,
    _check_layout,
    _check_roles,
    tensor_roles,
)
from flwr_pfl.core.fedgp.weights import _positive_vector


@dataclass(frozen=True)
class FDAAggregate:
    """Result of :func:`fda_aggregate`.

    Attributes:
        update: the increment to the global model, one array per tensor (shapes and dtypes of
            the target update); add it with :func:`apply_update`.
        coefficients: c_{i,l} with P_i^l = c_{i,l} Delta_i^l, shape (N, L_agg) over the
            ``aggregate`` tensors (FedDA: 1 or a_i).
        cosines: cos(Delta_T^l, Delta_i^l) per source and aggregated tensor, (N, L_agg)
            (whole-model cosine repeated for ``whole_model``).
        kept: whether the filter let source i through on tensor l, (N, L_agg).
        filtered_frac: per source, fraction of aggregated tensors filtered out, (N,).
        mean_cos: per source, mean cosine over aggregated tensors, (N,).
        betas: the beta_i used, (N,).
    """

    update: NDArrays
    coefficients: np.ndarray
    cosines: np.ndarray
    kept: np.ndarray
    filtered_frac: np.ndarray
    mean_cos: np.ndarray
    betas: np.ndarray


def _check_betas(betas: Any, n: int) -> np.ndarray:
    b = np.atleast_1d(np.asarray(betas, dtype=np.float64))
    if b.ndim != 1 or b.size not in (1, n):
        raise ValueError(f"betas must be a scalar or one value per source ({n}); got shape {np.shape(betas)}")
    if not np.all((b >= 0.0) & (b <= 1.0)):
        raise ValueError(f"every beta must lie in [0, 1] (0 = target only, 1 = source side only); got {b.tolist()}")
    return b if b.size == n else np.full(n, b[0])


def _check_weights(weights: Any, n: int) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,):
        raise ValueError(f"weights must have one value per source ({n}); got shape {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or not math.isclose(float(w.sum()), 1.0, rel_tol=0, abs_tol=1e-9):
        raise ValueError(f"weights must be >= 0 and sum to 1 (see source_weights()); got {w.tolist()}")
    return w


def fda_aggregate(
    target_delta: Sequence[np.ndarray],
    source_deltas: Sequence[Sequence[np.ndarray]],
    *,
    betas: Sequence[float] | float,
    weights: Sequence[float],
    config: FDAConfig,
    align: Sequence[float] | None = None,
    roles: Sequence[TensorRole | str] | None = None,
) -> FDAAggregate:
    """One FDA aggregation step: the increment to the global model (Algorithm 1, step 5).

    For every ``aggregate`` tensor l (Definitions 4.1 / 4.3, App. C.9):

        update^l = sum_i w_i [ (1 - beta_i) Delta_T^l + beta_i P_i^l ]

    with P_i = Delta_i for FedDA (Definition 4.1; times a_i if ``align_fedda``), and for FedGP
    the filtered projection ``exact`` (Definition 4.3) or ``cosine_scaled`` (App. C.9), computed
    per tensor or on the whole aggregated vector (``granularity``). The target term is added for
    every source, filtered or not (the code's auto-beta form; with one fixed beta it equals
    (1 - beta) Delta_T + beta sum_i w_i P_i since sum_i w_i = 1). ``fedavg`` tensors get
    sum_i w_i Delta_i, ``keep`` tensors a zero update.

    Defined behaviour for zero updates: a zero source tensor contributes nothing to FedGP (its
    cosine is 0, its projection undefined and taken as 0); a zero target tensor makes FedGP's
    component 0 (nothing to project). FedDA is linear and needs no special case.

    Args:
        target_delta: Delta_T, L arrays (:func:`model_delta` of the target's model).
        source_deltas: N lists of L arrays, same shapes.
        betas: beta_i in [0, 1] (scalar or (N,)).
        weights: w_i >= 0 summing to 1 (:func:`source_weights`).
        config: rule, projection, filter, granularity, align_fedda, cosine_eps.
        align: a_i > 0 (N,) from :func:`alignment_factors`; required for ``cosine_scaled``
            FedGP and for ``align_fedda``, ignored otherwise.
        roles: one :class:`TensorRole` per tensor; default: ``aggregate`` for floating tensors
            with ndim >= 1, ``config.scalar_role`` for the rest (pass :func:`tensor_roles` when
            the model has buffers).

    Returns:
        :class:`FDAAggregate`.

    Raises:
        ValueError: no sources, mismatched tensor lists or shapes, NaN/Inf, beta outside
            [0, 1], weights not summing to 1, or a missing/invalid ``align``.
    """
    n = len(source_deltas)
    if n == 0:
        raise ValueError("need at least one source update")
    t_list = [np.asarray(x) for x in target_delta]
    s_lists = [[np.asarray(x) for x in sd] for sd in source_deltas]
    for k, t in enumerate(t_list):
        _check_finite(t, f"target_delta[{k}]")
    for i, sd in enumerate(s_lists):
        _check_layout(t_list, sd, "target_delta", f"source_deltas[{i}]")
        for k, s in enumerate(sd):
            _check_finite(s, f"source_deltas[{i}][{k}]")
    b = _check_betas(betas, n)
    w = _check_weights(weights, n)
    role = _check_roles(roles, t_list) if roles is not None else tensor_roles(t_list, config)
    needs_align = (config.rule is Rule.FEDGP and config.projection is Projection.COSINE_SCALED) or (
        config.rule is Rule.FEDDA and config.align_fedda
    )
    if needs_align and align is None:
        raise ValueError(
            "align (one factor a_i per source, see alignment_factors()) is required for "
            f"rule={config.rule.value!r} with projection={config.projection.value!r}, "
            f"align_fedda={config.align_fedda}"
        )
    a = _positive_vector(align, "align", n) if align is not None else None

    agg = [k for k, r in enumerate(role) if r is TensorRole.AGGREGATE]
    t64 = [t_list[k].astype(np.float64).ravel() for k in agg]
    s64 = [[sd[k].astype(np.float64).ravel() for k in agg] for sd in s_lists]
    nt2 = np.array([t @ t for t in t64])
    dot = np.array([[t @ s for t, s in zip(t64, row)] for row in s64]).reshape(n, len(agg))
    ns2 = np.array([[s @ s for s in row] for row in s64]).reshape(n, len(agg))
    if config.granularity is Granularity.WHOLE_MODEL and agg:
        whole = _pair_terms(dot.sum(1, keepdims=True), nt2.sum(keepdims=True), ns2.sum(1, keepdims=True), config, a)
        coef, cos, kept = (np.repeat(x, len(agg), axis=1) for x in whole)
    else:
        coef, cos, kept = _pair_terms(dot, nt2, ns2, config, a)

    target_w = float(np.sum(w * (1.0 - b)))
    source_w = (w * b)[:, None] * coef  # (N, L_agg)
    update: NDArrays = [np.zeros(t.shape, dtype=t.dtype) for t in t_list]
    for j, k in enumerate(agg):
        acc = target_w * t64[j]
        for i in range(n):
            if source_w[i, j] != 0.0:
                acc = acc + source_w[i, j] * s64[i][j]
        update[k] = acc.reshape(t_list[k].shape).astype(t_list[k].dtype)
    avg = [k for k, r in enumerate(role) if r is TensorRole.FEDAVG]
    if avg:
        averaged = weighted_average([[sd[k] for k in avg] for sd in s_lists], w)
        for k, v in zip(avg, averaged):
            update[k] = v

    filtered = 1.0 - kept.mean(axis=1) if agg else np.zeros(n)
    mean_cos = cos.mean(axis=1) if agg else np.zeros(n)
    return FDAAggregate(update, coef, cos, kept, filtered, mean_cos, b)
