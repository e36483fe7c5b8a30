"""FedAvg + FMTL (Liu, Yang and Shen, ISIT 2023): FedAvg rounds, then head-only rounds in which
every task's head is aggregated with its own client weights (eq. 12 by default).

The mathematics (weights, policies, per-head aggregation) is in :mod:`flwr_pfl.core.fmtl`; this
module only moves arrays between Flower and it and keeps the server's state.

Wire layout (P = number of model arrays in ``state_dict`` order; H = the head arrays of the head
map, in order; M = number of tasks)
--------------------------------------------------------------------------------------------------
* fit instruction, every round: the P global arrays; config ``server-round``, ``fmtl-phase``
  (1 = FedAvg on the whole model, rounds <= t1_rounds; 2 = body frozen, heads only),
  ``fmtl-upload`` (``full`` | ``head_only``), ``fmtl-stats`` (bool: send feature statistics for
  the eq. (10) weights; true only in phase 2 with ``fmtl_eq10`` for clients whose statistics the
  server does not hold yet).
* fit reply: the model arrays (P arrays in phase 1 and with ``upload=full``; the H head arrays in
  phase 2 with ``upload=head_only``), then ``task_counts`` n_i^c, shape (M,), integers, summing to
  ``num_examples``; then, when asked for, the 3 or 4 arrays of ``TaskStatistics.to_arrays()``
  (tasks (m_i,), counts (m_i,), second moments (m_i, k, k)[, cross moments (m_i, k)]).
  Metrics: ``partition_id``, ``train_loss``, ``train_seconds``, ``n_stats_arrays`` (0, 3 or 4).
* evaluate instruction / reply: the P global arrays; the reply's loss and ``accuracy`` of the
  global model on the client's test split (the paper's metric: one global model, no
  personalization).

Server state: the global arrays, the head map, the registry partition -> task counts (for the
population policies and logging), cached per-client ``TaskStatistics`` (eq. 10) and the weights
of every phase-2 round (``weight_history``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common import FitIns, FitRes, Parameters, log, parameters_to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from flwr_pfl.core.aggregation import weighted_average
from flwr_pfl.core.fmtl import (
    Augmentation,
    BodyWeighting,
    HeadAggregationWeights,
    HeadMap,
    HeadWeighting,
    FMTLWeightingOptions,
    ParticipationPolicy,
    TaskStatistics,
    aggregate_parameters,
    body_weights,
    head_weight_matrix,
    merge_head_arrays,
    round_head_weights,
    task_membership,
)
from flwr_pfl.errors import ConfigError, ReplyError
from flwr_pfl.strategies.base import NDArrays, PFLStrategy
from flwr_pfl.strategies.decode import decode_arrays
from flwr_pfl.strategies.validation import ClientReply, Scalar, check_arrays

HEAD_LAYOUTS = ("stacked", "per-head")
UPLOADS = ("full", "head_only")


@dataclass(frozen=True)
class FMTLReply(ClientReply):
    """A validated FMTL fit reply: the model arrays (full list, or heads only), the task counts
    n_i^c, the holder mask (None when the client holds no task) and optional statistics."""

    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    membership: np.ndarray | None = None
    statistics: TaskStatistics | None = None

    @property
    def key(self) -> str:
        """Registry key: the partition id, or the Flower node id when there is none."""
        return f"p{self.partition_id}" if self.partition_id >= 0 else f"c{self.cid}"


def head_map_from_shapes(shapes: list[tuple[int, ...]], layout: str, num_tasks: int = 0) -> HeadMap:
    """The head map of an encoder + heads model from its array shapes (``state_dict`` order).

    * ``stacked``: one ``Linear(k, M)`` at the end; task c = row c of its weight (M, k) and entry
      c of its bias (M,) (spec P4). M is read from the weight.
    * ``per-head``: M heads ``Linear(k, 1)`` at the end; task c owns head c's weight (1, k) and
      bias (1,). M = ``num_tasks`` (or, when 0, every trailing (1, k)/(1,) group).

    Raises:
        ValueError: the shapes do not end in such a layout, or M does not match ``num_tasks``.
    """
    if layout not in HEAD_LAYOUTS:
        raise ValueError(f"head layout {layout!r} is unknown; allowed: {', '.join(HEAD_LAYOUTS)}")
    p = len(shapes)
    if p == 0:
        raise ValueError("the model has no arrays; FMTL needs a body and task heads")
    if layout == "stacked":
        if len(shapes[-1]) == 1 and p >= 2 and len(shapes[-2]) == 2 and shapes[-2][0] == shapes[-1][0]:
            head_map = HeadMap.stacked_linear(shapes[-1][0], p - 2, p - 1)
        elif len(shapes[-1]) == 2:
            head_map = HeadMap.stacked_linear(shapes[-1][0], p - 1, None)
        else:
            raise ValueError(
                f"head layout 'stacked' needs the model to end in a Linear(k, M) layer; its last "
                f"arrays have shapes {shapes[-2:]}"
            )
    else:
        with_bias = len(shapes[-1]) == 1
        width = 2 if with_bias else 1
        groups: list[list[int]] = []
        j = p
        while j - width >= 0 and (num_tasks == 0 or len(groups) < num_tasks):
            w = shapes[j - width]
            if len(w) != 2 or w[0] != 1 or (with_bias and tuple(shapes[j - 1]) != (1,)):
                break
            groups.insert(0, list(range(j - width, j)))
            j -= width
        if not groups or j == 0:
            raise ValueError(
                f"head layout 'per-head' needs a body followed by M heads Linear(k, 1); the "
                f"arrays have shapes {shapes}"
            )
        head_map = HeadMap.per_task_arrays(groups)
    if num_tasks and head_map.num_tasks != num_tasks:
        raise ValueError(
            f"the model's head has {head_map.num_tasks} tasks but num_tasks={num_tasks}"
        )
    if not head_map.body_array_indices(p):
        raise ValueError("FMTL needs a body (representation) besides the heads; the model has none")
    return head_map


class FedFMTL(PFLStrategy):
    """FedAvg+FMTL (paper Sec. V-VI): FedAvg/FedProx for ``t1_rounds`` rounds, then head-only
    rounds whose heads are aggregated per task with :func:`~flwr_pfl.core.fmtl.round_head_weights`.

    Args:
        t1_rounds: phase-1 (FedAvg) rounds T1 (paper: 100 of 110). 0 = phase 2 from round 1 (a
            known or pretrained representation, the theory's setting). None = the first half of
            the run's rounds, rounded up (needs ``num_rounds``, or the Message API's
            ``start()``). Must be below the run's rounds (:meth:`check_phases`).
        weighting: head weights (default eq. 12), participation policy (default ``round_local``,
            spec P1 (a)), empty-holder policy (default ``keep``) and eq. (10) solver settings.
        body_weighting: client weights of phase 1 (default ``uniform``, the FedRep code).
        augmentation: the clients' setting, used only to warn when eq. (12)/(10) weights meet
            non-augmented training (non-holders then return head c unchanged, spec Sec. 8.1).
        min_count: a client holds task c when n_i^c >= min_count (spec P9).
        upload: phase-2 replies carry the head arrays only (``head_only``, default) or all
            arrays (``full``).
        head_layout / num_tasks / head_map: the heads. By default the map is read from the model's
            shapes (``head_layout``: ``stacked`` one Linear(k, M); ``per-head`` M Linear(k, 1));
            an explicit :class:`HeadMap` overrides it. A map that does not fit the model stops
            the run at the first round with a ValueError.
        phase2_fraction_fit: fraction of clients sampled in phase-2 rounds (0 = fraction_fit;
            1.0 = full participation, spec P1 (d)).
        **kwargs: :class:`PFLStrategy`'s arguments.
    """

    name = "fmtl"

    def __init__(
        self,
        *,
        t1_rounds: int | None = 100,
        weighting: FMTLWeightingOptions | None = None,
        body_weighting: BodyWeighting | str = BodyWeighting.UNIFORM,
        augmentation: Augmentation | str = Augmentation.AUGMENTED,
        min_count: int = 1,
        upload: str = "head_only",
        head_layout: str = "stacked",
        num_tasks: int = 0,
        head_map: HeadMap | None = None,
        phase2_fraction_fit: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if t1_rounds is not None and t1_rounds < 0:
            raise ValueError(f"t1_rounds must be >= 0 or None (half the rounds), got {t1_rounds}")
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        if upload not in UPLOADS:
            raise ValueError(f"upload={upload!r} is unknown; allowed: {', '.join(UPLOADS)}")
        if head_layout not in HEAD_LAYOUTS:
            raise ValueError(f"head_layout={head_layout!r} is unknown; allowed: {', '.join(HEAD_LAYOUTS)}")
        if not 0.0 <= phase2_fraction_fit <= 1.0:
            raise ValueError(f"phase2_fraction_fit must be in [0, 1], got {phase2_fraction_fit}")
        #: as given (None: half the run's rounds, resolved by :meth:`check_phases`)
        self.t1_given = t1_rounds
        self.t1_rounds = t1_rounds if t1_rounds is not None else 0
        self.weighting = weighting or FMTLWeightingOptions()
        self.body_weighting = BodyWeighting(body_weighting)
        self.augmentation = Augmentation(augmentation)
        self.min_count = min_count
        self.upload = upload
        self.head_layout = head_layout
        self.num_tasks = num_tasks
        self.head_map = head_map
        self.phase2_fraction_fit = phase2_fraction_fit
        self.registry: dict[str, np.ndarray] = {}  # partition -> task counts (M,)
        self.statistics: dict[str, TaskStatistics] = {}  # partition -> eq. (10) statistics
        self.weight_history: list[dict[str, Any]] = []
        self._population_cache: tuple[tuple[str, ...], np.ndarray] | None = None
        self._last_weights: HeadAggregationWeights | None = None
        scheme = self.weighting.scheme
        if self.augmentation is Augmentation.ORIGINAL and scheme in (HeadWeighting.FMTL_EQ12, HeadWeighting.FMTL_EQ10):
            log(WARNING, "fmtl: head weighting %r with augmentation 'original': non-holders return "
                "head c unchanged, so their weight only damps the holders' update (spec Sec. 8.1); "
                "use augmentation 'augmented' or head weighting 'ew_holders'", scheme.value)
        if self.num_rounds:
            self.check_phases()
        log(INFO, "fmtl: phase 1 (FedAvg, %s body weights) for rounds 1..%s, then heads only; head "
            "weighting %s, participation policy %s, empty-holder policy %s, upload %s, min count %d",
            self.body_weighting.value, "half the run" if t1_rounds is None else t1_rounds, scheme.value, self.weighting.participation.value,
            self.weighting.empty_holder.value, upload, min_count)

    def __repr__(self) -> str:
        return (f"FedFMTL(num_clients={self.num_clients}, t1_rounds={self.t1_rounds}, "
                f"weighting={self.weighting.scheme.value}, participation={self.weighting.participation.value})")

    # ---------------------------------------------------------------- schedule and instructions
    def check_phases(self) -> None:
        """Resolve ``t1_rounds=None`` to the first half of the run's rounds (rounded up), and
        refuse a phase 1 longer than the run: every round would be plain FedAvg, and FMTL's
        head-only rounds (the method) would never run. A phase 1 of exactly the run's rounds is
        FMTL's phase 1 alone (the papers' FedAvg / FedProx baseline runs it so), and is logged
        as such. Called when the run's rounds are known: at construction with ``num_rounds``,
        else (Message API) when ``start()`` has told them, before round 1's instructions.

        Raises:
            ConfigError: ``t1_rounds`` > ``num_rounds`` (naming both, and the run-config keys).
            NumRoundsRequired: ``t1_rounds=None`` and the run's rounds are unknown.
        """
        if self.t1_given is None:
            self.require_num_rounds("t1_rounds=None (half of the run's rounds)", "give t1_rounds")
            self.t1_rounds = max(1, (self.num_rounds + 1) // 2) if self.num_rounds > 1 else 0
            return
        if not self.num_rounds or self.t1_rounds < self.num_rounds:
            return
        if self.t1_rounds == self.num_rounds:
            log(WARNING, "FedFMTL: t1_rounds=%d (run config fmtl.t1-rounds) equals the run's rounds: every round is "
                "phase 1, FedAvg (FedProx with a proximal term), and no head-only round runs", self.t1_rounds)
            return
        raise ConfigError(
            f"FedFMTL: t1_rounds={self.t1_rounds} (run config fmtl.t1-rounds) exceeds the run's {self.num_rounds} "
            f"rounds (num_rounds, num-server-rounds): every round would be phase 1, plain FedAvg, and FMTL's "
            f"head-only rounds would never run. Set t1_rounds below num_rounds (the paper: 100 of 110; e.g. "
            f"{max(self.num_rounds - max(self.num_rounds // 10, 1), 0)} of {self.num_rounds}), or 0 for heads only "
            "from round 1"
        )

    def phase(self, server_round: int) -> int:
        """1 (FedAvg) for global rounds <= t1_rounds, else 2 (heads only)."""
        return 1 if self.run_round(server_round) <= self.t1_rounds else 2

    def _ensure_head_map(self) -> HeadMap:
        shapes = [tuple(a.shape) for a in (self.global_arrays or [])]
        if self.head_map is None:
            self.head_map = head_map_from_shapes(shapes, self.head_layout, self.num_tasks)
        self.head_map.validate(shapes)  # a map that does not fit the model stops here
        if not self.head_map.body_array_indices(len(shapes)) and self.t1_rounds > 0:
            log(WARNING, "fmtl: the head map covers every array; phase 1 trains heads only")
        return self.head_map

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        if self.global_arrays is None:
            self.global_arrays = parameters_to_ndarrays(parameters)
        if server_round == 1:  # the Message API's start() tells num_rounds after construction
            self.check_phases()
        self._ensure_head_map()
        fraction = self.fraction_fit
        if self.phase(server_round) == 2 and self.phase2_fraction_fit > 0:
            fraction = self.phase2_fraction_fit
        clients = self._sample(client_manager, server_round, fraction, self.min_fit_clients)
        return self.fit_instructions(server_round, parameters, clients)

    def fit_instructions(
        self, server_round: int, parameters: Parameters, clients: list[ClientProxy]
    ) -> list[tuple[ClientProxy, FitIns]]:
        phase = self.phase(server_round)
        want_stats = phase == 2 and self.weighting.scheme is HeadWeighting.FMTL_EQ10
        out = []
        for proxy in clients:
            key = f"p{self.partition_of[proxy.cid]}" if proxy.cid in self.partition_of else None
            protocol: dict[str, Scalar] = {
                "fmtl-phase": phase,
                "fmtl-upload": self.upload if phase == 2 else "full",
                "fmtl-stats": bool(want_stats and (key is None or key not in self.statistics)),
            }
            out.append((proxy, FitIns(parameters, self.fit_config(server_round, protocol))))
        return out

    # ---------------------------------------------------------------- replies
    def expected_shapes(self, server_round: int) -> list[tuple[int, ...]]:
        shapes = [tuple(a.shape) for a in (self.global_arrays or [])]
        head_map = self._ensure_head_map()
        if self.phase(server_round) == 2 and self.upload == "head_only":
            shapes = [shapes[j] for j in head_map.head_array_indices()]
        return shapes + [(head_map.num_tasks,)]

    def expected_dtypes(self, server_round: int) -> list[np.dtype | None]:
        """The dtypes of :meth:`expected_shapes`' model arrays, then any real dtype for the task counts."""
        dtypes: list[np.dtype | None] = [np.asarray(a).dtype for a in (self.global_arrays or [])]
        if self.phase(server_round) == 2 and self.upload == "head_only":
            dtypes = [dtypes[j] for j in self._ensure_head_map().head_array_indices()]
        return dtypes + [None]

    def check_reply(self, server_round: int, proxy: ClientProxy, res: FitRes) -> FMTLReply:
        partition_id = self.check_partition(proxy.cid, res.metrics.get("partition_id", -1))
        who = f"{proxy.cid} (partition {partition_id})"
        arrays = decode_arrays(res.parameters)
        n_stats = res.metrics.get("n_stats_arrays", 0)
        if not isinstance(n_stats, int) or isinstance(n_stats, bool) or n_stats not in (0, 3, 4) or n_stats > len(arrays):
            raise ReplyError(f"client {who}: n_stats_arrays={n_stats!r}; must be 0, 3 or 4")
        model_part, stats_part = arrays[: len(arrays) - n_stats], arrays[len(arrays) - n_stats:]
        check_arrays(who, model_part, self.expected_shapes(server_round), res.num_examples,
                     self.expected_dtypes(server_round))
        for i, array in enumerate(stats_part):
            if array.dtype.kind not in "fiu" or (array.dtype.kind == "f" and not np.all(np.isfinite(array))):
                raise ReplyError(f"client {who}: feature statistics array {i} is {array.dtype} with non-finite or "
                                 "non-real values; statistics are finite real numbers")
        counts = model_part[-1]
        if not np.issubdtype(counts.dtype, np.integer) or np.any(counts < 0):
            raise ReplyError(f"client {who}: task counts must be non-negative integers, got {counts!r}")
        if int(counts.sum()) != res.num_examples:
            raise ReplyError(
                f"client {who}: task counts sum to {int(counts.sum())} but num_examples is {res.num_examples}"
            )
        phase = self.phase(server_round)
        try:
            membership = task_membership(counts, self.min_count)
        except ValueError as err:
            if phase == 2:
                raise ReplyError(f"client {who}: {err}; its head weights are undefined (eq. 12)") from None
            membership = None  # phase 1 is plain FedAvg; the client is not registered
        statistics = None
        if n_stats:
            k = self._feature_dim()
            try:
                statistics = TaskStatistics.from_arrays(stats_part, num_tasks=self.head_map.num_tasks, dim=k)
            except ValueError as err:
                raise ReplyError(f"client {who}: bad feature statistics: {err}") from None
            if not np.array_equal(statistics.counts, counts[statistics.tasks]) or statistics.tasks.size != np.count_nonzero(counts):
                raise ReplyError(f"client {who}: feature statistics do not match its task counts")
        if partition_id >= 0:
            self.partition_of[proxy.cid] = partition_id
        return FMTLReply(proxy.cid, partition_id, res.num_examples, model_part[:-1], dict(res.metrics),
                         counts=counts.astype(np.int64), membership=membership, statistics=statistics)

    def _feature_dim(self) -> int | None:
        """k, from the first head's weight (rows of a stacked layer or a (1, k) head)."""
        head_map = self.head_map
        assert head_map is not None and self.global_arrays is not None
        first = head_map.slices[0][0]
        shape = self.global_arrays[first.array].shape
        return int(shape[-1]) if len(shape) == 2 else None

    # ---------------------------------------------------------------- aggregation
    def aggregate_replies(self, server_round: int, replies: list[ClientReply]) -> NDArrays:
        fmtl_replies = [r for r in replies if isinstance(r, FMTLReply)]
        for r in fmtl_replies:
            if r.membership is not None:
                self.registry[r.key] = r.counts
            if r.statistics is not None:
                self.statistics[r.key] = r.statistics
        if self.phase(server_round) == 1:
            weights = body_weights([r.num_examples for r in replies], self.body_weighting)
            return weighted_average([r.arrays for r in replies], weights)
        return self._aggregate_heads(server_round, fmtl_replies)

    def _aggregate_heads(self, server_round: int, replies: list[FMTLReply]) -> NDArrays:
        """Phase 2: body kept, head c <- its own weighted combination (paper Sec. V-VI)."""
        head_map = self._ensure_head_map()
        current = list(self.global_arrays or [])
        if self.upload == "head_only":
            lists = [merge_head_arrays(current, r.arrays, head_map) for r in replies]
        else:
            lists = [r.arrays for r in replies]
        membership = np.stack([r.membership for r in replies])  # phase-2 replies all hold a task
        weights = self._round_weights(replies, membership)
        arrays = aggregate_parameters(lists, head_map, weights, body_weights=None, current=current)
        self._record_weights(server_round, replies, weights)
        return arrays

    def _round_weights(self, replies: list[FMTLReply], membership: np.ndarray) -> HeadAggregationWeights:
        options = self.weighting
        scheme = options.scheme
        eq10 = scheme is HeadWeighting.FMTL_EQ10
        if options.participation is ParticipationPolicy.ROUND_LOCAL:
            statistics = None
            if eq10:
                statistics = [self.statistics.get(r.key) for r in replies]
                if any(s is None for s in statistics):
                    missing = [r.key for r, s in zip(replies, statistics) if s is None]
                    raise ValueError(f"fmtl_eq10 weights need feature statistics of {missing}")
            return round_head_weights(
                membership, options,
                num_examples=[r.num_examples for r in replies] if scheme is HeadWeighting.NUM_EXAMPLES or eq10 else None,
                statistics=statistics,
            )
        population, beta = self._population_beta()
        index = {key: i for i, key in enumerate(population)}
        ids = [index[r.key] for r in replies]
        return round_head_weights(membership, options, population_beta=beta, participant_ids=ids)

    def _population_beta(self) -> tuple[tuple[str, ...], np.ndarray]:
        """beta over the registered population (the population policies, spec P1 (b)/(c));
        recomputed only when the registry changes (eq. 10 is expensive)."""
        scheme = self.weighting.scheme
        keys = tuple(sorted(k for k in self.registry if scheme is not HeadWeighting.FMTL_EQ10 or k in self.statistics))
        if self._population_cache is not None and self._population_cache[0] == keys:
            return self._population_cache
        counts = np.stack([self.registry[k] for k in keys])
        beta = head_weight_matrix(
            task_membership(counts, self.min_count), scheme,
            num_examples=counts.sum(axis=1),
            statistics=[self.statistics[k] for k in keys] if scheme is HeadWeighting.FMTL_EQ10 else None,
            eq10=self.weighting.eq10,
        )
        self._population_cache = (keys, beta)
        log(INFO, "fmtl: population weights over %d registered clients (policy %s)",
            len(keys), self.weighting.participation.value)
        return self._population_cache

    def _record_weights(self, server_round: int, replies: list[FMTLReply], weights: HeadAggregationWeights) -> None:
        holders = weights.holder_count
        entry = {
            "round": self.run_round(server_round),
            "participants": [r.partition_id for r in replies],
            "beta": weights.client.tolist(),
            "anchor": weights.anchor.tolist(),
            "skipped": np.flatnonzero(weights.skipped).tolist(),
            "holders": holders.tolist(),
            "scheme": self.weighting.scheme.value,
            "participation": self.weighting.participation.value,
            "empty_holder": self.weighting.empty_holder.value,
        }
        self.weight_history.append(entry)
        self._last_weights = weights
        log(INFO, "round %d (fmtl phase 2): %s weights, policy %s; holders per task min/max %d/%d; "
            "heads kept (no holder) %s; holders' total weight min %.3f",
            entry["round"], entry["scheme"], entry["participation"], int(holders.min()), int(holders.max()),
            entry["skipped"], float(weights.holders_weight[~weights.skipped].min()) if (~weights.skipped).any() else 0.0)

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        self._last_weights: HeadAggregationWeights | None = None
        return super().aggregate_fit(server_round, results, failures)

    def _notify(self, server_round: int, phase: str, metrics: dict[str, float], clients: dict[int, dict[str, Scalar]]) -> None:
        if phase == "fit":
            metrics["fmtl_phase"] = float(self.phase(server_round))
            metrics["registry_size"] = float(len(self.registry))
            weights = self._last_weights
            if weights is not None:
                holders = weights.holder_count
                active = ~weights.skipped
                hw = weights.holders_weight[active] if active.any() else np.zeros(1)
                metrics |= {
                    "holders_min": float(holders.min()), "holders_mean": float(holders.mean()),
                    "holders_max": float(holders.max()), "heads_skipped": float(weights.skipped.sum()),
                    "holders_weight_min": float(hw.min()), "holders_weight_mean": float(hw.mean()),
                    "holders_weight_max": float(hw.max()),
                }
        super()._notify(server_round, phase, metrics, clients)

    def fit_metric_keys(self, replies: list[ClientReply]) -> list[str]:
        return [k for k in super().fit_metric_keys(replies) if k != "n_stats_arrays"]

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The base state plus the task registry, the cached eq. (10) statistics and the logged
        weights (both dicts in the order clients joined them). The head map and the population
        weights are recomputed from the model and the registry."""
        return super().state_dict() | {
            "registry": {k: v.copy() for k, v in self.registry.items()},
            "statistics": {k: [a.copy() for a in s.to_arrays()] for k, s in self.statistics.items()},
            "weight_history": list(self.weight_history),
        }

    def load_state_dict(self, state: dict[str, Any], rounds_done: int) -> None:
        super().load_state_dict(state, rounds_done)
        self.registry = {k: np.asarray(v) for k, v in state.get("registry", {}).items()}
        self.statistics = {k: TaskStatistics.from_arrays(v) for k, v in state.get("statistics", {}).items()}
        self.weight_history = list(state.get("weight_history", []))
        self._population_cache = None
