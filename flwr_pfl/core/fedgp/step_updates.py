"""Target side: the per-step updates the target uploads in auto mode and the per-step variance
estimator of App. A.5.

:func:`prepare_step_updates` stacks the B per-step deltas into a B x m matrix
(:func:`stack_step_updates`), optionally averaged into fewer rows (:func:`group_step_updates`);
:func:`summarize_step_updates` gives the variance statistics. Row norms are computed in chunks of
``_CHUNK_ELEMENTS`` values to bound temporary memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flwr_pfl.core.fedgp.config import FDAConfig
from flwr_pfl.core.fedgp.options import TensorRole
from flwr_pfl.core.fedgp.tensors import _check_layout, flatten_update


#: Rows of a step-update matrix processed at once (bounds temporary memory to about
#: ``_CHUNK_ELEMENTS`` float64 values whatever B and m are).
_CHUNK_ELEMENTS = 1 << 22


def stack_step_updates(
    step_updates: Sequence[Sequence[np.ndarray]],
    roles: Sequence[TensorRole | str],
    dtype: np.dtype | type = np.float32,
) -> np.ndarray:
    """The target's B per-step updates g^j (parameters after step j minus before it), flattened
    over the ``aggregate`` tensors and stacked: the B x m matrix G of App. A.5 / C.4.

    float32 (default) halves the extra upload of Algorithm 1 (B x m floats, App. C.4).

    Raises:
        ValueError: no steps, steps with different layouts, or NaN/Inf.
    """
    if len(step_updates) == 0:
        raise ValueError("need at least one step update")
    ref = step_updates[0]
    rows = []
    for j, step in enumerate(step_updates):
        _check_layout(ref, step, "step_updates[0]", f"step_updates[{j}]")
        row = flatten_update(step, roles, dtype=np.float64)
        if not np.all(np.isfinite(row)):
            raise ValueError(f"step_updates[{j}] contains NaN or Inf; updates must be finite")
        rows.append(row.astype(dtype))
    return np.stack(rows)


def _as_matrix(x: Any, name: str, min_rows: int = 1) -> np.ndarray:
    m = np.asarray(x, dtype=np.float64)
    if m.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array (rows x m); got shape {m.shape}")
    if m.shape[0] < min_rows:
        raise ValueError(f"{name} needs at least {min_rows} rows; got {m.shape[0]}")
    if m.shape[1] == 0:
        raise ValueError(f"{name} has zero columns; m must be >= 1")
    if not np.all(np.isfinite(m)):
        raise ValueError(f"{name} contains NaN or Inf; updates must be finite")
    return m


def group_step_updates(step_updates: np.ndarray, max_rows: int) -> np.ndarray:
    """Average consecutive step updates into at most ``max_rows`` "super-batch" rows.

    A payload reduction (an extension not in the paper): with K groups of b = B/K steps each the
    rows are still i.i.d. parts of the target data (App. A.5's partition argument with K parts),
    so :func:`summarize_step_updates` still estimates the same sigma^2 without bias; only its
    own variance grows. Groups are contiguous and as equal as possible (sizes differ by at most
    one; unequal sizes make the estimate slightly approximate).

    Args:
        step_updates: B x m.
        max_rows: K >= 2.

    Returns:
        min(B, K) x m (float64); the input's rows unchanged if B <= K.
    """
    if isinstance(max_rows, bool) or not isinstance(max_rows, (int, np.integer)) or max_rows < 2:
        raise ValueError(f"max_rows must be an integer >= 2; got {max_rows!r}")
    g = _as_matrix(step_updates, "step_updates")
    if g.shape[0] <= max_rows:
        return g
    return np.stack([blk.mean(axis=0) for blk in np.array_split(g, max_rows, axis=0)])


def prepare_step_updates(
    step_updates: Sequence[Sequence[np.ndarray]],
    roles: Sequence[TensorRole | str],
    config: FDAConfig,
    dtype: np.dtype | type = np.float32,
) -> np.ndarray:
    """What the target uploads in auto mode (Algorithm 1): its per-step updates as a B' x m
    matrix, :func:`stack_step_updates` followed by :func:`group_step_updates` when
    ``config.max_step_updates`` is set (B' = min(B, max_step_updates)), cast to ``dtype``."""
    g = stack_step_updates(step_updates, roles, dtype=np.float64)
    if config.max_step_updates is not None:
        g = group_step_updates(g, config.max_step_updates)
    return g.astype(dtype)


def _row_sq_norms(
    g: np.ndarray, center: np.ndarray | None = None, u: np.ndarray | None = None, coef: np.ndarray | None = None
) -> np.ndarray:
    """||g_j - center - coef_j * u||^2 for every row j, in row chunks (bounded memory)."""
    b, m = g.shape
    out = np.empty(b, dtype=np.float64)
    step = max(1, _CHUNK_ELEMENTS // max(m, 1))
    for lo in range(0, b, step):
        d = g[lo : lo + step] - (0.0 if center is None else center)
        if u is not None and coef is not None:
            d = d - coef[lo : lo + step, None] * u
        out[lo : lo + step] = np.einsum("ij,ij->i", d, d)
    return out


@dataclass(frozen=True)
class StepSummary:
    """The target's per-step update statistics (App. A.5, estimator of sigma^2).

    Attributes:
        num_steps: B (rows of G).
        dim: m (columns of G).
        mean: g_bar, the mean of the rows (m,). By telescoping, Delta_T / B for one epoch.
        sum_sq_dev: sum_j ||g^j - g_bar||^2.
        sample_target_var: S_T = sum_sq_dev / ((B - 1) m), the unbiased variance of one part
            (the code's ``sample_target_var``).
        target_var: sigma^2-hat = S_T / B, the variance of the full target update (the code's
            ``target_var``; A.5: 1/((B-1)B) sum_j ||g^j - g_bar||^2, per coordinate).
    """

    num_steps: int
    dim: int
    mean: np.ndarray
    sum_sq_dev: float
    sample_target_var: float
    target_var: float


def summarize_step_updates(step_updates: np.ndarray, target_mean: np.ndarray | None = None) -> StepSummary:
    """The target-side variance estimator of App. A.5 from the B x m step-update matrix G.

    The target client can call this on its own step updates: for FedDA_Auto the server then
    needs only ``sample_target_var`` (one float) besides Delta_T, see
    :func:`estimate_fedda_stats_from_summary`.

    Args:
        step_updates: G, B x m with B >= 2 (a variance needs two samples).
        target_mean: the centre g_bar (m,); default the mean of the rows. The synthetic
            experiment (App. B) passes the full-data target gradient instead.

    Raises:
        ValueError: B < 2, non-finite values, or a ``target_mean`` of the wrong shape.
    """
    g = _as_matrix(step_updates, "step_updates", min_rows=2)
    b, m = g.shape
    if target_mean is None:
        mean = g.mean(axis=0)
    else:
        mean = np.asarray(target_mean, dtype=np.float64)
        if mean.shape != (m,):
            raise ValueError(f"target_mean has shape {mean.shape}; expected ({m},)")
        if not np.all(np.isfinite(mean)):
            raise ValueError("target_mean contains NaN or Inf")
    ssd = float(_row_sq_norms(g, mean).sum())
    sample_var = ssd / ((b - 1) * m)
    return StepSummary(b, m, mean, ssd, sample_var, sample_var / b)
