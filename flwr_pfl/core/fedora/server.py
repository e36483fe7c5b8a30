"""Server side: the flattened ``(K, P)`` parameter buffers, the per-round update and new clients.

:class:`ParameterLayout` moves a model's list of arrays in and out of a buffer row;
:func:`server_update` writes the uploaded ``theta_k`` and recomputes every ``theta_hat_k``
(Algorithm 1 line 16); :func:`new_client_auxiliary_model` gives ``theta_hat`` for a client that
joins after training (Algorithm 2 lines 3-5).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from flwr_pfl.core.fedora.graph import PropagationGraph, _graph_rows, _keep_mask
from flwr_pfl.core.fedora.options import GraphOptions, PropagationOptions
from flwr_pfl.core.fedora.propagation import _check_stack, propagate, propagate_iterative
from flwr_pfl.core.fedora.similarity import _stack_subspaces, _sum_of_cosines, validate_subspace


@dataclass(frozen=True)
class ParameterLayout:
    """Shapes and dtypes of a model's list of arrays, to move between lists and flat rows.

    The server keeps two ``(K, P)`` buffers (last-known ``theta_k`` and ``theta_hat_k``); an
    upload is flattened straight into its row and ``theta_hat_k`` is sent as views of its row.
    Integer arrays (e.g. batch-norm counters) are carried as floats and rounded back.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray]) -> ParameterLayout:
        """Layout of a model's list of arrays (e.g. the initial parameters)."""
        arrs = [np.asarray(a) for a in arrays]
        if not arrs:
            raise ValueError("a model needs at least one parameter array")
        return cls(tuple(a.shape for a in arrs), tuple(a.dtype.str for a in arrs))

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        """Values per array. Cached: the server flattens ``K`` uploads per round, and recomputing
        the products per call was most of a round's time at ``K = 100`` (profiled)."""
        return tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

    @cached_property
    def size(self) -> int:
        """``P``, the total number of values."""
        return int(sum(self.sizes))

    def flatten(
        self, arrays: Sequence[np.ndarray], out: np.ndarray | None = None, dtype: np.dtype | type = np.float32
    ) -> np.ndarray:
        """Concatenate ``arrays`` into a ``(P,)`` vector (into ``out``, e.g. a buffer row)."""
        arrs = list(arrays)
        if len(arrs) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} arrays, got {len(arrs)}")
        target = np.empty(self.size, dtype=dtype) if out is None else out
        if target.shape != (self.size,):
            raise ValueError(f"out must have shape ({self.size},), got {target.shape}")
        start = 0
        for i, (a, shape, n) in enumerate(zip(arrs, self.shapes, self.sizes)):
            a = np.asarray(a)
            if a.shape != shape:
                raise ValueError(f"array {i} has shape {a.shape}, expected {shape}")
            target[start : start + n] = a.reshape(-1)
            start += n
        return target

    def unflatten(self, vector: np.ndarray) -> list[np.ndarray]:
        """Split a ``(P,)`` vector into arrays of the layout (views when the dtype matches)."""
        v = np.asarray(vector)
        if v.shape != (self.size,):
            raise ValueError(f"vector must have shape ({self.size},), got {v.shape}")
        result, start = [], 0
        for shape, n, dt in zip(self.shapes, self.sizes, self.dtypes):
            piece = v[start : start + n].reshape(shape)
            target = np.dtype(dt)
            if piece.dtype != target:
                piece = np.rint(piece).astype(target) if target.kind in "iub" else piece.astype(target)
            result.append(piece)
            start += n
        return result


def init_server_buffers(
    theta0: np.ndarray, num_clients: int, dtype: np.dtype | type = np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """Initial ``(Theta, Theta_hat)`` buffers: every row is ``theta^0`` (Algorithm 1 lines 6-7).

    Returns two separate ``(K, P)`` arrays (``2 K P`` values in all: the server's whole state
    besides the ``K x K`` matrices).
    """
    v = np.asarray(theta0).reshape(-1)
    if num_clients < 1:
        raise ValueError(f"num_clients={num_clients} must be >= 1")
    if not np.all(np.isfinite(v)):
        raise ValueError("theta0 contains NaN or Inf")
    theta = np.empty((num_clients, v.size), dtype=dtype)
    theta[...] = v
    return theta, theta.copy()


def validate_upload(client: int, vector: np.ndarray, num_params: int) -> np.ndarray:
    """Check one uploaded flat ``theta_k``: shape ``(P,)`` and finite values.

    Raises:
        ValueError: naming the client, the expected shape, or the non-finite count.
    """
    v = np.asarray(vector)
    if v.shape != (num_params,):
        raise ValueError(f"client {client}: upload has shape {v.shape}, expected ({num_params},)")
    bad = int(np.size(v) - np.count_nonzero(np.isfinite(v)))
    if bad:
        raise ValueError(f"client {client}: upload has {bad} NaN/Inf values; it is rejected")
    return v


def server_update(
    theta: np.ndarray,
    theta_hat: np.ndarray,
    uploads: Mapping[int, np.ndarray],
    graph: PropagationGraph,
    options: PropagationOptions = PropagationOptions(),
    *,
    frozen: Sequence[int] = (),
) -> np.ndarray:
    """One server round (Algorithm 1 lines 14-16), in place on the two ``(K, P)`` buffers.

    1. Every upload ``theta_k`` (flat ``(P,)``) is validated, then copied into row k of ``theta``.
       Clients that did not participate keep their last-known ``theta_k`` (partial
       participation; spec 9.12): Eq. 6 always sees all ``K`` rows.
    2. ``theta_hat`` is recomputed for every client by Eq. 6 (``options.solver =
       "closed_form"``, with ``graph.propagation``) or Eq. 7. Rows listed in ``frozen`` (e.g.
       clients whose round failed; spec 8.3) keep their previous ``theta_hat``.

    All uploads are validated before anything is written, so a bad upload leaves both buffers
    untouched. ``graph.kappa`` must equal ``options.kappa``.

    Args:
        theta: ``(K, P)`` last-known personalized models (modified in place).
        theta_hat: ``(K, P)`` auxiliary models (modified in place), separate from ``theta``.
        uploads: client index -> flat ``(P,)`` ``theta_k``.
        graph: from :func:`build_propagation_graph`.
        options: solver settings.
        frozen: client indices whose ``theta_hat`` is kept.

    Returns:
        The sorted indices of the clients whose uploads were written.
    """
    k_total = graph.num_clients
    theta = _check_stack(theta, k_total)
    if abs(graph.kappa - options.kappa) > 1e-12:
        raise ValueError(f"graph was built with kappa={graph.kappa} but options.kappa="
                         f"{options.kappa}; rebuild the graph or pass matching options")
    checked = {}
    for k, vec in uploads.items():
        if not isinstance(k, (int, np.integer)) or not 0 <= int(k) < k_total:
            raise ValueError(f"upload key {k!r} is not a client index in [0, {k_total})")
        checked[int(k)] = validate_upload(int(k), vec, theta.shape[1])
    for k, vec in checked.items():
        theta[k] = vec
    frozen_set = {int(k) for k in frozen}
    rows = None if not frozen_set else [k for k in range(k_total) if k not in frozen_set]
    if options.solver == "closed_form":
        propagate(theta, graph.propagation, out=theta_hat, rows=rows)
    else:
        propagate_iterative(theta, graph.transition, options.kappa, options.num_iterations,
                            out=theta_hat, rows=rows)
    return np.array(sorted(checked), dtype=np.int64)


def new_client_auxiliary_model(
    new_subspace: np.ndarray,
    subspaces: Sequence[np.ndarray | None],
    theta_hat: np.ndarray,
    graph: GraphOptions = GraphOptions(),
    *,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Auxiliary model for a client that joins after training (Algorithm 2 lines 3-5).

    The paper says "via Eq. (6)" but Eq. 6 needs the new client's own ``theta``, which does not
    exist yet; this uses one propagation hop from the new node (spec 3.5):
    ``theta_hat_new = sum_k P_new,k theta_hat_k``, with ``P_new`` the new client's row of
    similarities to the old clients, through the same transform and top-k rule as the graph
    (self-loops do not apply). An unlabeled client uses it as its model (covariate shift; all
    subspaces must then be feature-only); a labeled client trains from it with Eq. 9.

    Args:
        new_subspace: ``(d, p)`` orthonormal basis of the new client.
        subspaces: the ``K`` old clients' bases (None for missing ones).
        theta_hat: ``(K, P)`` the old clients' auxiliary models.
        graph: the options used for the old clients' graph.
        out: optional ``(P,)`` output of ``theta_hat``'s dtype.

    Returns:
        ``(theta_hat_new, weights)``: ``(P,)`` and the ``(K,)`` row ``P_new`` (sums to 1).
    """
    k_total = len(subspaces)
    th = _check_stack(theta_hat, k_total, "theta_hat")
    stack, present = _stack_subspaces(subspaces, atol=1e-5)
    new = validate_subspace(new_subspace, p=stack.shape[2], dim=stack.shape[1], client="new")
    row = np.zeros((1, k_total))
    row[0, present] = _sum_of_cosines(new[None], stack[present])[0]
    keep = _keep_mask(row, present[None, :], graph.top_k)
    _, p_row, isolated = _graph_rows(row, keep, graph)
    if isolated[0]:
        raise ValueError("the new client has no weighted neighbour among the old clients "
                         "(all missing, or all similarities zero under the identity transform)")
    weights = p_row[0]
    target = np.empty(th.shape[1], dtype=th.dtype) if out is None else out
    if target.shape != (th.shape[1],) or target.dtype != th.dtype:
        raise ValueError(f"out must have shape ({th.shape[1]},) and dtype {th.dtype}")
    np.matmul(weights.astype(th.dtype), th, out=target)
    return target, weights
