"""Client side, once: the client's subspace ``U_k`` (Algorithm 1 lines 1-3; Section 4.2.1).

:func:`data_matrix` builds ``Z_k = [X_k | Y_k]``; :func:`client_subspace` returns its top-``p``
right singular vectors, the only thing a client uploads at setup.
"""

from __future__ import annotations

import numpy as np
import torch

from flwr_pfl.core.fedora.options import SubspaceOptions


def data_matrix(
    features: np.ndarray,
    labels: np.ndarray | None = None,
    *,
    num_classes: int | None = None,
    options: SubspaceOptions = SubspaceOptions(),
) -> np.ndarray:
    """Build ``Z_k = [X_k | label_scale * Y_k]`` (the paper's ``X_k o Y_k``, Section 4.2.1).

    Args:
        features: ``(n, ...)``; each sample is flattened to ``d_x`` values.
        labels: ``(n,)`` integer classes (one-hot encoded with ``num_classes`` columns) or, when
            ``num_classes`` is None, real-valued targets ``(n,)`` or ``(n, t)`` appended as they are
            (regression). Ignored when ``options.use_labels`` is False.
        num_classes: ``C`` for one-hot labels.
        options: see :class:`SubspaceOptions`.

    Returns:
        ``Z`` of shape ``(n, d_x + C)`` (or ``(n, d_x)`` without labels), float64, centred by
        column if ``options.center``.
    """
    x = np.asarray(features)
    if x.ndim < 1 or x.shape[0] < 1:
        raise ValueError(f"features must have shape (n, ...) with n >= 1, got {x.shape}")
    n = x.shape[0]
    x = x.reshape(n, -1).astype(np.float64)
    blocks = [x]
    if options.use_labels:
        if labels is None:
            raise ValueError("labels are required when use_labels=True; pass use_labels=False "
                             "for a feature-only subspace")
        y = np.asarray(labels)
        if y.shape[0] != n:
            raise ValueError(f"labels have {y.shape[0]} rows but features have {n}")
        if num_classes is not None:
            if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
                raise ValueError("one-hot labels must be a 1-D integer array; "
                                 "pass num_classes=None for real-valued targets")
            if num_classes < 1 or y.min() < 0 or y.max() >= num_classes:
                raise ValueError(f"labels must lie in [0, num_classes={num_classes})")
            onehot = np.zeros((n, num_classes), dtype=np.float64)
            onehot[np.arange(n), y] = 1.0
            blocks.append(options.label_scale * onehot)
        else:
            blocks.append(options.label_scale * y.reshape(n, -1).astype(np.float64))
    z = np.concatenate(blocks, axis=1) if len(blocks) > 1 else blocks[0]
    if not np.all(np.isfinite(z)):
        raise ValueError("client data contain NaN or Inf; the subspace needs finite data")
    if options.center:
        z = z - z.mean(axis=0, keepdims=True)
    return z


def _orient_columns(u: np.ndarray) -> np.ndarray:
    """Fix the sign of each singular vector: its largest-magnitude entry is positive.

    Singular vectors are defined up to sign; principal angles do not depend on it, but a fixed
    convention makes the uploaded ``U_k`` reproducible.
    """
    idx = np.argmax(np.abs(u), axis=0)
    signs = np.sign(u[idx, np.arange(u.shape[1])])
    signs[signs == 0] = 1.0
    return u * signs


def client_subspace(
    features: np.ndarray,
    labels: np.ndarray | None = None,
    *,
    num_classes: int | None = None,
    options: SubspaceOptions = SubspaceOptions(),
) -> np.ndarray:
    """Top-``p`` right singular vectors of the client's data matrix (Algorithm 1 line 2).

    The paper writes ``X_k o Y_k = U_k Sigma_k V_k^T``, which literally puts ``U_k`` in sample
    space and cannot be compared across clients with different ``n_k``; as in the official code
    the basis lives in feature(+label) space, i.e. the right singular vectors of ``Z_k``. It is
    computed exactly (no randomized SVD, which adds seed dependence) by a float64
    eigendecomposition of the smaller Gram matrix: ``Z_k^T Z_k`` (``d x d``) when ``n > d``, else
    ``Z_k Z_k^T`` (``n x n``) mapped back by ``v_i = Z_k^T u_i / sigma_i``. Cost
    ``O(n d min(n, d))``; it runs in torch, so it follows ``torch.set_num_threads``.

    Args:
        features, labels, num_classes, options: see :func:`data_matrix`.

    Returns:
        ``U_k`` of shape ``(d, p)``, float64, orthonormal columns ordered by decreasing singular
        value; each column's largest-magnitude entry is positive.

    Raises:
        ValueError: if the data cannot define a ``p``-dimensional subspace (all-zero data, fewer
            than ``p`` samples or rank below ``p``: the ``p``-th singular value is at most
            ``options.rank_rtol`` times the largest).
    """
    z_np = data_matrix(features, labels, num_classes=num_classes, options=options)
    n, d = z_np.shape
    p = options.p
    if p > d:
        raise ValueError(f"p={p} exceeds the data dimension d={d}")
    z = torch.from_numpy(z_np)
    gram = z @ z.T if n <= d else z.T @ z  # the smaller Gram matrix, min(n, d) squared
    evals, evecs = torch.linalg.eigh(gram)
    top = torch.clamp(evals.flip(0)[:p], min=0.0).sqrt().numpy()
    vecs = evecs.flip(1)[:, :p]
    largest = float(top[0]) if top.size else 0.0
    if largest == 0.0 or top.size < p or top[p - 1] <= options.rank_rtol * largest:
        raise ValueError(
            f"client data (n={n}, d={d}) have numerical rank < p={p}: singular values "
            f"{np.round(top, 12).tolist()} (all-zero or rank-deficient data); a subspace needs "
            f"singular value p at least rank_rtol={options.rank_rtol} times the largest"
        )
    if n <= d:  # right singular vectors v_i = Z^T u_i / sigma_i, re-orthonormalised
        vecs = torch.linalg.qr(z.T @ vecs / torch.from_numpy(top)).Q
    basis = vecs.numpy()
    return _orient_columns(np.ascontiguousarray(basis))
