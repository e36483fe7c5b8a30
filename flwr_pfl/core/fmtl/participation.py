"""Head aggregation weights of one partially participating round (not covered by the paper).

The paper's weights are defined over all N clients; :func:`round_head_weights` adapts them to
the round's participants S_t under a :class:`~flwr_pfl.core.fmtl.options.ParticipationPolicy`
(round-local, renormalized population weights, or the unbiased delta update) and applies the
:class:`~flwr_pfl.core.fmtl.options.EmptyHolderPolicy` to heads no participant holds. The result,
:class:`HeadAggregationWeights`, is an affine combination of the clients' heads and the current one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flwr_pfl.core.fmtl.checks import _SUM_TOL, ArrayLike, _check_membership
from flwr_pfl.core.fmtl.options import EmptyHolderPolicy, FMTLWeightingOptions, ParticipationPolicy
from flwr_pfl.core.fmtl.statistics import TaskStatistics
from flwr_pfl.core.fmtl.weights import head_weight_matrix


def _renormalize_columns(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Divide every column of ``w`` (K, M) by its sum; return it and the mask of zero-sum columns."""
    sums = w.sum(axis=0)
    zero = sums <= 0
    out = np.zeros_like(w)
    out[:, ~zero] = w[:, ~zero] / sums[~zero]
    return out, zero


@dataclass(frozen=True)
class HeadAggregationWeights:
    """Per-head affine aggregation weights of one round.

    New head c = anchor[c] * current head c + sum_i client[i, c] * client i's head c, with
    sum_i client[i, c] + anchor[c] = 1 for every c (validated). A plain weighted average has
    anchor 0; a kept head has client weights 0 and anchor 1; the unbiased-delta policy has
    anchor 1 - sum_i client[i, c].

    Attributes:
        client: (S, M) weights of the participants.
        anchor: (M,) weight of the current global head.
        skipped: (M,) bool, heads kept because the policy had nothing to average.
        membership: (S, M) bool holder mask of the participants (for logging).
    """

    client: np.ndarray
    anchor: np.ndarray
    skipped: np.ndarray
    membership: np.ndarray

    def __post_init__(self) -> None:
        client = np.asarray(self.client, dtype=np.float64)
        anchor = np.asarray(self.anchor, dtype=np.float64)
        if client.ndim != 2:
            raise ValueError(f"client weights must have shape (S, M), got {client.shape}")
        s, m = client.shape
        if anchor.shape != (m,) or np.asarray(self.skipped).shape != (m,):
            raise ValueError(f"anchor and skipped must have shape ({m},)")
        if np.asarray(self.membership).shape != (s, m):
            raise ValueError(f"membership must have shape ({s}, {m})")
        if not (np.all(np.isfinite(client)) and np.all(np.isfinite(anchor))):
            raise ValueError("aggregation weights contain NaN or Inf")
        total = client.sum(axis=0) + anchor
        bad = np.flatnonzero(np.abs(total - 1.0) > _SUM_TOL)
        if bad.size:
            raise ValueError(
                f"weights of head(s) {bad.tolist()} sum to {total[bad].tolist()} (client weights "
                "plus anchor must sum to 1)"
            )
        object.__setattr__(self, "client", client)
        object.__setattr__(self, "anchor", anchor)
        object.__setattr__(self, "skipped", np.asarray(self.skipped, dtype=bool))
        object.__setattr__(self, "membership", np.asarray(self.membership, dtype=bool))

    @classmethod
    def from_beta(
        cls, beta: np.ndarray, membership: np.ndarray | None = None
    ) -> HeadAggregationWeights:
        """Plain per-head weighted averages: ``beta`` (S, M) with columns summing to 1."""
        beta = np.asarray(beta, dtype=np.float64)
        if beta.ndim != 2:
            raise ValueError(f"beta must have shape (S, M), got {beta.shape}")
        if np.any(beta < 0):
            raise ValueError("beta must be >= 0")
        mem = np.ones(beta.shape, dtype=bool) if membership is None else membership
        return cls(beta, np.zeros(beta.shape[1]), np.zeros(beta.shape[1], dtype=bool), mem)

    @property
    def holder_count(self) -> np.ndarray:
        """(M,) |I^c intersected with S_t|."""
        return self.membership.sum(axis=0)

    @property
    def holders_weight(self) -> np.ndarray:
        """(M,) total client weight on participating holders of each head."""
        return (self.client * self.membership).sum(axis=0)


def round_head_weights(
    membership: np.ndarray,
    options: FMTLWeightingOptions | None = None,
    *,
    num_examples: ArrayLike | Sequence[float] | None = None,
    statistics: Sequence[TaskStatistics] | None = None,
    population_beta: np.ndarray | None = None,
    participant_ids: Sequence[int] | np.ndarray | None = None,
) -> HeadAggregationWeights:
    """Head aggregation weights of one (possibly partial) round (spec Sec. 3.5 (d) and P1).

    * ``ROUND_LOCAL`` (default): :func:`head_weight_matrix` on the participants (N -> |S_t|,
      I^c -> I^c intersected with S_t). Needs ``num_examples`` / ``statistics`` of the
      participants when the scheme uses them.
    * ``POPULATION_RENORM`` / ``POPULATION_UNBIASED_DELTA``: need ``population_beta`` (N, M),
      computed by :func:`head_weight_matrix` on the registered population, and the
      ``participant_ids`` (S,) of the participants' rows in it.

    Then the :class:`EmptyHolderPolicy` is applied to heads no participant holds.

    Args:
        membership: (S, M) bool holder mask of the participants.
        options: scheme and policies (default :class:`FMTLWeightingOptions`).
        num_examples: (S,) n_i of the participants (``ROUND_LOCAL`` with ``NUM_EXAMPLES`` or
            ``FMTL_EQ10``).
        statistics: S :class:`TaskStatistics` (``ROUND_LOCAL`` with ``FMTL_EQ10``).
        population_beta: (N, M) population weights (population policies only).
        participant_ids: (S,) distinct row indices into ``population_beta``.

    Returns:
        :class:`HeadAggregationWeights` for :func:`aggregate_parameters`.
    """
    options = options if options is not None else FMTLWeightingOptions()
    membership = _check_membership(membership)
    s, m = membership.shape
    policy = options.participation
    if policy is ParticipationPolicy.ROUND_LOCAL:
        if population_beta is not None or participant_ids is not None:
            raise ValueError(
                "population_beta / participant_ids are used only by the population policies "
                "('population_renorm', 'population_unbiased_delta'), not by 'round_local'"
            )
        base = head_weight_matrix(
            membership, options.scheme, num_examples=num_examples, statistics=statistics,
            eq10=options.eq10,
        )
        client = base.copy()
        anchor = np.zeros(m)
        fallback, zero = _renormalize_columns(base)
    else:
        if num_examples is not None or statistics is not None:
            raise ValueError(
                "num_examples / statistics are used only by 'round_local'; the population "
                "policies take population_beta (computed with head_weight_matrix)"
            )
        if population_beta is None or participant_ids is None:
            raise ValueError(
                f"participation policy {policy.value!r} needs population_beta and participant_ids"
            )
        pop = np.asarray(population_beta, dtype=np.float64)
        if pop.ndim != 2 or pop.shape[1] != m:
            raise ValueError(f"population_beta must have shape (N, {m}), got {pop.shape}")
        if not np.all(np.isfinite(pop)) or np.any(pop < 0):
            raise ValueError("population_beta must be finite and >= 0")
        sums = pop.sum(axis=0)
        if np.any((np.abs(sums - 1.0) > _SUM_TOL) & (sums != 0)):
            raise ValueError("every column of population_beta must sum to 1 (or be all 0)")
        ids = np.asarray(participant_ids, dtype=np.int64).reshape(-1)
        n_pop = pop.shape[0]
        if ids.shape != (s,) or np.unique(ids).size != s or ids.min() < 0 or ids.max() >= n_pop:
            raise ValueError(
                f"participant_ids must be {s} distinct row indices in [0, {n_pop}), got {ids.tolist()}"
            )
        restricted = pop[ids]
        fallback, zero = _renormalize_columns(restricted)
        if policy is ParticipationPolicy.POPULATION_RENORM:
            client = fallback.copy()
            anchor = np.zeros(m)  # zero-sum columns are kept below
        else:
            client = (n_pop / s) * restricted
            anchor = 1.0 - client.sum(axis=0)
    skipped = zero.copy()
    empty = ~membership.any(axis=0)
    if empty.any():
        if options.empty_holder is EmptyHolderPolicy.ERROR:
            raise ValueError(
                f"no participant holds task(s) {np.flatnonzero(empty).tolist()}; empty-holder "
                "policy 'error' (allowed: keep, renormalize, error)"
            )
        if options.empty_holder is EmptyHolderPolicy.KEEP:
            skipped |= empty
        else:  # RENORMALIZE
            client[:, empty] = fallback[:, empty]
            anchor[empty] = 0.0
    # Heads with nothing to average keep their value.
    client[:, skipped] = 0.0
    anchor[skipped] = 1.0
    return HeadAggregationWeights(client, anchor, skipped, membership)
