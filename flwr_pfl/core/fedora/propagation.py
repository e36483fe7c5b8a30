"""Server side, every round: parameter propagation (Eq. 6-7; Algorithm 1 line 16).

:func:`propagate` computes ``Theta_hat = M Theta`` in closed form (one GEMM into the output
buffer, or column blocks for a subset of rows; no ``K x P`` temporary);
:func:`propagate_iterative` runs ``m`` steps of Eq. 7; :func:`server_objective` evaluates Eq. 3
for diagnostics.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from flwr_pfl.core.fedora.options import alpha_from_kappa


def _check_stack(theta: np.ndarray, k_total: int, name: str = "theta") -> np.ndarray:
    arr = np.asarray(theta)
    if arr.ndim != 2 or arr.shape[0] != k_total:
        raise ValueError(f"{name} must be a (K={k_total}, P) array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{name} must be a floating array, got dtype {arr.dtype}")
    return arr


def _prepare_out(theta: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return np.empty_like(theta)
    if out.shape != theta.shape or out.dtype != theta.dtype:
        raise ValueError(f"out must have shape {theta.shape} and dtype {theta.dtype}, got "
                         f"{out.shape} and {out.dtype}")
    if np.shares_memory(out, theta):
        raise ValueError("out must not share memory with theta (keep separate theta and "
                         "theta_hat buffers)")
    return out


def _row_selection(rows: Sequence[int] | np.ndarray | None, k_total: int) -> np.ndarray | None:
    if rows is None:
        return None
    idx = np.unique(np.asarray(rows, dtype=np.int64).reshape(-1))
    if idx.size and (idx[0] < 0 or idx[-1] >= k_total):
        raise ValueError(f"rows must be client indices in [0, {k_total}), got {idx.tolist()}")
    return None if idx.size == k_total else idx


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of ``array`` (no copy); read-only inputs are only ever read."""
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():  # torch warns that it cannot mark the view read-only
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _matmul_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out[...] = a @ b`` for NumPy arrays of one float dtype, computed by torch.

    The server's per-round GEMM (Eq. 6/7) runs in torch rather than NumPy's BLAS so that one
    setting, ``torch.set_num_threads``, governs all of FEDORA's compute (the client subspace already
    runs in torch). NumPy's BLAS keeps its own thread pool, sized from the environment at import
    and out of reach of that setting; a multi-threaded product waits for all its threads, which
    on a shared machine is slow (measured on 2 cores, ``K = 100``, ``P = 10 000``: 1.9 ms on one
    thread, 18-24 ms with NumPy's default pool while another process kept one core busy).
    """
    out_t = _tensor(out) if out.flags.c_contiguous else None
    if out_t is not None:
        torch.matmul(_tensor(a), _tensor(b), out=out_t)
    else:
        out[...] = torch.matmul(_tensor(a), _tensor(b)).numpy()


def _apply_mixing(
    mixing: np.ndarray,
    theta: np.ndarray,
    out: np.ndarray,
    rows: np.ndarray | None,
    chunk_columns: int,
) -> None:
    """``out[rows] = mixing[rows] @ theta`` in ``theta``'s dtype without a ``K x P`` temporary.

    ``mixing`` is cast to ``theta``'s dtype (a float64 ``M`` times a float32 ``Theta`` would
    otherwise up-cast the whole stack). All rows: one GEMM straight into ``out``. Some rows:
    column blocks of ``chunk_columns``, with an ``O(K x chunk_columns)`` workspace.
    """
    m = np.ascontiguousarray(mixing, dtype=theta.dtype)
    if rows is None:
        _matmul_into(m, theta, out)
        return
    if rows.size == 0:
        return
    m_rows = np.ascontiguousarray(m[rows])
    block = np.empty((rows.size, min(chunk_columns, theta.shape[1])), dtype=theta.dtype)
    for start in range(0, theta.shape[1], chunk_columns):
        stop = min(start + chunk_columns, theta.shape[1])
        part = block[:, : stop - start]
        _matmul_into(m_rows, theta[:, start:stop], part)
        out[rows, start:stop] = part


def propagate(
    theta: np.ndarray,
    propagation: np.ndarray,
    *,
    out: np.ndarray | None = None,
    rows: Sequence[int] | np.ndarray | None = None,
    chunk_columns: int = 1 << 16,
) -> np.ndarray:
    """Closed-form parameter propagation ``Theta_hat = M Theta`` (Eq. 6; Algorithm 1 line 16).

    Each ``theta_hat_k = sum_k' M_kk' theta_k'`` is a convex combination of the clients' models.
    Works on flattened parameter vectors, element-wise for every parameter (biases included).

    Memory and cost: ``O(K^2 P)`` flops per call; with ``out`` given (the server's ``theta_hat``
    buffer) nothing of size ``K x P`` is allocated; only a ``K x K`` cast of ``M`` and, with
    ``rows``, an ``O(K x chunk_columns)`` workspace (measured: under 4 such blocks).

    Args:
        theta: ``Theta`` ``(K, P)`` float (float32 in practice), the last-known ``theta_k``.
        propagation: ``M`` ``(K, K)`` (:func:`propagation_matrix`).
        out: ``(K, P)`` output buffer of ``theta``'s dtype, not aliasing ``theta``.
        rows: recompute only these clients' ``theta_hat`` (others keep ``out``'s content, e.g.
            clients whose round failed); None: all.
        chunk_columns: column block size for ``rows``.

    Returns:
        ``out`` (``(K, P)``).
    """
    m = np.asarray(propagation, dtype=np.float64)
    k_total = m.shape[0]
    theta = _check_stack(theta, k_total)
    if m.shape != (k_total, k_total):
        raise ValueError(f"M must be ({k_total}, {k_total}), got {m.shape}")
    sel = _row_selection(rows, k_total)
    target = _prepare_out(theta, out)
    _apply_mixing(m, theta, target, sel, chunk_columns)
    return target


def propagate_iterative(
    theta: np.ndarray,
    transition: np.ndarray,
    kappa: float,
    num_iterations: int,
    *,
    out: np.ndarray | None = None,
    rows: Sequence[int] | np.ndarray | None = None,
    chunk_columns: int = 1 << 16,
) -> np.ndarray:
    """Iterative propagation (Eq. 7): ``Theta_hat <- kappa P Theta_hat + (1 - kappa) Theta``.

    Starts from ``Theta_hat^(0) = Theta``; after ``m`` steps the distance to Eq. 6 is at most
    ``kappa^m`` times the initial one (row-wise max norm), since ``||kappa P||_inf = kappa``.
    ``m = 0`` returns ``Theta``. Per client:
    ``theta_hat_k = (alpha / ((1 + alpha) D_kk)) sum_k' w_kk' theta_hat_k' + theta_k / (1 + alpha)``.

    Memory: one ``K x P`` workspace besides ``out`` (two with ``rows``) and a
    ``K x chunk_columns`` temporary. Cost ``O(m K^2 P)``.

    Args:
        theta: ``(K, P)`` float.
        transition: ``P`` ``(K, K)`` row-stochastic.
        kappa: in ``[0, 1)``.
        num_iterations: ``m >= 0``.
        out, rows, chunk_columns: as in :func:`propagate`.

    Returns:
        ``out`` (``(K, P)``).
    """
    alpha_from_kappa(kappa)
    p = np.asarray(transition, dtype=np.float64)
    k_total = p.shape[0]
    theta = _check_stack(theta, k_total)
    if p.shape != (k_total, k_total):
        raise ValueError(f"P must be ({k_total}, {k_total}), got {p.shape}")
    if num_iterations < 0:
        raise ValueError(f"num_iterations={num_iterations} must be >= 0")
    sel = _row_selection(rows, k_total)
    target = _prepare_out(theta, out)
    current = target if sel is None else np.empty_like(theta)
    current[...] = theta
    scratch = np.empty_like(theta)
    kp = np.ascontiguousarray(kappa * p, dtype=theta.dtype)
    for _ in range(num_iterations):
        _matmul_into(kp, current, scratch)
        for start in range(0, theta.shape[1], chunk_columns):  # scratch += (1 - kappa) Theta
            cols = slice(start, start + chunk_columns)
            scratch[:, cols] += (1.0 - kappa) * theta[:, cols]
        current, scratch = scratch, current
    if sel is None:
        if current is not target:
            target[...] = current
    else:
        target[sel] = current[sel]
    return target


def server_objective(
    theta_hat: np.ndarray, theta: np.ndarray, transition: np.ndarray, alpha: float
) -> float:
    """Eq. 3: ``sum_k ||theta_k - theta_hat_k||^2 + (alpha/2) sum_kk' P_kk' ||theta_hat_k - theta_hat_k'||^2``.

    ``P = D^-1 W``. Eq. 6 minimises this only when ``P`` is symmetric (Lemma 4.2's proof assumes
    it); for the official code's asymmetric top-k graph, Eq. 6 is the propagation fixed point,
    not the minimiser. For diagnostics and tests; ``O(K^2 P)``.
    """
    th, t = np.asarray(theta_hat, dtype=np.float64), np.asarray(theta, dtype=np.float64)
    p = np.asarray(transition, dtype=np.float64)
    sq = np.sum(th**2, axis=1)
    pairwise = sq[:, None] + sq[None, :] - 2.0 * th @ th.T
    return float(np.sum((t - th) ** 2) + 0.5 * alpha * np.sum(p * pairwise))
