"""Task membership: which client holds which task (paper Sec. II).

A client reports its per-task sample counts n_i^c (:func:`task_counts`); the server turns the
reported counts into the holder mask c in C_i (:func:`task_membership`), from which it knows
I^c = {i : c in C_i}, all that the eq. (12) weights need.
"""

from __future__ import annotations

import numpy as np
import torch

from flwr_pfl.core.fmtl.checks import (
    ArrayLike,
    _check_num_tasks,
    _check_task_ids_np,
    _is_int_at_least,
    _to_numpy,
)


def task_counts(task_ids: ArrayLike, num_tasks: int) -> np.ndarray:
    """Per-task sample counts n_i^c of one client (client side).

    The counts define C_i = {c : n_i^c >= min_count} (:func:`task_membership`), which is all
    the server needs for eq. (12) ("distribution-free" weights). Sending the counts rather than
    the set also gives n_i = sum_c n_i^c and lets the server apply its own ``min_count``.

    Args:
        task_ids: (n_i,) integer task id of every local sample (the class label when tasks are
            classes), numpy or torch.
        num_tasks: M.

    Returns:
        (M,) int64 counts.
    """
    _check_num_tasks(num_tasks)
    ids = np.asarray(_to_numpy(task_ids, "task_ids"))
    _check_task_ids_np(ids, num_tasks)
    return np.bincount(ids.astype(np.int64), minlength=num_tasks).astype(np.int64)


def task_membership(counts: ArrayLike, min_count: int = 1) -> np.ndarray:
    """Holder mask c in C_i from per-task counts (server side).

    Client i holds task c when n_i^c >= ``min_count`` (default 1, spec P9: the FedRep shard
    scheme can give a client the same class twice, so membership is defined by presence).

    Args:
        counts: (M,) counts of one client or (K, M) counts of K clients (from :func:`task_counts`).
        min_count: smallest count that makes a client a holder (>= 1).

    Returns:
        bool array of the shape of ``counts``.

    Raises:
        ValueError: negative or non-finite counts, or a client that holds no task (a client with
            no task cannot be weighted: beta_hat_i = 0 in eqs. 5 and 10). The message names the
            rows, so the caller can reject those clients and go on with the others.
    """
    if not _is_int_at_least(min_count, 1):
        raise ValueError(f"min_count must be an integer >= 1, got {min_count!r}")
    c = np.asarray(_to_numpy(counts, "counts") if isinstance(counts, torch.Tensor) else counts)
    if c.ndim not in (1, 2) or c.shape[-1] < 1:
        raise ValueError(f"counts must have shape (M,) or (K, M), got {c.shape}")
    if not np.issubdtype(c.dtype, np.number) or not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError("counts must be finite non-negative numbers")
    held = c >= min_count
    rows = held.reshape(-1, c.shape[-1])
    empty = np.flatnonzero(~rows.any(axis=1))
    if empty.size:
        which = "the client" if c.ndim == 1 else f"client row(s) {empty.tolist()}"
        raise ValueError(
            f"{which} hold(s) no task (no task has at least min_count={min_count} samples); "
            "a client must hold at least one task"
        )
    return held
