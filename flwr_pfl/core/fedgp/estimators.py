"""Server side: the auto-weighting statistics of App. A.5 (sigma^2, d_i^2, tau^2 d_i^2).

:func:`estimator_inputs` puts the target's step updates and the sources' mean per-step updates in
common units (App. C.4); :func:`estimate_fda_stats` computes the unbiased estimators, and
:func:`estimate_fedda_stats_from_summary` FedDA's from the one scalar the target may send instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flwr_pfl.core.fedgp.options import EstimatorAlignment, _coerce_enum
from flwr_pfl.core.fedgp.step_updates import _as_matrix, _row_sq_norms, summarize_step_updates
from flwr_pfl.core.fedgp.weights import _positive_vector


def estimator_scales(
    alignment: EstimatorAlignment | str, *, lr_target: float, lr_sources: Sequence[float] | float, num_sources: int
) -> tuple[float, np.ndarray]:
    """Factors (c_T, c_S,i) applied to the target step updates and to the sources' mean per-step
    updates before estimation (App. C.4); see :class:`EstimatorAlignment`.

    Raises:
        ValueError: non-positive learning rates, or ``reference_domainbed`` with differing lr_S.
    """
    a = _coerce_enum(EstimatorAlignment, alignment, "alignment")
    lr_s = _positive_vector(lr_sources, "lr_sources", num_sources)
    lr_t = _positive_vector(lr_target, "lr_target", 1)[0]
    if a is EstimatorAlignment.LR_RATIO_ON_SOURCE:
        return 1.0, lr_t / lr_s
    if a is EstimatorAlignment.REFERENCE_DOMAINBED:
        if not np.allclose(lr_s, lr_s[0], rtol=1e-12, atol=0.0):
            raise ValueError(
                "estimator_alignment 'reference_domainbed' uses one lr ratio and needs equal source "
                f"learning rates; got {lr_s.tolist()}"
            )
        return float(lr_t / lr_s[0]), np.ones(num_sources)
    return 1.0, np.ones(num_sources)


def estimator_inputs(
    step_updates: np.ndarray,
    source_deltas: np.ndarray,
    *,
    source_steps: Sequence[int],
    lr_target: float,
    lr_sources: Sequence[float] | float,
    alignment: EstimatorAlignment | str = EstimatorAlignment.LR_RATIO_ON_SOURCE,
) -> tuple[np.ndarray, np.ndarray]:
    """Estimator inputs (G, S) in common units from what the clients send.

    The sources' mean per-step update is s_i = Delta_i / K_i (C.4: "one model update per source
    client ... divided by the number of batches"; telescoping makes it the mean of the per-step
    deltas), then both sides are scaled by :func:`estimator_scales`.

    Args:
        step_updates: the target's G, B x m.
        source_deltas: flattened round updates Delta_i, N x m.
        source_steps: K_i >= 1 (N,).
        lr_target, lr_sources: learning rates used this round.
        alignment: default ``lr_ratio_on_source``.

    Returns:
        (G * c_T, S) with S = N x m, float64.
    """
    g = _as_matrix(step_updates, "step_updates")
    d = _as_matrix(source_deltas, "source_deltas")
    if d.shape[1] != g.shape[1]:
        raise ValueError(f"source_deltas have m = {d.shape[1]} columns but step_updates have m = {g.shape[1]}")
    k = _positive_vector(source_steps, "source_steps", d.shape[0])
    c_t, c_s = estimator_scales(alignment, lr_target=lr_target, lr_sources=lr_sources, num_sources=d.shape[0])
    return (g if c_t == 1.0 else g * c_t), d * (c_s / k)[:, None]


@dataclass(frozen=True)
class FDAStats:
    """Auto-weighting statistics of one round (App. A.5; code names in brackets). All "per
    coordinate" quantities are divided by m, which cancels in every beta.

    Attributes:
        num_steps: B.
        dim: m.
        sample_target_var: S_T [``sample_target_var``].
        target_var: sigma^2-hat = S_T / B [``target_var``].
        d2: d_i^2-hat clipped at 0 [``source_target_var``], shape (N,).
        d2_unclipped: the unbiased Eq. (24) estimate, may be negative, (N,).
        tau2d2: (tau^2 d^2)_i-hat clipped at 0 [``projected_grads_norm_square``], (N,), or None
            when computed from a summary.
        tau2d2_unclipped: its unbiased estimate of Eq. (25), (N,) or None.
        delta: delta_i-hat = 1 - (1 - q_i) / B, q_i the fraction of steps with <g^j, s_i> > 0
            [``deltas``] (a heuristic of the code), (N,) or None.
        target_norm2: ||g_bar||^2 / m [``target_norm_square``] (plug-in, biased up by sigma^2).
    """

    num_steps: int
    dim: int
    sample_target_var: float
    target_var: float
    d2: np.ndarray
    d2_unclipped: np.ndarray
    tau2d2: np.ndarray | None
    tau2d2_unclipped: np.ndarray | None
    delta: np.ndarray | None
    target_norm2: float


def estimate_fda_stats(
    step_updates: np.ndarray, source_updates: np.ndarray, target_mean: np.ndarray | None = None
) -> FDAStats:
    """Unbiased estimators of sigma^2, d_i^2 and tau^2 d_i^2 (App. A.5).

    With G the target's B per-step updates (rows g^j), g_bar their mean (or ``target_mean``),
    s_i source i's mean per-step update and u_i = s_i / ||s_i||:

    * S_T = sum_j ||g^j - g_bar||^2 / ((B-1) m); sigma^2 = S_T / B.
    * d_i^2 = max(sum_j ||g^j - s_i||^2 / (B m) - S_T, 0)                    (Eq. 24)
    * p^j = g^j - <g^j,u_i> u_i, p_bar = g_bar - <g_bar,u_i> u_i;
      tau^2 d_i^2 = max(mean_j ||p^j||^2 / m - sum_j ||p^j - p_bar||^2 / ((B-1) m), 0), the
      mean of ||p^j||^2 minus their unbiased sample variance (Eq. 25; the printed A.5 display is
      garbled, this is its derivation and the code).
    * delta_i = 1 - (1 - q_i) / B, q_i = fraction of j with <g^j, s_i> > 0 (code heuristic).

    Clipping at 0 keeps beta in [0, 1] (the paper's estimators are unbiased and can be
    negative; both versions are returned). A zero source update (s_i = 0) has no direction:
    u_i = 0 is used, so nothing is projected out (tau^2 d^2 = estimate of ||g_T||^2) and
    q_i = 0.

    Args:
        step_updates: G, B x m, B >= 2.
        source_updates: S, N x m (already aligned, see :func:`estimator_inputs`).
        target_mean: optional centre g_bar (m,) (App. B uses the full-data target gradient).

    Returns:
        :class:`FDAStats`.

    Raises:
        ValueError: B < 2, non-finite values, or mismatched m.
    """
    summary = summarize_step_updates(step_updates, target_mean)
    g = _as_matrix(step_updates, "step_updates", min_rows=2)
    s_all = _as_matrix(source_updates, "source_updates")
    b, m = g.shape
    if s_all.shape[1] != m:
        raise ValueError(f"source_updates have m = {s_all.shape[1]} columns but step_updates have m = {m}")
    gbar, s_t = summary.mean, summary.sample_target_var
    n = s_all.shape[0]
    d2u, t2u, delta = np.empty(n), np.empty(n), np.empty(n)
    for i, s in enumerate(s_all):
        d2u[i] = _row_sq_norms(g, s).mean() / m - s_t
        norm = float(np.linalg.norm(s))
        u = s / norm if norm > 0 else np.zeros(m)
        a = g @ u
        a_bar = float(gbar @ u)
        mean_p2 = _row_sq_norms(g, None, u, a).mean() / m
        var_p = _row_sq_norms(g, gbar, u, a - a_bar).sum() / ((b - 1) * m)
        t2u[i] = mean_p2 - var_p
        delta[i] = 1.0 - (1.0 - float(np.mean(g @ s > 0))) / b
    return FDAStats(
        num_steps=b,
        dim=m,
        sample_target_var=s_t,
        target_var=summary.target_var,
        d2=np.maximum(d2u, 0.0),
        d2_unclipped=d2u,
        tau2d2=np.maximum(t2u, 0.0),
        tau2d2_unclipped=t2u,
        delta=delta,
        target_norm2=float(gbar @ gbar) / m,
    )


def estimate_fedda_stats_from_summary(
    target_mean: np.ndarray, sample_target_var: float, num_steps: int, source_updates: np.ndarray
) -> FDAStats:
    """FedDA's auto-weight statistics from the target's summary instead of its B x m matrix.

    When g_bar is the mean of the step updates, sum_j ||g^j - s||^2 = sum_j ||g^j - g_bar||^2
    + B ||g_bar - s||^2, so Eq. (24)'s estimate is exactly
    d_i^2 = ||g_bar - s_i||^2 / m - S_T / B. With g_bar = Delta_T / B (telescoping; the server
    has Delta_T) the target needs to send only S_T (from :func:`summarize_step_updates`) and B,
    not B x m floats. FedGP's tau^2 d^2 needs the spread of G along each source direction and
    cannot be computed this way (its fields are None).

    Args:
        target_mean: g_bar (m,), in the estimator's units (e.g. flattened Delta_T / B, times the
            target scale of :func:`estimator_scales`).
        sample_target_var: S_T, in the same units (times the target scale squared).
        num_steps: B >= 2.
        source_updates: S, N x m.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < 2:
        raise ValueError(f"num_steps must be an integer >= 2 (a variance needs two steps); got {num_steps!r}")
    s_t = float(sample_target_var)
    if not (0.0 <= s_t < math.inf):
        raise ValueError(f"sample_target_var must be finite and >= 0; got {sample_target_var!r}")
    gbar = _as_matrix(np.asarray(target_mean, dtype=np.float64)[None, :], "target_mean")[0]
    s_all = _as_matrix(source_updates, "source_updates")
    m = gbar.size
    if s_all.shape[1] != m:
        raise ValueError(f"source_updates have m = {s_all.shape[1]} columns but target_mean has m = {m}")
    sigma2 = s_t / num_steps
    d2u = _row_sq_norms(s_all, gbar) / m - sigma2
    return FDAStats(
        num_steps=int(num_steps),
        dim=m,
        sample_target_var=s_t,
        target_var=sigma2,
        d2=np.maximum(d2u, 0.0),
        d2_unclipped=d2u,
        tau2d2=None,
        tau2d2_unclipped=None,
        delta=None,
        target_norm2=float(gbar @ gbar) / m,
    )
