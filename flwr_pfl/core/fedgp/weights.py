"""Server side: the source weights w_i and the magnitude alignment a_i = (lr_T / lr_S,i) (K_T / K_i)
of App. C.9.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from flwr_pfl.core.fedgp.options import SourceWeighting, _coerce_enum


def source_weights(
    num_examples: Sequence[float], weighting: SourceWeighting | str = SourceWeighting.NUM_EXAMPLES
) -> np.ndarray:
    """Source weights w_i (sum to 1): n_i / sum n (``num_examples``, default) or 1/N (``uniform``).

    Raises:
        ValueError: no sources, a negative or non-finite count, or all counts zero with
            ``num_examples``.
    """
    w = _coerce_enum(SourceWeighting, weighting, "weighting")
    n = np.asarray(num_examples, dtype=np.float64)
    if n.ndim != 1 or n.size == 0:
        raise ValueError(f"num_examples must be a non-empty 1-D sequence (one per source); got shape {n.shape}")
    if not np.all(np.isfinite(n)) or np.any(n < 0):
        raise ValueError(f"num_examples must be finite and >= 0; got {n.tolist()}")
    if w is SourceWeighting.UNIFORM:
        return np.full(n.size, 1.0 / n.size)
    if n.sum() <= 0:
        raise ValueError("num_examples are all zero; cannot weight sources by example counts")
    return n / n.sum()


def _positive_vector(x: Any, name: str, n: int | None = None) -> np.ndarray:
    v = np.atleast_1d(np.asarray(x, dtype=np.float64))
    if v.ndim != 1 or (n is not None and v.size not in (1, n)):
        raise ValueError(f"{name} must be a scalar or one value per source ({n}); got shape {np.shape(x)}")
    if not np.all(np.isfinite(v)) or np.any(v <= 0):
        raise ValueError(f"{name} must be finite and > 0; got {v.tolist()}")
    return v if n is None or v.size == n else np.full(n, v[0])


def alignment_factors(
    *, lr_target: float, steps_target: int, lr_sources: Sequence[float] | float, steps_sources: Sequence[int]
) -> np.ndarray:
    """Magnitude alignment a_i = (lr_T / lr_S,i) * (K_T / K_i) of App. C.9.

    Rescales source i's update to the size of the target's: K_i steps at lr_S,i become K_T steps
    at lr_T. K counts **all** optimizer steps of the round (epochs included), so C.9's
    (n_T/bs_T)/(n_i/bs_S) * lr_T/lr_S * E_T/E_S is this with K = epochs * steps per epoch; the
    code's n_T/bs_T is not rounded up, client-reported step counts are.

    Args:
        lr_target: lr_T > 0 (after any lr decay; only the ratio matters).
        steps_target: K_T >= 1.
        lr_sources: lr_S,i > 0, one per source or one for all.
        steps_sources: K_i >= 1, one per source.

    Returns:
        a, shape (N,).
    """
    k_s = _positive_vector(steps_sources, "steps_sources")
    n = k_s.size
    lr_s = _positive_vector(lr_sources, "lr_sources", n)
    lr_t = _positive_vector(lr_target, "lr_target", 1)[0]
    k_t = _positive_vector(steps_target, "steps_target", 1)[0]
    return (lr_t / lr_s) * (k_t / k_s)
