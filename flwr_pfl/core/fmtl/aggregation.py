"""Per-task aggregation of the clients' parameters on the server (paper Sec. V-VI).

:func:`aggregate_parameters` combines the body with the body weights (or keeps it) and every head
with its own column of weights, as a :class:`~flwr_pfl.core.fmtl.head_map.HeadMap` describes;
:func:`select_head_arrays` and :func:`merge_head_arrays` handle head-only uploads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flwr_pfl.core.fmtl.checks import _check_weight_vector
from flwr_pfl.core.fmtl.head_map import HeadMap
from flwr_pfl.core.fmtl.participation import HeadAggregationWeights


def _check_client_arrays(
    client_params: Sequence[Sequence[np.ndarray]], current: Sequence[np.ndarray] | None
) -> list[tuple[int, ...]]:
    if len(client_params) < 1:
        raise ValueError("no client parameters to aggregate")
    shapes = [tuple(np.shape(a)) for a in client_params[0]]
    if current is not None and [tuple(np.shape(a)) for a in current] != shapes:
        raise ValueError(
            f"client 0 arrays {shapes} do not match the current parameters "
            f"{[tuple(np.shape(a)) for a in current]}"
        )
    for i, params in enumerate(client_params):
        if len(params) != len(shapes):
            raise ValueError(f"client {i} sent {len(params)} arrays, expected {len(shapes)}")
        for j, a in enumerate(params):
            a = np.asarray(a)
            if a.shape != shapes[j]:
                raise ValueError(f"client {i} array {j} has shape {a.shape}, expected {shapes[j]}")
            if np.issubdtype(a.dtype, np.inexact) and not np.all(np.isfinite(a)):
                raise ValueError(f"client {i} array {j} contains NaN or Inf")
    return shapes


def _affine_combine(
    arrays: Sequence[np.ndarray],
    row_weights: np.ndarray,
    row_anchor: np.ndarray,
    current: np.ndarray | None,
) -> np.ndarray:
    """out[r] = anchor[r] * current[r] + sum_s weights[s, r] * arrays[s][r], computed in float64.

    ``row_weights`` is (S, R) and ``row_anchor`` (R,) with R the number of rows of the arrays, or
    R = 1 for arrays combined as a whole. The result has the clients' dtype (integers rounded).
    """
    first = np.asarray(arrays[0])
    shape, dtype = first.shape, first.dtype
    r = row_weights.shape[1]
    stack = np.stack([np.asarray(a, dtype=np.float64).reshape(r, -1) for a in arrays])
    out = np.einsum("sr,srj->rj", row_weights, stack)
    if np.any(row_anchor != 0):
        if current is None:
            raise ValueError(
                "the current global parameters are needed (a kept head or body, or a delta update)"
            )
        out += row_anchor[:, None] * np.asarray(current, dtype=np.float64).reshape(r, -1)
    out = out.reshape(shape)
    if np.issubdtype(dtype, np.integer):
        out = np.rint(out)
    return out.astype(dtype, copy=False)


def aggregate_parameters(
    client_params: Sequence[Sequence[np.ndarray]],
    head_map: HeadMap,
    head_weights: HeadAggregationWeights,
    body_weights: np.ndarray | None = None,
    current: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Aggregate the representation and every head separately (server side, spec Sec. 3.5 (d)).

    Head c (every piece the map gives it) becomes anchor[c] * current + sum_i client[i, c] *
    client i's piece; arrays and rows no head owns (the body) become the ``body_weights``
    average, or keep their current value when ``body_weights`` is None (phase 2: frozen body).
    Vectorized per array (einsum over clients), accumulated in float64 and returned in the
    clients' dtype.

    Args:
        client_params: S lists of P arrays (same shapes); NaN/Inf are refused, naming the client.
        head_map: which pieces belong to which task; must fit the arrays and have
            M = ``head_weights.client.shape[1]`` tasks.
        head_weights: from :func:`round_head_weights` (or
            :meth:`HeadAggregationWeights.from_beta`), with S rows.
        body_weights: (S,) weights >= 0 summing to 1 (:func:`body_weights`), or None to keep the
            current body.
        current: the current global P arrays; required when the body is kept or any head has a
            non-zero anchor.

    Returns:
        the new global list of P arrays.
    """
    shapes = _check_client_arrays(client_params, current)
    s = len(client_params)
    gamma, anchor = head_weights.client, head_weights.anchor
    if gamma.shape[0] != s:
        raise ValueError(
            f"head weights are for {gamma.shape[0]} clients, got {s} client parameter lists"
        )
    if gamma.shape[1] != head_map.num_tasks:
        raise ValueError(
            f"head map has {head_map.num_tasks} tasks but the head weights have {gamma.shape[1]}"
        )
    if body_weights is not None:
        bw = _check_weight_vector(body_weights, s, "body_weights")
    owners = head_map.row_owners(shapes)
    out = []
    for j, own in enumerate(owners):
        is_head = own >= 0
        w = np.zeros((s, own.shape[0]))
        a = np.zeros(own.shape[0])
        w[:, is_head] = gamma[:, own[is_head]]
        a[is_head] = anchor[own[is_head]]
        if body_weights is None:
            a[~is_head] = 1.0
        else:
            w[:, ~is_head] = bw[:, None]
        out.append(_affine_combine([cp[j] for cp in client_params], w, a,
                                   None if current is None else current[j]))
    return out


def select_head_arrays(arrays: Sequence[np.ndarray], head_map: HeadMap) -> list[np.ndarray]:
    """The arrays a client uploads in phase 2 with ``upload='head_only'`` (head arrays, in order)."""
    head_map.validate([np.shape(a) for a in arrays])
    return [arrays[j] for j in head_map.head_array_indices()]


def merge_head_arrays(
    current: Sequence[np.ndarray], head_arrays: Sequence[np.ndarray], head_map: HeadMap
) -> list[np.ndarray]:
    """Rebuild a full parameter list from the current global one and a head-only upload."""
    head_map.validate([np.shape(a) for a in current])
    idx = head_map.head_array_indices()
    if len(head_arrays) != len(idx):
        raise ValueError(
            f"head-only upload has {len(head_arrays)} arrays, expected {len(idx)} "
            f"(arrays {list(idx)})"
        )
    out = list(current)
    for j, a in zip(idx, head_arrays):
        if np.shape(a) != np.shape(current[j]):
            raise ValueError(f"head array {j} has shape {np.shape(a)}, expected {np.shape(current[j])}")
        out[j] = a
    return out
