"""Input validation shared by the FedDAR modules: domain labels, features and heads on the client
(torch), wire arrays and count tables on the server (NumPy), each converted to float64.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from flwr_pfl.core.feddar.layout import HeadLayout


def _check_domains(domains: Tensor, num_domains: int) -> Tensor:
    """Return domains as int64 after checking type and range [0, M)."""
    if not isinstance(num_domains, (int, np.integer)) or num_domains < 1:
        raise ValueError(f"num_domains must be a positive integer, got {num_domains!r}")
    domains = torch.as_tensor(domains)
    if domains.dtype == torch.bool or domains.is_floating_point() or domains.is_complex():
        raise ValueError(f"domain labels must be integers, got dtype {domains.dtype}")
    if domains.numel() and (int(domains.min()) < 0 or int(domains.max()) >= num_domains):
        raise ValueError(
            f"domain labels must lie in [0, {num_domains}), got values in "
            f"[{int(domains.min())}, {int(domains.max())}]"
        )
    return domains.long()


def _check_features(features: Tensor, domains: Tensor, layout: HeadLayout | None = None) -> tuple[Tensor, Tensor]:
    """Return (features as float64, domains on the features' device) after checking
    features (..., L, k) against domains (..., L)."""
    features = torch.as_tensor(features)
    if features.dim() < 2 or tuple(features.shape[:-1]) != tuple(domains.shape):
        raise ValueError(
            f"features must have shape (..., L, k) matching domains (..., L) = "
            f"{tuple(domains.shape)}, got {tuple(features.shape)}"
        )
    if layout is not None and features.shape[-1] != layout.feature_dim:
        raise ValueError(
            f"features have dimension {features.shape[-1]}, the head layout expects "
            f"k = {layout.feature_dim}"
        )
    return features.to(torch.float64), domains.to(features.device)


def _check_heads(heads: Tensor, layout: HeadLayout, name: str = "heads") -> tuple[Tensor, int]:
    """Return heads (..., M, P) as float64 and M, after checking the trailing dimension P."""
    heads = torch.as_tensor(heads)
    if heads.dim() < 2 or heads.shape[-1] != layout.num_params:
        raise ValueError(
            f"{name} must have shape (M, P) or (..., M, P) with P = {layout.num_params}, "
            f"got {tuple(heads.shape)}"
        )
    return heads.to(torch.float64), heads.shape[-2]


def _one_hot(domains: Tensor, num_domains: int) -> Tensor:
    """Domain indicator (..., L, M) in float64."""
    return torch.nn.functional.one_hot(domains, num_domains).to(torch.float64)


def _augment(features: Tensor, layout: HeadLayout) -> Tensor:
    """Append the constant-1 bias feature when the layout has a bias: (..., L, k) -> (..., L, in_dim)."""
    if not layout.bias:
        return features
    return torch.cat([features, features.new_ones(*features.shape[:-1], 1)], -1)


def _server_array(name: str, value, shape: tuple[int, ...] | None = None, ndim: int | None = None) -> np.ndarray:
    """Convert a wire array to float64, checking its shape and that it is finite."""
    arr = np.asarray(value, dtype=np.float64)
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {arr.shape}")
    if shape is not None and arr.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {arr.shape}")
    if not np.all(np.isfinite(arr)):
        bad = np.argwhere(~np.isfinite(arr))[0]
        raise ValueError(f"{name} contains NaN or Inf (first at index {tuple(int(b) for b in bad)})")
    return arr


def _count_table(counts, ndim: int = 2) -> np.ndarray:
    """Check a table of non-negative integer counts (n, M) (or (M,) with ndim=1)."""
    arr = _server_array("counts", counts, ndim=ndim)
    if np.any(arr < 0) or np.any(arr != np.round(arr)):
        raise ValueError("counts must be non-negative integers")
    return arr
