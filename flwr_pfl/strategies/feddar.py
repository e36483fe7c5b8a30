"""FedDAR (Zhong et al., ICLR 2023) and its baselines as Flower Strategies: data movement and state.

The mathematics (head aggregation WA / SA Eq. 8, re-weighting u_m = L / (L_m M) Eq. 6, encoder
averaging) is in :mod:`flwr_pfl.core.feddar`; this module only gathers what clients send, calls
it, and sends the results back.

How a FedDAR round maps onto Flower's legacy loop
-------------------------------------------------
One FedDAR round (Algorithm 1) is ONE Flower server round, with two exchanges and the same clients:

1. inside ``configure_fit`` the strategy samples the clients, sends them the **head phase**
   (``feddar-phase="head"``) with blocking ``ClientProxy.fit`` calls (Flower's own
   ``fit_clients`` thread pool), checks the replies and aggregates the heads (WA or SA);
2. it then returns the **representation phase** (``feddar-phase="rep"``) as the round's ordinary
   fit instructions, to exactly the clients whose head reply was accepted; ``aggregate_fit``
   averages their encoders (weights L_i);
3. ``evaluate`` then sees (phi^t, h_1^t .. h_M^t).

So a results row with ``round = t`` is FedDAR round t (after ``warmup_rounds`` plain FedAvg +
multi-head rounds, which are rounds 1..W and count in the total, as the paper's FairFace schedule
implies). Each round writes a ``head`` row (head aggregation diagnostics), a ``fit`` row
(representation phase) and an ``evaluate`` row. Before the first round, clients not yet seen
answer one ``get_properties`` query with their per-domain counts L_{i,m} (spec 8.5: u_m uses the
counts of all clients, not only the sampled ones).

Wire layout (M domains, heads of N outputs on k features, P = N (k + bias), E encoder arrays)
----------------------------------------------------------------------------------------------
* global arrays: the model's ``state_dict`` order: E encoder arrays, then per domain m
  ``heads.m.weight`` (N, k) [+ ``heads.m.bias`` (N,)].
* get_properties (``feddar-query="domain-counts"``) -> scalars ``partition_id``, ``num_domains``,
  ``num_outputs``, ``feature_dim``, ``head_bias``, ``head_loss`` (``squared`` / ``softmax``;
  a client may leave it out), ``n_d0`` .. ``n_d{M-1}``.
* head phase: server -> global arrays; client -> ``[heads (M, P) float64, counts (M,) float64]``
  plus ``[hessians (M, P, P) float64]`` for SA; heads are class-major [W | b] rows
  (:class:`~flwr_pfl.core.feddar.HeadLayout`), absent domains send the received head, count 0 and a
  zero Hessian. ``num_examples`` = L_i.
* representation phase: server -> global arrays + ``[u (M,) float64]``; client -> the E encoder
  arrays. Warmup rounds: server -> global arrays + ``[u]``; client -> all global arrays.
* evaluate: server -> global arrays; client -> loss, ``accuracy`` and per-domain ``n_d<m>``,
  ``acc_d<m>``, ``loss_d<m>`` (pooled by the server into per-domain, min and mean figures).

Baselines with their own server logic: :class:`ReweightedFedAvg` (FedAvg on the u-re-weighted
loss; with one head per domain it is "FedAvg + multi-head", :class:`FedAvgMultiHead`) and
:class:`SeparateFedAvg` (one FedAvg model per domain). Plain FedAvg (without re-weighting) is
:class:`flwr_pfl.strategies.FedAvg`.
"""

from __future__ import annotations

from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common import FitIns, FitRes, Parameters, log, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.server import fit_clients

from flwr_pfl.core import feddar as core
from flwr_pfl.core.aggregation import weighted_average
from flwr_pfl.core.metrics import aggregate_client_metrics
from flwr_pfl.core.packing import unpack_symmetric
from flwr_pfl.errors import ConfigError, ReplyError
from flwr_pfl.strategies.base import PFLStrategy, check_unclaimed
from flwr_pfl.strategies.decode import decode_arrays
from flwr_pfl.strategies.sampling import in_partition_order
from flwr_pfl.strategies.validation import ClientReply, Scalar, check_arrays

#: head size above which second-order aggregation is warned about (P = N (k + 1); the paper
#: found SA unstable from k = 64 with 10 classes, P = 650)
#: how FedDAR-SA's head Hessians travel (:class:`FedDAR`'s ``hessian_upload``)
HESSIAN_UPLOADS = ("full", "packed", "packed-float32")
SA_COMFORTABLE_PARAMS = 400

NDArrays = list[np.ndarray]

PHASE_KEY = "feddar-phase"
QUERY_KEY = "feddar-query"
COUNTS_QUERY = "domain-counts"


class DomainCountingStrategy(PFLStrategy):
    """Base of the strategies that need every client's per-domain counts L_{i,m}.

    Before the first fit of a client it has not seen, the strategy asks every connected client
    not yet in its table for its counts (one ``get_properties`` exchange) and keeps the table
    L_{i,m} keyed by partition id, from which :meth:`domain_weights` gives u_m = L / (L_m M)
    (Eq. 6). Replies that are not a valid count vector are logged and left out.

    Args:
        reweight: False sends u = 1 for every domain (the "w/o RW" ablation).
        **kwargs: :class:`PFLStrategy` arguments.
    """

    def __init__(self, *, reweight: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reweight = reweight
        self.count_table: dict[int, np.ndarray] = {}
        self.head_info: dict[str, Scalar] = {}

    # ---------------------------------------------------------------- counts
    def gather_counts(self, client_manager: ClientManager, server_round: int) -> None:
        """Ask the connected clients not yet in the count table for their L_{i,m}."""
        unknown = [p for cid, p in sorted(client_manager.all().items()) if self.partition_of.get(cid) not in self.count_table]
        if not unknown:
            return
        config = {QUERY_KEY: COUNTS_QUERY, "server-round": self.run_round(server_round)}
        for proxy, answer in zip(unknown, self.query_properties(server_round, unknown, config)):
            try:
                if isinstance(answer, BaseException):
                    raise answer
                self._record_counts(proxy, answer)
            except Exception as err:  # a failed or malformed answer: that client stays unknown
                log(WARNING, "round %d: no domain counts from client %s: %s", self.run_round(server_round), proxy.cid, err)
        if not self.count_table:
            raise RuntimeError("no client reported its per-domain sample counts; FedDAR cannot start")

    def _record_counts(self, proxy: ClientProxy, props: dict[str, Scalar]) -> None:
        num_domains = int(props["num_domains"])
        counts = np.array([float(props.get(f"n_d{m}", -1)) for m in range(num_domains)])
        if num_domains < 1 or np.any(counts < 0) or np.any(counts != np.round(counts)):
            raise ReplyError(f"client {proxy.cid}: invalid domain counts {counts.tolist()}")
        if self.count_table and num_domains != self.num_domains:
            raise ReplyError(f"client {proxy.cid}: reports {num_domains} domains, others {self.num_domains}")
        info = {k: props[k] for k in ("num_outputs", "feature_dim", "head_bias", "head_loss") if k in props}
        if self.head_info and _layout_of(info) != _layout_of(self.head_info):
            raise ReplyError(f"client {proxy.cid}: head layout {info} differs from {self.head_info}")
        if "head_loss" in info and self.head_info.get("head_loss", info["head_loss"]) != info["head_loss"]:
            raise ReplyError(f"client {proxy.cid}: head loss {info['head_loss']!r} differs from {self.head_info['head_loss']!r}")
        pid = int(props["partition_id"])
        self.partition_of[proxy.cid] = pid
        self.count_table[pid] = counts
        self.head_info = {**self.head_info, **info}  # a client that omits head_loss keeps the known one

    @property
    def num_domains(self) -> int:
        return len(next(iter(self.count_table.values())))

    def domain_weights(self) -> np.ndarray:
        """u_m = L / (L_m M) over all clients seen (Eq. 6); ones without re-weighting."""
        if not self.reweight:
            return np.ones(self.num_domains)
        return core.domain_weights(np.stack(list(self.count_table.values())))

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        if self.global_arrays is None:
            self.global_arrays = parameters_to_ndarrays(parameters)
        clients = self._sample(client_manager, server_round, self.fraction_fit, self.min_fit_clients)
        self.gather_counts(client_manager, server_round)
        return self.fit_instructions(server_round, parameters, clients)

    def _config(self, server_round: int, phase: str, **extra: Scalar) -> dict[str, Scalar]:
        return self.fit_config(server_round, {PHASE_KEY: phase, **extra})

    def _notify_u(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Add u_m and L_m (keys ``u_dom<m>``, ``count_dom<m>``) to a metrics row."""
        table = np.stack(list(self.count_table.values()))
        for m, (u, n) in enumerate(zip(self.domain_weights(), table.sum(0))):
            metrics[f"u_dom{m}"], metrics[f"count_dom{m}"] = float(u), float(n)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """The base state plus the count table (in the order clients joined it: u sums over it
        in that order) and the clients' head layout."""
        return super().state_dict() | {
            "count_table": {k: v.copy() for k, v in self.count_table.items()},
            "head_info": dict(self.head_info),
        }

    def load_state_dict(self, state: dict[str, Any], rounds_done: int) -> None:
        super().load_state_dict(state, rounds_done)
        self.count_table = {int(k): np.asarray(v) for k, v in state.get("count_table", {}).items()}
        self.head_info = dict(state.get("head_info", {}))


class ReweightedFedAvg(DomainCountingStrategy):
    """FedAvg (w/ RW): FedAvg of the whole model trained on the u-re-weighted loss (Eq. 6).

    Wire: fit sends the global arrays + ``[u (M,) float64]`` (``feddar-phase="rw"``); replies and
    aggregation are FedAvg's (all arrays, weights L_i).
    """

    name = "fedavg-rw"

    def fit_instructions(self, server_round: int, parameters: Parameters, clients: list[ClientProxy]) -> list[tuple[ClientProxy, FitIns]]:
        payload = ndarrays_to_parameters(list(self.global_arrays or []) + [self.domain_weights()])
        return [(p, FitIns(payload, self._config(server_round, "rw"))) for p in clients]

    def aggregate_replies(self, server_round: int, replies: list[ClientReply]) -> NDArrays:
        return weighted_average([r.arrays for r in replies], [r.num_examples for r in replies])


class FedAvgMultiHead(ReweightedFedAvg):
    """FedAvg + multi-head: encoder and one head per domain trained jointly on the re-weighted
    loss and averaged by FedAvg (the paper's "FedAvg + Multi-head"; also FedDAR's warmup step)."""

    name = "fedavg-mh"


class SeparateFedAvg(DomainCountingStrategy):
    """Separate FedAvg: one whole model per domain, each federated over its domain's samples.

    Wire: fit and evaluate send M copies of the one-head model's arrays, domain 0's first;
    fit replies carry the M updated copies plus ``[counts (M,) float64]``. Model m is the
    average over clients with L_{i,m} > 0, weights L_{i,m}; a model nobody trained is kept.
    """

    name = "separate-fedavg"

    def fit_instructions(self, server_round: int, parameters: Parameters, clients: list[ClientProxy]) -> list[tuple[ClientProxy, FitIns]]:
        payload = ndarrays_to_parameters(list(self.global_arrays or []))
        return [(p, FitIns(payload, self._config(server_round, "separate"))) for p in clients]

    def expected_shapes(self, server_round: int) -> list[tuple[int, ...]]:
        return super().expected_shapes(server_round) + [(self.num_domains,)]

    def expected_dtypes(self, server_round: int) -> list[np.dtype | None]:
        return super().expected_dtypes(server_round) + [None]

    def check_reply(self, server_round: int, proxy: ClientProxy, res: FitRes) -> ClientReply:
        reply = super().check_reply(server_round, proxy, res)
        _check_counts(f"{proxy.cid} (partition {reply.partition_id})", reply.arrays[-1], reply.num_examples)
        return reply

    def aggregate_replies(self, server_round: int, replies: list[ClientReply]) -> NDArrays:
        current = list(self.global_arrays or [])
        per_model = len(current) // self.num_domains
        counts = np.stack([r.arrays[-1] for r in replies])
        out: NDArrays = []
        for m in range(self.num_domains):
            chunk = slice(m * per_model, (m + 1) * per_model)
            if counts[:, m].sum() > 0:
                out += weighted_average([r.arrays[chunk] for r in replies], counts[:, m])
            else:
                out += current[chunk]
        return out


class FedDAR(DomainCountingStrategy):
    """FedDAR-WA / FedDAR-SA (Algorithm 1): head phase and representation phase per round.

    Args:
        aggregation: ``"sa"`` (second-order, Eq. 8) or ``"wa"`` (count-weighted average).
        head_epochs: tau_h, local epochs on the heads (encoder frozen).
        rep_epochs: tau_phi, local epochs on the encoder (heads frozen).
        warmup_rounds: FedAvg + multi-head rounds before the first FedDAR round (counted in
            the total); warmup_epochs: their local epochs.
        head_solver: ``"gd"`` (the shared training loop) or ``"lstsq"`` (exact local minimiser
            nearest to the global head; squared loss only).
        head_lr_scale: head-phase learning rate = learning-rate * head_lr_scale.
        lr_decay_round / lr_decay_factor: from this round on (counting warmup) every learning rate
            is multiplied by the factor (FairFace: 0.1 after round 60); 0 = no decay.
        hessian_at: ``"local"`` (Algorithm 1) or ``"global"`` (Eq. 8 derivation).
        sa_options: :class:`~flwr_pfl.core.feddar.SAOptions` (weighting, solver, damping,
            fallback to WA, condition threshold, trust radius; the trust region is applied
            unless the clients report squared-loss heads).
        cache_features: compute features once per head phase with the frozen encoder in eval
            mode and train the heads on them (exact without data augmentation).
        max_hessian_params: clients refuse SA heads with more parameters (spec 8.5).
        hessian_upload: how SA's Hessians travel (:data:`HESSIAN_UPLOADS`): ``"full"`` (M x P x
            P float64, the paper's exact values), ``"packed"`` (each symmetric Hessian's upper
            triangle, float64: about half the bytes; the lower triangle becomes the mirror of the
            upper, equal up to float rounding) or ``"packed-float32"`` (also in float32: about a
            quarter of the bytes, values rounded to 7 digits).
        reweight: u_m re-weighting of the representation loss (Eq. 6).
        **kwargs: :class:`PFLStrategy` arguments. ``on_fit_config_fn``'s keys reach both
            phases of a round (a ``learning-rate`` is then scaled by ``lr-scale``);
            ``fit_metrics_aggregation_fn`` sees the representation phase's replies; with
            ``accept_failures=False`` a failure in either phase leaves the whole round
            unaggregated (heads included).
    """

    name = "feddar"

    def __init__(
        self,
        *,
        aggregation: str = "sa",
        head_epochs: int = 5,
        rep_epochs: int = 1,
        warmup_rounds: int = 0,
        warmup_epochs: int = 1,
        head_solver: str = "gd",
        head_lr_scale: float = 1.0,
        lr_decay_round: int = 0,
        lr_decay_factor: float = 0.1,
        hessian_at: str = "local",
        sa_options: core.SAOptions | None = None,
        cache_features: bool = True,
        max_hessian_params: int = 4096,
        hessian_upload: str = "full",
        reweight: bool = True,
        **kwargs: Any,
    ) -> None:
        if hessian_upload not in HESSIAN_UPLOADS:
            raise ConfigError(f"FedDAR: hessian_upload (feddar.hessian-upload) = {hessian_upload!r} is not allowed; "
                              f"choose one of {', '.join(map(repr, HESSIAN_UPLOADS))}")
        super().__init__(reweight=reweight, **kwargs)
        self.hessian_upload = hessian_upload
        self.aggregation = core.HeadAggregation(aggregation)
        self._warned: set[str] = set()  # head-size warnings already given (once per run each)
        self.hessian_at = core.HessianAt(hessian_at)
        self.sa_options = sa_options or core.SAOptions()
        self.head_epochs, self.rep_epochs = head_epochs, rep_epochs
        self.warmup_rounds, self.warmup_epochs = warmup_rounds, warmup_epochs
        self.head_solver = head_solver
        self.head_lr_scale = head_lr_scale
        self.lr_decay_round, self.lr_decay_factor = lr_decay_round, lr_decay_factor
        self.cache_features = cache_features
        self.max_hessian_params = max_hessian_params
        #: cids of the clients whose head reply was accepted in the current round
        self.round_clients: dict[int, list[str]] = {}
        self._round_start: NDArrays = []  # the global arrays when the current round began

    def __repr__(self) -> str:
        return f"FedDAR(aggregation={self.aggregation.value}, num_clients={self.num_clients})"

    # ---------------------------------------------------------------- layout
    def phase(self, server_round: int) -> str:
        """``"warmup"`` for rounds 1..warmup_rounds, else ``"feddar"``."""
        return "warmup" if self.run_round(server_round) <= self.warmup_rounds else "feddar"

    @property
    def layout(self) -> core.HeadLayout:
        info = self.head_info
        return core.HeadLayout(int(info["num_outputs"]), int(info["feature_dim"]), bool(info["head_bias"]))

    @property
    def head_loss(self) -> core.HeadLoss | None:
        """The clients' head loss, as they report it (None when they do not): SA's trust region
        is not needed for squared loss (:func:`~flwr_pfl.core.feddar.aggregate_heads_sa`)."""
        value = self.head_info.get("head_loss")
        return core.HeadLoss(str(value)) if value in {h.value for h in core.HeadLoss} else None

    @property
    def arrays_per_head(self) -> int:
        return 2 if self.layout.bias else 1

    @property
    def num_encoder_arrays(self) -> int:
        n = len(self.global_arrays or []) - self.num_domains * self.arrays_per_head
        if n < 1:
            raise RuntimeError(
                f"the global model has {len(self.global_arrays or [])} arrays, too few for an encoder "
                f"plus {self.num_domains} heads; build the model with one head per domain"
            )
        return n

    def global_heads(self) -> np.ndarray:
        """The global heads as a flat float64 (M, P) array (wire layout)."""
        arrays, e, h = self.global_arrays or [], self.num_encoder_arrays, self.arrays_per_head
        layout = self.layout
        return np.stack([
            layout.pack(np.asarray(arrays[e + m * h], np.float64), np.asarray(arrays[e + m * h + 1], np.float64) if h == 2 else None)
            for m in range(self.num_domains)
        ])

    def set_global_heads(self, heads: np.ndarray) -> None:
        arrays, e, h = list(self.global_arrays or []), self.num_encoder_arrays, self.arrays_per_head
        for m in range(self.num_domains):
            weight, bias = self.layout.unpack(heads[m])
            arrays[e + m * h] = weight.astype(arrays[e + m * h].dtype)
            if bias is not None:
                arrays[e + m * h + 1] = bias.astype(arrays[e + m * h + 1].dtype)
        self.global_arrays = arrays

    def lr_scale(self, server_round: int) -> float:
        decayed = self.lr_decay_round and self.run_round(server_round) >= self.lr_decay_round
        return self.lr_decay_factor if decayed else 1.0

    # ---------------------------------------------------------------- round
    def fit_instructions(self, server_round: int, parameters: Parameters, clients: list[ClientProxy]) -> list[tuple[ClientProxy, FitIns]]:
        self._round_start = list(self.global_arrays or [])  # restored if the round is not aggregated
        lr = self.lr_scale(server_round)
        u = self.domain_weights()
        with_u = ndarrays_to_parameters(list(self.global_arrays or []) + [u])
        if self.phase(server_round) == "warmup":
            config = self._config(server_round, "warmup", epochs=self.warmup_epochs, **{"lr-scale": lr})
            return [(p, FitIns(with_u, config)) for p in clients]
        accepted = self.head_phase(server_round, clients, lr)
        # the heads changed: rebuild the payload after the head phase
        with_u = ndarrays_to_parameters(list(self.global_arrays or []) + [u])
        config = self._config(server_round, "rep", epochs=self.rep_epochs, **{"lr-scale": lr})
        return [(p, FitIns(with_u, dict(config))) for p in clients if p.cid in accepted]

    def head_phase(self, server_round: int, clients: list[ClientProxy], lr_scale: float) -> set[str]:
        """Exchange 1 of a FedDAR round: send the head phase to ``clients`` (blocking), check the
        replies, aggregate the heads (WA or SA) into the global model; returns the accepted cids."""
        config = self._config(
            server_round, "head",
            epochs=self.head_epochs,
            **{
                "lr-scale": lr_scale * self.head_lr_scale,
                "head-solver": self.head_solver,
                "hessian": self.aggregation is core.HeadAggregation.SA,
                "hessian-at": self.hessian_at.value,
                "cache-features": self.cache_features,
                "max-hessian-params": self.max_hessian_params,
                "hessian-upload": self.hessian_upload,
            },
        )
        ins = FitIns(ndarrays_to_parameters(list(self.global_arrays or [])), config)
        results, failures = fit_clients(
            [(p, ins) for p in clients], max_workers=self.workers_for(len(clients)), timeout=self.exchange_timeout(None), group_id=server_round
        )
        replies: list[ClientReply] = []
        rejected = 0
        for proxy, res in in_partition_order(results):  # the head sums must not depend on arrival order
            try:
                check_unclaimed(proxy.cid, res.metrics.get("partition_id"), {r.partition_id for r in replies})
                replies.append(self.check_head_reply(proxy, res))
            except ReplyError as err:
                log(WARNING, "round %d: rejected a head-phase reply: %s", self.run_round(server_round), err)
                rejected += 1
        outliers = self.screen_outliers(server_round, replies, "head-phase reply")
        replies = [r for i, r in enumerate(replies) if i not in outliers]
        rejected += len(outliers)
        for failure in failures:
            log(WARNING, "round %d: a client failed in the head phase: %r", self.run_round(server_round),
                failure if isinstance(failure, BaseException) else failure[1].status)
        metrics: dict[str, Any] = {"num_failures": float(len(failures) + rejected), "num_rejected": float(rejected)}
        if self.refuses_failures(len(failures) + rejected):
            log(WARNING, "round %d: %d head-phase failure(s) and accept_failures=False: the round is not "
                "aggregated (no representation phase)", self.run_round(server_round), len(failures) + rejected)
            replies = []
        elif replies:
            metrics |= self.aggregate_heads(server_round, replies)
            metrics |= aggregate_client_metrics([(r.num_examples, r.metrics) for r in replies], keys=["head_loss"])
        else:
            log(WARNING, "round %d: no valid head-phase replies; the heads are unchanged", self.run_round(server_round))
        self._notify(server_round, "head", self._notify_u(metrics), {r.partition_id: r.metrics for r in replies})
        return {r.cid for r in replies}

    def report_head_conditions(self, server_round: int, pooled: np.ndarray) -> None:
        """Log what is true of this round's head aggregation, given the pooled per-domain
        sample counts of the accepted replies (shape (M,)).

        * A domain without samples this round: its head is kept (u_m = 0, metric
          ``updated_dom<m>`` = 0); the algorithm's normal behaviour, said at INFO once per
          round, naming the domains.
        * SA with heads of more than ``SA_COMFORTABLE_PARAMS`` parameters: the summed Hessians
          are large and often ill-conditioned (the paper found SA unstable from P = 650);
          warned once per run.
        * SA and a domain with samples, but fewer than the head's ``in_dim`` inputs: its summed
          Hessian is singular whatever the loss; warned once per run, naming the domain.
        """
        layout = self.layout
        absent = [m for m, n in enumerate(pooled) if n == 0]
        if absent:
            log(INFO, "round %d: domain(s) %s have no samples among this round's clients; their heads "
                "are kept (u_m = 0)", self.run_round(server_round), ", ".join(map(str, absent)))
        if self.aggregation is not core.HeadAggregation.SA:
            return
        if layout.num_params > SA_COMFORTABLE_PARAMS and "large" not in self._warned:
            self._warned.add("large")
            log(WARNING, "FedDAR-SA with heads of P = %d parameters (feature width %d, > %d): the summed "
                "Hessians are large and often ill-conditioned; the paper projects to a small "
                "representation: give the model a representation (the head's input) of width <= 16 "
                "(run config: feature-dim <= 16), or use WA (aggregation=\"wa\")",
                layout.num_params, layout.feature_dim, SA_COMFORTABLE_PARAMS)
        few = [(m, int(n)) for m, n in enumerate(pooled) if 0 < n < layout.in_dim]
        if few and "few" not in self._warned:
            self._warned.add("few")
            m, n = few[0]
            log(WARNING, "round %d: FedDAR-SA: domain %d has %d sample(s) this round, fewer than the %d "
                "inputs of its head (feature width %d%s), so its summed Hessian is singular; the "
                "sa-solver decides (exact skips the update); sample more clients per round or use WA",
                self.run_round(server_round), m, n, layout.in_dim, layout.feature_dim, " + bias" if layout.bias else "")

    def check_head_reply(self, proxy: ClientProxy, res: FitRes) -> ClientReply:
        """Validate a head-phase reply against the wire layout; raise ReplyError otherwise."""
        partition_id = self.check_partition(proxy.cid, res.metrics.get("partition_id", -1))
        who = f"{proxy.cid} (partition {partition_id})"
        arrays = decode_arrays(res.parameters)
        m, p = self.num_domains, self.layout.num_params
        shapes, dtypes = [(m, p), (m,)], [np.dtype(np.float64)] * 2  # as the clients send them
        if self.aggregation is core.HeadAggregation.SA:
            packed = self.hessian_upload != "full"
            shapes.append((m, p * (p + 1) // 2) if packed else (m, p, p))
            dtypes.append(np.dtype(np.float32 if self.hessian_upload == "packed-float32" else np.float64))
        check_arrays(who, arrays, shapes, res.num_examples, dtypes)
        _check_counts(who, arrays[1], res.num_examples)
        if self.aggregation is core.HeadAggregation.SA and self.hessian_upload != "full":
            arrays = [*arrays[:2], unpack_symmetric(arrays[2].astype(np.float64), p)]
        if partition_id >= 0:
            self.partition_of[proxy.cid] = partition_id
            self.count_table[partition_id] = arrays[1].astype(np.float64)  # keeps u current
        return ClientReply(proxy.cid, partition_id, res.num_examples, arrays, dict(res.metrics))

    def aggregate_heads(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """Aggregate the accepted local heads into the global heads; returns diagnostics."""
        prev = self.global_heads()
        self.report_head_conditions(server_round, np.stack([r.arrays[1] for r in replies]).sum(0))
        heads = np.stack([r.arrays[0] for r in replies])
        counts = np.stack([r.arrays[1] for r in replies])
        hessians = np.stack([r.arrays[2] for r in replies]) if self.aggregation is core.HeadAggregation.SA else None
        metrics: dict[str, float] = {"head_update_skipped": 0.0}
        try:
            result = core.aggregate_heads(self.aggregation, heads, counts, prev, hessians, self.sa_options, self.head_loss)
        except ValueError as err:  # the exact solver met a singular system (spec 9.3)
            log(WARNING, "round %d: head aggregation failed, heads kept: %s", self.run_round(server_round), err)
            return metrics | {"head_update_skipped": 1.0}
        self.check_aggregate(server_round, [result.heads], [prev])
        self.set_global_heads(result.heads)
        for m in range(self.num_domains):
            metrics[f"updated_dom{m}"] = float(result.updated[m])
            metrics[f"head_drift_dom{m}"] = float(np.linalg.norm(result.heads[m] - prev[m]))
            if self.aggregation is core.HeadAggregation.SA and result.updated[m]:
                metrics[f"sa_cond_dom{m}"] = float(result.condition_numbers[m])
                metrics[f"sa_min_eig_dom{m}"] = float(result.min_eigenvalues[m])
                metrics[f"sa_lambda_dom{m}"] = float(result.damping[m])
                metrics[f"sa_fallback_dom{m}"] = float(result.fell_back_to_wa[m])
                metrics[f"sa_trust_bound_dom{m}"] = float(result.trust_bound[m])
        return metrics

    # ---------------------------------------------------------------- representation phase
    def expected_shapes(self, server_round: int) -> list[tuple[int, ...]]:
        shapes = super().expected_shapes(server_round)
        return shapes if self.phase(server_round) == "warmup" else shapes[: self.num_encoder_arrays]

    def expected_dtypes(self, server_round: int) -> list[np.dtype | None]:
        dtypes = super().expected_dtypes(server_round)
        return dtypes if self.phase(server_round) == "warmup" else dtypes[: self.num_encoder_arrays]

    def aggregate_replies(self, server_round: int, replies: list[ClientReply]) -> NDArrays:
        if self.phase(server_round) == "warmup":
            return weighted_average([r.arrays for r in replies], [r.num_examples for r in replies])
        encoder = core.aggregate_encoder([r.arrays for r in replies], [r.num_examples for r in replies])
        return encoder + list(self.global_arrays or [])[self.num_encoder_arrays:]

    def aggregate_fit(self, server_round, results, failures):
        parameters, metrics = super().aggregate_fit(server_round, results, failures)
        if parameters is None and self.refuses_failures(len(failures)):
            self.global_arrays = self._round_start  # undo the head phase: the round is not aggregated
            return None, metrics
        if parameters is None and self.global_arrays is not None:
            # the head phase may have changed the heads even when no encoder came back
            parameters = ndarrays_to_parameters(self.global_arrays)
        return parameters, metrics

    def state_dict(self) -> dict[str, Any]:
        """The counting state plus the once-per-run warnings already given."""
        return super().state_dict() | {"warned": sorted(self._warned)}

    def load_state_dict(self, state: dict[str, Any], rounds_done: int) -> None:
        super().load_state_dict(state, rounds_done)
        self._warned = set(state.get("warned", ()))


def _layout_of(info: dict[str, Scalar]) -> dict[str, Scalar]:
    """The head layout part of a client's head info (all but ``head_loss``, which older
    clients and checkpoints may lack)."""
    return {k: v for k, v in info.items() if k != "head_loss"}


def _check_counts(who: str, counts: np.ndarray, num_examples: int) -> None:
    """Per-domain counts must be non-negative integers that add up to ``num_examples``."""
    if np.any(counts < 0) or np.any(counts != np.round(counts)) or int(counts.sum()) != num_examples:
        raise ReplyError(
            f"client {who}: domain counts {counts.tolist()} must be non-negative integers summing "
            f"to num_examples={num_examples}"
        )


__all__ = ["DomainCountingStrategy", "FedAvgMultiHead", "FedDAR", "ReweightedFedAvg", "SeparateFedAvg"]
