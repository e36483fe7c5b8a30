"""Tensor bookkeeping (both sides): which tensors are aggregated (:func:`tensor_roles`), model
deltas and their application, and the flattening of an update into one vector over the
``aggregate`` tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flwr_pfl.core.fedgp.config import FDAConfig
from flwr_pfl.core.fedgp.options import TensorRole, _coerce_enum


NDArrays = list[np.ndarray]


def _is_float(a: np.ndarray) -> bool:
    return np.issubdtype(a.dtype, np.floating)


def _check_finite(a: np.ndarray, name: str) -> None:
    if _is_float(a) and not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains NaN or Inf; updates must be finite")


def _check_layout(reference: Sequence[np.ndarray], other: Sequence[np.ndarray], ref_name: str, name: str) -> None:
    """Same number of tensors and the same shapes, tensor by tensor."""
    if len(other) != len(reference):
        raise ValueError(f"{name} has {len(other)} tensors but {ref_name} has {len(reference)}; the lists must match")
    for k, (r, o) in enumerate(zip(reference, other)):
        if np.shape(o) != np.shape(r):
            raise ValueError(f"{name}[{k}] has shape {np.shape(o)} but {ref_name}[{k}] has shape {np.shape(r)}")


def tensor_roles(
    arrays: Sequence[np.ndarray],
    config: FDAConfig,
    is_buffer: Sequence[bool] | None = None,
) -> list[TensorRole]:
    """The :class:`TensorRole` of every tensor of a model, from its arrays (wire order).

    Floating tensors with ndim >= 1 that are parameters get ``aggregate``; floating buffers with
    ndim >= 1 get ``config.buffer_role``; 0-d or non-floating entries get ``config.scalar_role``
    (the official code excludes 0-d entries from projection). Server and target must
    compute the same roles: they fix the flattened layout of step updates.

    Args:
        arrays: the model's ``state_dict`` arrays (any values; only dtype and shape are read).
        config: supplies ``buffer_role`` and ``scalar_role``.
        is_buffer: one flag per array (True for ``named_buffers`` entries); None = no buffers.

    Returns:
        One role per array.
    """
    if is_buffer is None:
        is_buffer = [False] * len(arrays)
    if len(is_buffer) != len(arrays):
        raise ValueError(f"is_buffer has {len(is_buffer)} flags for {len(arrays)} arrays; need one per array")
    roles = []
    for a, buf in zip(arrays, is_buffer):
        a = np.asarray(a)
        if a.ndim == 0 or not _is_float(a):
            roles.append(config.scalar_role)
        elif buf:
            roles.append(config.buffer_role)
        else:
            roles.append(TensorRole.AGGREGATE)
    return roles


def _check_roles(roles: Sequence[TensorRole | str], arrays: Sequence[np.ndarray]) -> list[TensorRole]:
    if len(roles) != len(arrays):
        raise ValueError(f"roles has {len(roles)} entries for {len(arrays)} tensors; need one per tensor")
    out = [_coerce_enum(TensorRole, r, f"roles[{k}]") for k, r in enumerate(roles)]
    for k, (r, a) in enumerate(zip(out, arrays)):
        a = np.asarray(a)
        if r is TensorRole.AGGREGATE and (a.ndim == 0 or not _is_float(a)):
            raise ValueError(
                f"tensor {k} (shape {a.shape}, dtype {a.dtype}) cannot have role 'aggregate': "
                "only floating tensors with ndim >= 1 can; use 'fedavg' or 'keep'"
            )
    return out


def model_delta(new: Sequence[np.ndarray], old: Sequence[np.ndarray]) -> NDArrays:
    """Per-tensor update new - old (Algorithm 1, step 3: g = h^(r) - h_global^(r-1)).

    Floating tensors give float64 deltas; integer tensors give integer deltas.

    Raises:
        ValueError: mismatched lists/shapes, or NaN/Inf in ``new``.
    """
    _check_layout(old, new, "old", "new")
    out: NDArrays = []
    for k, (n, o) in enumerate(zip(new, old)):
        n, o = np.asarray(n), np.asarray(o)
        _check_finite(n, f"new[{k}]")
        if _is_float(n) or _is_float(o):
            out.append(n.astype(np.float64) - o.astype(np.float64))
        else:
            out.append(n.astype(np.int64) - o.astype(np.int64))
    return out


def apply_update(old: Sequence[np.ndarray], update: Sequence[np.ndarray]) -> NDArrays:
    """old + update, cast to each old tensor's dtype (integers rounded): the new global model.

    Raises:
        ValueError: mismatched lists/shapes, or NaN/Inf in ``update``.
    """
    _check_layout(old, update, "old", "update")
    out: NDArrays = []
    for k, (o, u) in enumerate(zip(old, update)):
        o, u = np.asarray(o), np.asarray(u)
        _check_finite(u, f"update[{k}]")
        new = o.astype(np.float64) + u.astype(np.float64)
        out.append(np.rint(new).astype(o.dtype) if not _is_float(o) else new.astype(o.dtype))
    return out


def flatten_update(
    arrays: Sequence[np.ndarray], roles: Sequence[TensorRole | str], dtype: np.dtype | type = np.float64
) -> np.ndarray:
    """Concatenate the ``aggregate`` tensors of an update into one vector of length m.

    This is the layout of the estimators' vectors (App. A.5 works on the whole
    parameter vector), in wire order.
    """
    r = _check_roles(roles, arrays)
    parts = [np.asarray(a, dtype=dtype).ravel() for a, role in zip(arrays, r) if role is TensorRole.AGGREGATE]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def unflatten_update(vector: np.ndarray, like: Sequence[np.ndarray], roles: Sequence[TensorRole | str]) -> NDArrays:
    """Inverse of :func:`flatten_update`: ``aggregate`` tensors from ``vector`` (in ``like``'s
    shapes and dtypes), every other tensor zero (a zero update).

    Raises:
        ValueError: the vector's length is not the total size of the ``aggregate`` tensors.
    """
    r = _check_roles(roles, like)
    v = np.asarray(vector)
    sizes = [np.asarray(a).size for a, role in zip(like, r) if role is TensorRole.AGGREGATE]
    if v.ndim != 1 or v.size != sum(sizes):
        raise ValueError(f"vector has shape {v.shape}; expected ({sum(sizes)},), the size of the aggregated tensors")
    out: NDArrays = []
    offset = 0
    for a, role in zip(like, r):
        a = np.asarray(a)
        if role is TensorRole.AGGREGATE:
            out.append(v[offset : offset + a.size].reshape(a.shape).astype(a.dtype))
            offset += a.size
        else:
            out.append(np.zeros(a.shape, dtype=a.dtype))
    return out
