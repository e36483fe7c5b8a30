"""Input checks and conversions shared by the pFedFDA modules.

Client-side inputs become finite floating tensors on the features' device and dtype, labels
become int64 class indices; option values are checked with a ValueError naming the field and
what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum
from typing import Any

import numpy as np
import torch


ArrayLike = torch.Tensor | np.ndarray


def _float(
    x: ArrayLike,
    name: str,
    ndim: int,
    *,
    like: torch.Tensor | None = None,
) -> torch.Tensor:
    """A finite floating tensor of ``ndim`` dimensions (on ``like``'s device and dtype if given)."""
    t = torch.as_tensor(x)
    if like is not None:
        t = t.to(device=like.device, dtype=like.dtype)
    if not t.is_floating_point():
        t = t.to(torch.get_default_dtype())
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or Inf")
    return t


def _labels(
    labels: ArrayLike, num_classes: int, *, device: torch.device | None = None, n: int | None = None
) -> torch.Tensor:
    """A 1-D int64 label tensor with values in [0, num_classes)."""
    _check_int("num_classes", num_classes, low=1)
    y = torch.as_tensor(labels, device=device)
    if y.ndim != 1 or y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"labels must be a 1-D integer array, got shape {tuple(y.shape)} and dtype {y.dtype}")
    if n is not None and y.shape[0] != n:
        raise ValueError(f"got {n} feature rows but {y.shape[0]} labels")
    if y.numel() == 0:
        raise ValueError("labels are empty")
    y = y.long()
    lo, hi = int(y.min()), int(y.max())
    if lo < 0 or hi >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got values in [{lo}, {hi}]")
    return y


def _num_classes(global_means: ArrayLike) -> int:
    shape = tuple(torch.as_tensor(global_means).shape)
    if len(shape) != 2:
        raise ValueError(f"global_means must be (C, d), got shape {shape}")
    return shape[0]


def _client_inputs(
    features: ArrayLike, labels: ArrayLike, global_means: ArrayLike, global_cov: ArrayLike, priors: ArrayLike
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features, labels and global statistics checked and moved to the features' device/dtype."""
    z = _float(features, "features", 2)
    mu_g = _float(global_means, "global_means", 2, like=z)
    cov_g = _float(global_cov, "global_cov", 2, like=z)
    pi = _float(priors, "priors", 1, like=z)
    num_classes, dim = mu_g.shape
    if z.shape[1] != dim:
        raise ValueError(f"features have width {z.shape[1]} but global_means have width {dim}")
    if cov_g.shape != (dim, dim):
        raise ValueError(f"global_cov must have shape ({dim}, {dim}), got {tuple(cov_g.shape)}")
    if pi.shape != (num_classes,) or (pi < 0).any() or abs(float(pi.sum()) - 1.0) > 1e-4:
        raise ValueError(f"priors must be a ({num_classes},) vector >= 0 summing to 1")
    y = _labels(labels, num_classes, device=z.device, n=z.shape[0])
    return z, y, mu_g, cov_g, pi


def _check_counts(num_examples: Sequence[int], expected: int) -> np.ndarray:
    counts = np.asarray(num_examples, dtype=np.float64)
    if counts.shape != (expected,):
        raise ValueError(f"need one example count per client ({expected}), got shape {counts.shape}")
    for i, c in enumerate(counts):
        if not math.isfinite(c) or c < 0 or c != int(c):
            raise ValueError(f"client {i}'s example count must be a non-negative integer, got {num_examples[i]!r}")
    if counts.sum() <= 0:
        raise ValueError("all example counts are zero; nothing to aggregate")
    return counts


def _check_real(
    name: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    numeric = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
    if not numeric or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value}")


def _check_int(name: str, value: int, *, low: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _enum_value(enum: type[Enum], value: Any, name: str) -> Any:
    try:
        return enum(value)
    except ValueError:
        allowed = [m.value for m in enum]  # type: ignore[attr-defined]
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}") from None


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)) or value in (0, 1):
        return bool(value)
    raise ValueError(f"{name} must be a bool (or 0/1), got {value!r}")


def _plain(value: Any) -> bool | int | float | str:
    return value.value if isinstance(value, Enum) else value


def _numpy(x: ArrayLike) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _less(a: float, b: float) -> bool:
    """a < b, with non-finite values losing to finite ones."""
    if not math.isfinite(a):
        return False
    return not math.isfinite(b) or a < b
