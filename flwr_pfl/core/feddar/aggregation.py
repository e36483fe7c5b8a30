"""Server side: the domain re-weighting factors u_m = L / (L_m M) (Sec. 4.1, Eq. 6), the domain
heads by weighted averaging (WA) or second-order aggregation (SA, Eq. 8), and the encoder
average with weights L_i / L.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flwr_pfl.core.aggregation import weighted_average
from flwr_pfl.core.feddar.checks import _count_table, _server_array
from flwr_pfl.core.feddar.options import HeadAggregation, HeadLoss, SAOptions, SASolver, SAWeighting


@dataclass(frozen=True)
class HeadAggregationResult:
    """Aggregated heads and per-domain diagnostics (shape (M,) each, float64 unless stated).

    Attributes:
        heads: new global heads (M, P).
        updated: bool, False where no participating client had samples of the domain (the
            previous head was kept).
        condition_numbers: cond(A) of the summed Hessian (inf when singular; NaN for WA or
            domains not updated).
        min_eigenvalues: smallest eigenvalue of A (NaN for WA or domains not updated).
        damping: absolute lam used by the damped solve (0 otherwise); where the trust region
            bound the step, the raised lam.
        fell_back_to_wa: bool, True where WA replaced SA because cond(A) > cond_threshold.
        trust_bound: bool, True where the damped solve's step was limited by the trust region
            (:attr:`SAOptions.trust_radius`); False for WA, other solvers and unbounded steps.
    """

    heads: np.ndarray
    updated: np.ndarray
    condition_numbers: np.ndarray
    min_eigenvalues: np.ndarray
    damping: np.ndarray
    fell_back_to_wa: np.ndarray
    trust_bound: np.ndarray


def domain_weights(counts) -> np.ndarray:
    """Domain re-weighting factors u_m = L / (L_m M) (Sec. 4.1, Eq. 6).

    With them the federated objective sum_i (L_i/L) R_i equals the domain average
    (1/M) sum_m R_m. A domain with no samples anywhere gets u_m = 0 (spec 9.12); M stays the
    number of predefined domains.

    Args:
        counts: per-domain totals L_m, shape (M,), or the count table L_{i,m}, shape (n, M)
            (summed over clients). Should cover all clients, not only those sampled this round.

    Returns:
        float64 array (M,).
    """
    arr = np.asarray(counts)
    table = _count_table(arr, ndim=arr.ndim if arr.ndim in (1, 2) else 2)
    totals = table if table.ndim == 1 else table.sum(0)
    if totals.sum() == 0:
        raise ValueError("domain_weights needs at least one sample; all counts are zero")
    u = np.zeros_like(totals)
    present = totals > 0
    u[present] = totals.sum() / (totals[present] * totals.shape[0])
    return u


def _head_inputs(local_heads, counts, prev_heads) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate (n, M, P) heads, (n, M) counts and (M, P) previous heads."""
    heads = _server_array("local_heads", local_heads, ndim=3)
    n, m, p = heads.shape
    table = _count_table(counts)
    if table.shape != (n, m):
        raise ValueError(f"counts must have shape (n, M) = {(n, m)} to match local_heads, got {table.shape}")
    prev = _server_array("prev_heads", prev_heads, shape=(m, p))
    return heads, table, prev


def aggregate_heads_wa(local_heads, counts, prev_heads) -> np.ndarray:
    """FedDAR-WA head aggregation: w_m = sum_i (L_{i,m} / L_m) w_{i,m} (Sec. 4.3).

    Args:
        local_heads: w_{i,m}, shape (n, M, P) (absent domains: any finite values, ignored).
        counts: L_{i,m}, shape (n, M).
        prev_heads: previous global heads (M, P), kept for domains with L_m = 0.

    Returns:
        float64 array (M, P).
    """
    heads, table, prev = _head_inputs(local_heads, counts, prev_heads)
    return _wa(heads, table, prev)


def _wa(heads: np.ndarray, table: np.ndarray, prev: np.ndarray) -> np.ndarray:
    """Count-weighted average per domain over clients with L_{i,m} > 0; prev where L_m = 0."""
    out = prev.copy()
    for m in np.flatnonzero(table.sum(0) > 0):
        (out[m],) = weighted_average([[h] for h in heads[:, m]], table[:, m])
    return out


def _spectrum(a: np.ndarray) -> tuple[float, float]:
    """(condition number, smallest eigenvalue) of a symmetric PSD matrix; cond = inf when it is
    numerically singular (smallest eigenvalue <= P * eps * largest)."""
    eig = np.linalg.eigvalsh(a)
    singular = eig[0] <= a.shape[0] * np.finfo(np.float64).eps * max(eig[-1], 0.0)
    return (np.inf if singular else float(eig[-1] / eig[0])), float(eig[0])


def _trust_region_damping(a: np.ndarray, b: np.ndarray, prev: np.ndarray, lam: float, radius: float) -> float:
    """Smallest lam' >= lam with ||(A + lam' I)^{-1} (b - A w_prev)|| <= radius (Levenberg-Marquardt).

    The damped step w - w_prev = (A + lam I)^{-1} (b - A w_prev) shrinks monotonically as lam
    grows (A is PSD), so lam' is found by geometric bisection on the eigen-decomposition of A
    between lam (> 0) and ||b - A w_prev|| / radius, whose step always fits (radius > 0).
    """
    eig, vecs = np.linalg.eigh(a)
    eig = np.clip(eig, 0.0, None)
    resid = vecs.T @ (b - a @ prev)

    def step(x: float) -> float:
        return float(np.linalg.norm(resid / (eig + x)))

    lo, hi = lam, max(lam, float(np.linalg.norm(resid)) / radius)
    if step(lo) <= radius:
        return lam
    for _ in range(200):  # geometric: lam spans many orders of magnitude
        if hi <= lo * (1 + 1e-10):
            break
        mid = float(np.sqrt(lo * hi))
        if step(mid) > radius:
            lo = mid
        else:
            hi = mid
    return hi


def _solve_system(
    a: np.ndarray, b: np.ndarray, prev: np.ndarray, cond: float, options: SAOptions, domain: int,
    radius: float = np.inf,
) -> tuple[np.ndarray, float, bool]:
    """Solve A w = b for one domain per ``options.solver``; returns (w, lam, trust_bound).

    For the damped solver, ``radius`` bounds the step ||w - w_prev|| (:class:`SAOptions`
    ``trust_radius``): when the step with lam = damping * trace(A) / P is longer, lam is raised
    to the smallest value whose step fits (:func:`_trust_region_damping`).
    """
    dim = a.shape[0]
    if options.solver is SASolver.DAMPED and options.damping > 0:
        trace = float(np.trace(a))
        lam = options.damping * (trace / dim if trace > 0 else 1.0)
        w = np.linalg.solve(a + lam * np.eye(dim), b + lam * prev)
        if not np.linalg.norm(w - prev) > radius:
            return w, lam, False
        if radius <= 0:  # no client moved: neither does the head
            return prev.copy(), lam, True
        lam = _trust_region_damping(a, b, prev, lam, radius)
        return np.linalg.solve(a + lam * np.eye(dim), b + lam * prev), lam, True
    if options.solver is SASolver.PINV:
        pinv = np.linalg.pinv(a, rcond=1.0 / options.cond_threshold, hermitian=True)
        return prev + pinv @ (b - a @ prev), 0.0, False
    if not cond <= options.cond_threshold:
        raise ValueError(
            f"domain {domain}: the summed head Hessian is singular or ill-conditioned "
            f"(condition number {cond:.3g} > cond_threshold {options.cond_threshold:g}); "
            "use solver 'damped' (damping > 0) or 'pinv', or fallback_to_wa=True"
        )
    return np.linalg.solve(a, b), 0.0, False


def _solve_domains(
    systems: np.ndarray,
    rhs: np.ndarray,
    active: np.ndarray,
    prev: np.ndarray,
    options: SAOptions,
    wa_heads: np.ndarray | None = None,
    radii: np.ndarray | None = None,
) -> HeadAggregationResult:
    """Per-domain solve of A_m w_m = b_m for active domains, keeping ``prev`` elsewhere; with
    ``options.fallback_to_wa``, domains whose cond(A_m) exceeds the threshold take ``wa_heads``;
    ``radii`` (M,) bound the damped solve's steps (None: unbounded)."""
    num_domains = prev.shape[0]
    heads = prev.copy()
    cond = np.full(num_domains, np.nan)
    low = np.full(num_domains, np.nan)
    lam = np.zeros(num_domains)
    fell_back = np.zeros(num_domains, dtype=bool)
    bound = np.zeros(num_domains, dtype=bool)
    for m in np.flatnonzero(active):
        a = 0.5 * (systems[m] + systems[m].T)
        cond[m], low[m] = _spectrum(a)
        if options.fallback_to_wa and wa_heads is not None and not cond[m] <= options.cond_threshold:
            heads[m], fell_back[m] = wa_heads[m], True
        else:
            radius = np.inf if radii is None else float(radii[m])
            heads[m], lam[m], bound[m] = _solve_system(a, rhs[m], prev[m], cond[m], options, int(m), radius)
    return HeadAggregationResult(heads, active.copy(), cond, low, lam, fell_back, bound)


def _trust_radii(local_heads: np.ndarray, counts: np.ndarray, prev: np.ndarray, options: SAOptions,
                loss: HeadLoss | None = None) -> np.ndarray | None:
    """Per-domain trust radius of SA's damped solve: trust_radius x max_i ||w_{i,m} - w_prev,m||
    over the clients with L_{i,m} > 0 (shape (M,)); None when no trust region applies
    (trust_radius 0, a solver other than damped with damping > 0, or squared-loss heads, whose
    second-order model is exact so that Eq. 8 is pooled least squares).

    Args:
        local_heads: w_{i,m}, shape (n, M, P); counts: L_{i,m}, (n, M); prev: (M, P).
        options: :class:`SAOptions`.
        loss: the head loss the Hessians belong to (None: unknown, treated as non-quadratic).
    """
    if (options.trust_radius <= 0 or options.solver is not SASolver.DAMPED or options.damping <= 0
            or (loss is not None and HeadLoss(loss) is HeadLoss.SQUARED)):
        return None
    steps = np.linalg.norm(local_heads - prev[None], axis=-1)  # (n, M)
    return options.trust_radius * np.where(counts > 0, steps, 0.0).max(0)


def aggregate_heads_sa(
    local_heads, hessians, counts, prev_heads, options: SAOptions = SAOptions(), loss: HeadLoss | None = None
) -> HeadAggregationResult:
    """FedDAR-SA second-order head aggregation (Eq. 8), per domain m:

        w_m = [sum_i alpha_{i,m} H_{i,m}]^{-1} sum_i alpha_{i,m} H_{i,m} w_{i,m}

    over clients with L_{i,m} > 0, with mean-normalised Hessians from :func:`head_statistics`
    and alpha per :class:`SAWeighting` (default alpha_{i,m} = L_{i,m}). For squared loss with
    exact local heads this equals pooled least squares over all clients' domain-m data, even
    when every client alone is underdetermined. Singular sums (softmax heads, tiny domains) are
    handled by ``options.solver`` / ``options.fallback_to_wa`` (spec 9.3). The damped solver
    also keeps each step within ``options.trust_radius`` x the longest local step (a
    Levenberg-Marquardt trust region, not in the paper) unless ``loss`` is squared: for softmax
    heads the summed Hessian has many near-zero eigenvalues and the unbounded Newton step of
    Eq. 8 moves the head arbitrarily far where the clients' quadratic models no longer hold.
    Domains with no samples among the clients keep their previous head.

    Args:
        local_heads: w_{i,m}, shape (n, M, P).
        hessians: H_{i,m}, shape (n, M, P, P) (zero where L_{i,m} = 0); float64 recommended.
        counts: L_{i,m}, shape (n, M).
        prev_heads: previous global heads (M, P).
        options: :class:`SAOptions`.
        loss: the head loss the Hessians belong to; :attr:`HeadLoss.SQUARED` turns the trust
            region off, None (unknown) and the others keep it.

    Returns:
        :class:`HeadAggregationResult` with heads (M, P) and per-domain diagnostics.
    """
    heads, table, prev = _head_inputs(local_heads, counts, prev_heads)
    n, m, p = heads.shape
    hess = _server_array("hessians", hessians, shape=(n, m, p, p))
    if SAWeighting(options.weighting) is SAWeighting.DOMAIN_COUNT:
        alpha = table.copy()
    else:
        alpha = np.where(table > 0, table.sum(1, keepdims=True), 0.0)
    active = alpha.sum(0) > 0
    alpha = alpha / np.where(active, alpha.sum(0), 1.0)
    systems = np.einsum("im,impq->mpq", alpha, hess)
    rhs = np.einsum("im,impq,imq->mp", alpha, hess, heads)
    radii = _trust_radii(heads, table, prev, options, loss)
    return _solve_domains(systems, rhs, active, prev, options, _wa(heads, table, prev), radii)


def aggregate_heads(
    method: HeadAggregation,
    local_heads,
    counts,
    prev_heads,
    hessians=None,
    options: SAOptions = SAOptions(),
    loss: HeadLoss | None = None,
) -> HeadAggregationResult:
    """Server head aggregation of one head phase, WA or SA (Algorithm 1, HEADAGG).

    Args:
        method: :class:`HeadAggregation` (``"wa"`` or ``"sa"``).
        local_heads: (n, M, P); counts: (n, M); prev_heads: (M, P).
        hessians: (n, M, P, P), required for SA, ignored for WA.
        options: :class:`SAOptions` (SA only).
        loss: the head loss (SA only; squared loss needs no trust region, see
            :func:`aggregate_heads_sa`).

    Returns:
        :class:`HeadAggregationResult` (for WA the Hessian diagnostics are NaN).
    """
    method = HeadAggregation(method)
    if method is HeadAggregation.SA:
        if hessians is None:
            raise ValueError("SA head aggregation needs the clients' Hessians (n, M, P, P)")
        return aggregate_heads_sa(local_heads, hessians, counts, prev_heads, options, loss)
    heads, table, prev = _head_inputs(local_heads, counts, prev_heads)
    num_domains = prev.shape[0]
    return HeadAggregationResult(
        heads=_wa(heads, table, prev),
        updated=table.sum(0) > 0,
        condition_numbers=np.full(num_domains, np.nan),
        min_eigenvalues=np.full(num_domains, np.nan),
        damping=np.zeros(num_domains),
        fell_back_to_wa=np.zeros(num_domains, dtype=bool),
        trust_bound=np.zeros(num_domains, dtype=bool),
    )


def aggregate_encoder(client_arrays: Sequence[Sequence[np.ndarray]], num_examples) -> list[np.ndarray]:
    """Representation-phase aggregation phi^t = sum_i (L_i / L) phi_i^t (Algorithm 1; the
    paper's "theta^{t-1}" on the right-hand side is a typo for theta_i^t).

    Args:
        client_arrays: per client, the list of encoder arrays (same shapes across clients),
            all finite.
        num_examples: L_i per client, shape (n,), non-negative integers with a positive sum.

    Returns:
        list of arrays, the weighted averages in each array's dtype
        (:func:`flwr_pfl.core.aggregation.weighted_average`).
    """
    weights = _count_table(num_examples, ndim=1)
    for i, arrays in enumerate(client_arrays):
        for k, array in enumerate(arrays):
            if not np.all(np.isfinite(array)):
                raise ValueError(f"client {i}: encoder array {k} contains NaN or Inf")
    return weighted_average(client_arrays, weights)
