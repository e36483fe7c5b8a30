"""Symmetric matrices on the wire: their upper triangle only (row-major, with the diagonal).

A symmetric (d, d) matrix holds d(d+1)/2 distinct values; sending the upper triangle halves what
crosses the wire (pFedFDA's covariance, FedDAR-SA's head Hessians). Both functions work on a
stack: the leading axes are kept.
"""

from __future__ import annotations

import numpy as np


def pack_symmetric(matrices: np.ndarray) -> np.ndarray:
    """The upper triangles of ``matrices`` (..., d, d) as (..., d(d+1)/2) values.

    A matrix that is symmetric only up to rounding (a sum of products taken in another order
    on each side of the diagonal) comes back, through :func:`unpack_symmetric`, as its upper
    triangle mirrored.
    """
    a = np.asarray(matrices)
    if a.ndim < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"a stack of square matrices (..., d, d) is needed, got shape {a.shape}")
    rows, cols = np.triu_indices(a.shape[-1])
    return a[..., rows, cols]


def unpack_symmetric(values: np.ndarray, dim: int) -> np.ndarray:
    """The symmetric (..., dim, dim) matrices whose packed upper triangles are ``values``
    (..., dim(dim+1)/2): the inverse of :func:`pack_symmetric`."""
    v = np.asarray(values)
    size = dim * (dim + 1) // 2
    if v.ndim < 1 or v.shape[-1] != size:
        raise ValueError(f"a packed {dim}x{dim} symmetric matrix has {size} values, got shape {v.shape}")
    out = np.zeros((*v.shape[:-1], dim, dim), dtype=v.dtype)
    rows, cols = np.triu_indices(dim)
    out[..., rows, cols] = v
    out[..., cols, rows] = v
    return out
