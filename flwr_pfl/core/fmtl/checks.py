"""Input validation shared by the FMTL modules (shapes, task ids, holder masks, sample counts).

Every public function of :mod:`flwr_pfl.core.fmtl` checks its inputs with these helpers and
raises ValueError naming the argument and what is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


ArrayLike = np.ndarray | torch.Tensor


# Tolerance for "weights sum to 1" checks on float64 weights built from counts.
_SUM_TOL = 1e-9


def _to_numpy(x: ArrayLike, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    raise ValueError(f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}")


def _is_int_at_least(value: object, low: int) -> bool:
    """True for a Python/NumPy integer (not a bool) >= low."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= low


def _check_num_tasks(num_tasks: int) -> None:
    if not _is_int_at_least(num_tasks, 1):
        raise ValueError(f"num_tasks must be an integer >= 1, got {num_tasks!r}")


def _check_weight_vector(weights: np.ndarray, size: int, name: str) -> np.ndarray:
    """(size,) finite weights >= 0 summing to 1, as float64."""
    w = np.asarray(weights, dtype=np.float64)
    if (
        w.shape != (size,)
        or not np.all(np.isfinite(w))
        or np.any(w < 0)
        or abs(w.sum() - 1.0) > _SUM_TOL
    ):
        raise ValueError(f"{name} must be {size} finite weights >= 0 summing to 1, got {w!r}")
    return w


def _check_task_ids_np(task_ids: np.ndarray, num_tasks: int, name: str = "task_ids") -> None:
    if task_ids.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one task id per sample), got shape {task_ids.shape}")
    if task_ids.size and not np.issubdtype(task_ids.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {task_ids.dtype}")
    if task_ids.size and (task_ids.min() < 0 or task_ids.max() >= num_tasks):
        bad = task_ids[(task_ids < 0) | (task_ids >= num_tasks)]
        raise ValueError(
            f"{name} must lie in [0, {num_tasks}) (num_tasks={num_tasks}); found {bad[:5].tolist()}"
        )


def _check_task_ids_torch(task_ids: torch.Tensor, num_tasks: int, n: int) -> None:
    if task_ids.ndim != 1 or task_ids.shape[0] != n:
        raise ValueError(
            f"task_ids must have shape ({n},) (one task id per sample), got {tuple(task_ids.shape)}"
        )
    if task_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ValueError(f"task_ids must be an integer tensor, got dtype {task_ids.dtype}")
    if n and (int(task_ids.min()) < 0 or int(task_ids.max()) >= num_tasks):
        raise ValueError(
            f"task_ids must lie in [0, {num_tasks}) (num_tasks={num_tasks}); "
            f"got min {int(task_ids.min())}, max {int(task_ids.max())}"
        )


def _check_membership(membership: np.ndarray, name: str = "membership") -> np.ndarray:
    membership = np.asarray(membership)
    if membership.ndim != 2 or membership.shape[0] < 1 or membership.shape[1] < 1:
        raise ValueError(
            f"{name} must be a 2-D boolean array (clients, tasks) with at least one of each, "
            f"got shape {membership.shape}"
        )
    if membership.dtype != np.bool_:
        raise ValueError(f"{name} must have dtype bool (holder mask), got {membership.dtype}")
    empty = np.flatnonzero(~membership.any(axis=1))
    if empty.size:
        raise ValueError(
            f"{name}: client row(s) {empty.tolist()} hold no task; every client must hold at "
            "least one task (drop such clients before weighting)"
        )
    return membership


def _as_vector(x: ArrayLike | Sequence[float], name: str) -> np.ndarray:
    arr = _to_numpy(x, name) if isinstance(x, (np.ndarray, torch.Tensor)) else x
    try:
        vec = np.asarray(arr, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a 1-D array of numbers") from None
    if vec.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {vec.shape}")
    return vec


def _check_num_examples(num_examples: ArrayLike | Sequence[float], size: int | None) -> np.ndarray:
    n = _as_vector(num_examples, "num_examples")
    if size is not None and n.shape != (size,):
        raise ValueError(f"num_examples must have shape ({size},), got {n.shape}")
    if n.size == 0:
        raise ValueError("num_examples is empty; at least one client is needed")
    bad = np.flatnonzero(~np.isfinite(n) | (n < 0))
    if bad.size:
        raise ValueError(
            f"num_examples must be finite and >= 0; client(s) {bad.tolist()} have "
            f"{n[bad].tolist()}"
        )
    if n.sum() <= 0:
        raise ValueError("num_examples sum to 0; at least one client must have examples")
    return n
