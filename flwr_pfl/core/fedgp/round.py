"""One FDA round from what the clients send, under either placement: source weights, alignment,
auto-weight statistics, betas and the aggregation, applied to the global model
(:func:`fda_round`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flwr_pfl.core.fedgp.aggregate import FDAAggregate, fda_aggregate
from flwr_pfl.core.fedgp.auto_weight import round_betas
from flwr_pfl.core.fedgp.config import FDAConfig
from flwr_pfl.core.fedgp.estimators import (
    FDAStats,
    estimate_fda_stats,
    estimate_fedda_stats_from_summary,
    estimator_inputs,
    estimator_scales,
)
from flwr_pfl.core.fedgp.options import TensorRole
from flwr_pfl.core.fedgp.tensors import (
    NDArrays,
    _check_roles,
    apply_update,
    flatten_update,
    tensor_roles,
)
from flwr_pfl.core.fedgp.weights import alignment_factors, source_weights


@dataclass(frozen=True)
class SourceUpdate:
    """What source i contributes to an FDA round.

    Attributes:
        delta: Delta_i = h_i - h_global, L arrays (:func:`model_delta`).
        num_examples: n_i (weights the sources, :func:`source_weights`).
        lr: the learning rate it trained with, lr_S,i.
        steps: its optimizer steps this round, K_i >= 1.
    """

    delta: NDArrays
    num_examples: float
    lr: float
    steps: int


@dataclass(frozen=True)
class TargetUpdate:
    """What the target contributes to an FDA round.

    Attributes:
        delta: Delta_T, L arrays.
        lr: lr_T used this round.
        steps: B, its optimizer steps.
        step_matrix: auto mode: its per-step updates G, B' x m (:func:`prepare_step_updates`).
        step_var: auto FedDA with the one-float upload: S_T of App. A.5 instead of G.
        step_rows: B', the rows S_T was computed from (with ``step_var``).
    """

    delta: NDArrays
    lr: float
    steps: int
    step_matrix: np.ndarray | None = None
    step_var: float | None = None
    step_rows: int = 0


@dataclass(frozen=True)
class FDARound:
    """Result of :func:`fda_round`.

    Attributes:
        new_global: h_global^(r), L arrays in the global model's dtypes.
        aggregate: the per-tensor details (:class:`FDAAggregate`; betas, cosines, filters).
        stats: the auto-weighting statistics, or None (fixed beta, or fewer than 2 target steps).
        align: a_i (N,), :func:`alignment_factors`.
        target_update_norm: ||Delta_T|| over the aggregated tensors.
        notes: warnings raised while choosing the betas (e.g. the fallback to the fixed beta).
    """

    new_global: NDArrays
    aggregate: FDAAggregate
    stats: FDAStats | None
    align: np.ndarray
    target_update_norm: float
    notes: tuple[str, ...] = ()

    def metrics(self, labels: Sequence[str]) -> dict[str, float]:
        """Scalars for the round's record: means, and per source ``beta_<label>``,
        ``filtered_frac_<label>``, ``mean_cos_<label>``, ``align_<label>``, ``d2_<label>``,
        ``tau2d2_<label>`` (auto), plus ``sigma2`` (auto)."""
        agg = self.aggregate
        if len(labels) != agg.betas.size:
            raise ValueError(f"need one label per source ({agg.betas.size}); got {len(labels)}")
        out = {
            "beta_mean": float(np.mean(agg.betas)),
            "filtered_frac_mean": float(np.mean(agg.filtered_frac)),
            "mean_cos_mean": float(np.mean(agg.mean_cos)),
            "update_norm_target": self.target_update_norm,
        }
        for i, label in enumerate(labels):
            out[f"beta_{label}"] = float(agg.betas[i])
            out[f"filtered_frac_{label}"] = float(agg.filtered_frac[i])
            out[f"mean_cos_{label}"] = float(agg.mean_cos[i])
            out[f"align_{label}"] = float(self.align[i])
        if self.stats is not None:
            out["sigma2"] = float(self.stats.target_var)
            for i, label in enumerate(labels):
                out[f"d2_{label}"] = float(self.stats.d2[i])
                if self.stats.tau2d2 is not None:
                    out[f"tau2d2_{label}"] = float(self.stats.tau2d2[i])
        return out


def _round_stats(
    target: TargetUpdate, sources: Sequence[SourceUpdate], source_flat: np.ndarray, roles: Sequence[TensorRole], config: FDAConfig
) -> FDAStats | None:
    """The App. A.5 statistics from the target's step matrix or its one-float summary; None
    when fewer than 2 rows are available (the caller then falls back to the fixed beta)."""
    lr_s = [s.lr for s in sources]
    k_s = [s.steps for s in sources]
    if target.step_matrix is not None:
        if target.step_matrix.shape[0] < 2:
            return None
        g_in, s_in = estimator_inputs(
            target.step_matrix, source_flat, source_steps=k_s, lr_target=target.lr, lr_sources=lr_s,
            alignment=config.estimator_alignment,
        )
        return estimate_fda_stats(g_in, s_in)
    if target.step_var is None or target.step_rows < 2 or not np.isfinite(target.step_var) or target.step_var < 0:
        return None
    c_t, c_s = estimator_scales(config.estimator_alignment, lr_target=target.lr, lr_sources=lr_s, num_sources=len(sources))
    gbar = flatten_update(target.delta, roles) / target.steps * c_t
    s_in = source_flat * (c_s / np.asarray(k_s, dtype=np.float64))[:, None]
    return estimate_fedda_stats_from_summary(gbar, target.step_var * c_t**2, target.step_rows, s_in)


def fda_round(
    global_arrays: Sequence[np.ndarray],
    target: TargetUpdate,
    sources: Sequence[SourceUpdate],
    config: FDAConfig,
    roles: Sequence[TensorRole | str] | None = None,
) -> FDARound:
    """One FDA round (Algorithm 1, steps 3-5), from the clients' updates to the new global model.

    Weights w_i (:func:`source_weights`), alignment a_i (:func:`alignment_factors`), beta_i
    (fixed, or Eq. 3 from the App. A.5 statistics when ``config.auto_weight``; with fewer than
    2 target steps the fixed beta, noted in ``notes``) and :func:`fda_aggregate`. The server
    runs this under the ``server`` placement and the target under the ``target`` placement, so
    both compute the same model from the same inputs.

    Args:
        global_arrays: h_global^(r-1), L arrays.
        target: the target's update (:class:`TargetUpdate`).
        sources: N >= 1 source updates (:class:`SourceUpdate`).
        config: the options.
        roles: one :class:`TensorRole` per tensor (default :func:`tensor_roles` without buffers).

    Raises:
        ValueError: no sources, mismatched shapes, NaN/Inf, non-positive lr or steps.
    """
    if not sources:
        raise ValueError("need at least one source update")
    role = _check_roles(roles, global_arrays) if roles is not None else tensor_roles(global_arrays, config)
    w = source_weights([s.num_examples for s in sources], config.source_weighting)
    align = alignment_factors(
        lr_target=target.lr, steps_target=target.steps,
        lr_sources=[s.lr for s in sources], steps_sources=[s.steps for s in sources],
    )
    stats = None
    if config.auto_weight:
        source_flat = np.stack([flatten_update(s.delta, role) for s in sources])
        stats = _round_stats(target, sources, source_flat, role, config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        betas = round_betas(config, len(sources), stats)
    agg = fda_aggregate(target.delta, [s.delta for s in sources], betas=betas, weights=w, config=config, align=align, roles=role)
    return FDARound(
        new_global=apply_update(global_arrays, agg.update),
        aggregate=agg,
        stats=stats,
        align=np.asarray(align, dtype=np.float64),
        target_update_norm=float(np.linalg.norm(flatten_update(target.delta, role))),
        notes=tuple(str(c.message) for c in caught),
    )
