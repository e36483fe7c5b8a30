"""Server side, once: similarity of the clients' subspaces (Eq. 4-5; Algorithm 1 line 5).

``s_kk' = sum_i cos zeta_i`` over the principal angles between ``span(U_k)`` and ``span(U_k')``
(:func:`subspace_similarity`), after checking each upload (:func:`validate_subspace`). The cosine
and random similarities are the Table 4 ablations.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def validate_subspace(
    u: np.ndarray,
    *,
    p: int | None = None,
    dim: int | None = None,
    atol: float = 1e-5,
    client: object = None,
) -> np.ndarray:
    """Check an uploaded ``U_k``: 2-D, finite, orthonormal columns; return it as float64.

    Args:
        u: ``(d, p)``.
        p, dim: expected ``p`` and ``d`` (None: not checked).
        atol: tolerance on ``||U^T U - I||_max`` (uploads may travel as float32).
        client: an identifier used in error messages.

    Raises:
        ValueError: naming the client and what is wrong (wrong shape, NaN/Inf, an all-zero or
            non-orthonormal basis).
    """
    who = f"client {client!r}: " if client is not None else ""
    arr = np.asarray(u, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{who}subspace must be a 2-D (d, p) array, got shape {arr.shape}")
    if p is not None and arr.shape[1] != p:
        raise ValueError(f"{who}subspace has p={arr.shape[1]} columns, expected p={p}")
    if dim is not None and arr.shape[0] != dim:
        raise ValueError(f"{who}subspace has d={arr.shape[0]} rows, expected d={dim}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{who}subspace contains NaN or Inf")
    err = np.max(np.abs(arr.T @ arr - np.eye(arr.shape[1])))
    if err > atol:
        raise ValueError(f"{who}subspace columns are not orthonormal (max |U^T U - I| = "
                         f"{err:.3g} > {atol}); a degenerate (e.g. all-zero) basis is not allowed")
    return arr


def principal_angle_cosines(u1: np.ndarray, u2: np.ndarray) -> np.ndarray:
    """Cosines of the principal angles between ``span(U1)`` and ``span(U2)`` (Eq. 5).

    They are the singular values of ``U1^T U2`` (``U1``, ``U2`` with orthonormal columns,
    ``(d, p1)`` and ``(d, p2)``), in decreasing order, clipped to ``[0, 1]`` against rounding.

    Returns:
        ``(min(p1, p2),)`` array.
    """
    a, b = np.asarray(u1, dtype=np.float64), np.asarray(u2, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"bases must be (d, p) arrays with one d, got {a.shape} and {b.shape}")
    return np.clip(np.linalg.svd(a.T @ b, compute_uv=False), 0.0, 1.0)


_COS_ZERO = 1e-12


def _stack_subspaces(
    subspaces: Sequence[np.ndarray | None], atol: float, first_index: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Validate bases (None = missing) and stack them as ``(K, d, p)`` (zeros where missing)."""
    present = np.array([u is not None for u in subspaces], dtype=bool)
    if not present.any():
        raise ValueError("no client subspace is present; at least one U_k is needed")
    k0 = int(np.argmax(present))
    ref = validate_subspace(subspaces[k0], atol=atol, client=first_index + k0)
    stack = np.zeros((len(subspaces),) + ref.shape)
    for k, u in enumerate(subspaces):
        if u is not None:
            stack[k] = validate_subspace(u, p=ref.shape[1], dim=ref.shape[0], atol=atol,
                                         client=first_index + k)
    return stack, present


def _sum_of_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``s_ij = sum of the singular values of A_i^T B_j`` (Eq. 4-5) for stacks ``(m, d, p)``.

    Cosines below ``_COS_ZERO`` (rounding level for float64 orthonormal bases) are set to 0, so
    orthogonal subspaces give exactly zero similarity instead of ~1e-17 weights that row
    normalisation would blow up into an arbitrary transition row.
    """
    cross = np.einsum("idp,jdq->ijpq", a, b)
    cos = np.clip(np.linalg.svd(cross, compute_uv=False), 0.0, 1.0)
    cos[cos < _COS_ZERO] = 0.0
    return cos.sum(axis=-1)


def subspace_similarity(
    subspaces: Sequence[np.ndarray | None], *, atol: float = 1e-5
) -> tuple[np.ndarray, np.ndarray]:
    """Pairwise similarity ``s_kk' = sum_i cos zeta_i^{kk'}`` (Eq. 4) of all clients.

    A missing client (``None``: it never uploaded ``U_k``, or its upload was rejected) gets a zero
    row and column and ``present[k] = False``; :func:`similarity_graph` then keeps it out of every
    neighbourhood and gives it a self-loop only, so its auxiliary model is its own model.
    Cost ``O(K^2 d p^2)``, one batched SVD of ``K^2`` ``p x p`` matrices.

    Args:
        subspaces: ``K`` entries, each a ``(d, p)`` orthonormal basis or None; one ``d`` and ``p``.
        atol: orthonormality tolerance of :func:`validate_subspace`.

    Returns:
        ``(S, present)``: ``S`` of shape ``(K, K)``, symmetric, entries in ``[0, p]``,
        ``S_kk = p`` for present clients; ``present`` a ``(K,)`` bool array.

    Raises:
        ValueError: an invalid basis (naming the client index), inconsistent ``d``/``p``, or no
            client present.
    """
    stack, present = _stack_subspaces(subspaces, atol)
    idx = np.flatnonzero(present)
    s = np.zeros((len(subspaces), len(subspaces)))
    s[np.ix_(idx, idx)] = _sum_of_cosines(stack[idx], stack[idx])
    s = 0.5 * (s + s.T)  # exact symmetry (sigma(A) = sigma(A^T) up to rounding)
    return s, present


def cosine_similarity_matrix(vectors: np.ndarray) -> np.ndarray:
    """Cosine similarity of flattened vectors (Table 4 ablations; spec section 4).

    ``"parameter similarity"`` uses the rows of ``Theta``; ``"gradient similarity"`` the client
    updates ``theta_k_new - theta_hat_k``. Entries lie in ``[-1, 1]``; use the ``exp`` transform
    (or clip) before building a graph. Memory: one ``K x K`` Gram matrix, no copy of the input.

    Args:
        vectors: ``(K, P)``.

    Returns:
        ``(K, K)`` float64.
    """
    x = np.asarray(vectors)
    if x.ndim != 2:
        raise ValueError(f"vectors must be (K, P), got shape {x.shape}")
    gram = (x @ x.T).astype(np.float64)
    norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    if np.any(norms == 0) or not np.all(np.isfinite(gram)):
        raise ValueError("cosine similarity needs finite, non-zero vectors; rows "
                         f"{np.flatnonzero(norms == 0).tolist()} are zero or values are non-finite")
    return np.clip(gram / np.outer(norms, norms), -1.0, 1.0)


def random_similarity(num_clients: int, seed: int = 0) -> np.ndarray:
    """A random symmetric similarity in ``[0, 1)``, fixed once (Table 4, "random similarity")."""
    if num_clients < 1:
        raise ValueError(f"num_clients={num_clients} must be >= 1")
    r = np.random.default_rng(seed).random((num_clients, num_clients))
    s = np.triu(r, 1)
    return s + s.T + np.eye(num_clients)
