"""Evaluation against LOCAL (Section 5): relative accuracy R-Acc (Def. 3.2) and the positive
transfer ratio PTR (Def. 3.3), with :func:`transfer_summary` gathering them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flwr_pfl.core.fedora.options import ArrayLike


def _paired_scores(score: ArrayLike, score_local: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(score, dtype=np.float64).reshape(-1)
    b = np.asarray(score_local, dtype=np.float64).reshape(-1)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"need one score per client for both methods, got {a.size} and {b.size}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("scores contain NaN or Inf")
    return a, b


def relative_improvement(
    score: ArrayLike, score_local: ArrayLike, *, higher_is_better: bool = True
) -> np.ndarray:
    """Per-client relative accuracy (Def. 3.2) or relative MAE.

    ``R-Acc_k = (Acc_k - Acc_k^LOCAL) / Acc_k^LOCAL``; for errors (``higher_is_better=False``)
    ``R-MAE_k = (MAE_k^LOCAL - MAE_k) / MAE_k^LOCAL`` (spec 9.16), so higher is better for both.

    Returns:
        ``(K,)`` array. Raises ``ValueError`` if a LOCAL score is 0 (undefined ratio).
    """
    a, b = _paired_scores(score, score_local)
    if np.any(b == 0):
        raise ValueError(f"LOCAL score is 0 for clients {np.flatnonzero(b == 0).tolist()}; the "
                         "relative score is undefined there")
    diff = a - b if higher_is_better else b - a
    return diff / np.abs(b)


def positive_transfer_ratio(
    score: ArrayLike, score_local: ArrayLike, *, higher_is_better: bool = True, strict: bool = False
) -> float:
    """PTR (Def. 3.3): the fraction of clients not worse than LOCAL.

    Ties count as positive (``>=``, the paper); ``strict=True`` gives the ``>`` version, which a
    run that degenerates to LOCAL cannot inflate (spec 9.15).
    """
    a, b = _paired_scores(score, score_local)
    diff = a - b if higher_is_better else b - a
    return float(np.mean(diff > 0 if strict else diff >= 0))


def lambda_activity(lambdas: ArrayLike, epsilon: float = 1e-8) -> float:
    """Fraction of client-rounds with ``lambda > epsilon`` (report it next to PTR; spec 7.4)."""
    lam = np.asarray(lambdas, dtype=np.float64).reshape(-1)
    if lam.size == 0:
        raise ValueError("no lambda values given")
    return float(np.mean(lam > epsilon))


@dataclass(frozen=True)
class TransferSummary:
    """Evaluation against LOCAL (Section 5, Tables 1-5): unweighted means over clients."""

    mean: float
    mean_local: float
    relative: float
    relative_min: float
    relative_max: float
    ptr: float
    ptr_strict: float


def transfer_summary(
    score: ArrayLike, score_local: ArrayLike, *, higher_is_better: bool = True
) -> TransferSummary:
    """Mean score, mean R-Acc (or R-MAE), its min/max, PTR (``>=``) and strict PTR (``>``)."""
    a, b = _paired_scores(score, score_local)
    rel = relative_improvement(a, b, higher_is_better=higher_is_better)
    return TransferSummary(
        mean=float(a.mean()),
        mean_local=float(b.mean()),
        relative=float(rel.mean()),
        relative_min=float(rel.min()),
        relative_max=float(rel.max()),
        ptr=positive_transfer_ratio(a, b, higher_is_better=higher_is_better),
        ptr_strict=positive_transfer_ratio(a, b, higher_is_better=higher_is_better, strict=True),
    )
