"""The wire layout: the backbone arrays followed by the class means and the covariance, whole or
as its upper triangle (:func:`join_wire` / :func:`split_wire`; the head is not sent).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flwr_pfl.core.packing import pack_symmetric, unpack_symmetric
from flwr_pfl.core.pfedfda.checks import ArrayLike, _numpy


def join_wire(
    backbone: Sequence[np.ndarray], means: ArrayLike, cov: ArrayLike, *, packed_cov: bool = False
) -> list[np.ndarray]:
    """The message [backbone arrays..., mu (C, d), Sigma (d, d)] (spec §8; the head is not sent).

    With ``packed_cov`` Sigma travels as its upper triangle, d(d+1)/2 values (Table 8 counting).
    """
    mu = _numpy(means)
    sigma = _numpy(cov)
    return [*(np.asarray(a) for a in backbone), mu, cov_to_triu(sigma) if packed_cov else sigma]


def split_wire(
    arrays: Sequence[np.ndarray], *, packed_cov: bool = False
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Inverse of :func:`join_wire`: (backbone arrays, mu (C, d), Sigma (d, d)).

    Raises:
        ValueError: fewer than two arrays, or trailing arrays of the wrong shapes.
    """
    if len(arrays) < 2:
        raise ValueError(f"a pFedFDA message ends with [means, cov]; got {len(arrays)} arrays")
    *backbone, mu, sigma = (np.asarray(a) for a in arrays)
    if mu.ndim != 2:
        raise ValueError(f"means must be 2-D (C, d), got shape {mu.shape}")
    if packed_cov:
        sigma = triu_to_cov(sigma, mu.shape[1])
    if sigma.shape != (mu.shape[1], mu.shape[1]):
        raise ValueError(f"cov must have shape ({mu.shape[1]}, {mu.shape[1]}), got {sigma.shape}")
    return backbone, mu, sigma


def cov_to_triu(cov: np.ndarray) -> np.ndarray:
    """Upper triangle (row-major, with diagonal) of a symmetric (d, d) matrix: d(d+1)/2 values."""
    if np.ndim(cov) != 2:
        raise ValueError(f"cov must be square, got shape {np.shape(cov)}")
    return pack_symmetric(cov)


def triu_to_cov(values: np.ndarray, dim: int) -> np.ndarray:
    """Symmetric (d, d) matrix from its packed upper triangle (inverse of :func:`cov_to_triu`)."""
    if np.ndim(values) != 1:
        raise ValueError(f"a packed {dim}x{dim} covariance has {dim * (dim + 1) // 2} values, got shape {np.shape(values)}")
    return unpack_symmetric(values, dim)
