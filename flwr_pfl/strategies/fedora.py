"""FEDORA's Flower Strategy: one auxiliary model per client from parameter propagation.

Wu, Bao, Ainsworth and He, *Personalized Federated Learning with Parameter Propagation*
(KDD '23), Algorithm 1. The mathematics (subspaces, similarity graph, Eq. 6/7 propagation,
Eq. 8 selection weight, R-Acc and PTR) lives in :mod:`flwr_pfl.core.fedora`; this module only
moves data between Flower and the core and keeps the server's state.

Wire layout (P = the model's arrays in ``state_dict`` order; client index k = partition id)
-----------------------------------------------------------------------------------------------
* **setup** (once, inside round 1's ``configure_fit``, before any training; every connected
  client): server -> client ``FitIns([], {"fedora-phase": "setup", "fedora-p",
  "fedora-use-labels", "fedora-center", "fedora-label-scale", "fedora-rank-rtol"})``;
  client -> server ``FitRes([U_k], n_k, {"partition_id"})`` with ``U_k`` one float array of
  shape ``(d_x + C, p)`` (the top-p right singular vectors of ``[X_k | onehot(Y_k)]``).
  A client whose data cannot define a subspace (e.g. all zeros) answers ``[]`` with the
  metric ``fedora-setup-error`` (a message); a missing, failed or invalid upload leaves the
  client *isolated* in the graph (``theta_hat_k = theta_k``: it trains alone) and is logged.
* **train round**, server -> client k: ``theta_hat_k`` (P arrays, *different per client*) and
  scalars ``fedora-phase = "train"``, ``server-round`` and the client rules
  ``fedora-lambda-rule``, ``fedora-epsilon``, ``fedora-lambda-constant``,
  ``fedora-lambda-max`` (0 = no clip), ``fedora-on-nonfinite``, ``fedora-prox-factor``,
  ``fedora-prox-mode``, ``fedora-val-metric``, ``fedora-val-reduction``,
  ``fedora-val-batch-size``, ``fedora-local-baseline``.
  client k -> server: ``theta_k`` (P arrays, same shapes), ``n_k``, metrics ``partition_id``,
  ``lambda``, ``lambda_active``, ``lambda_nonfinite``, ``delta``, ``val_loss_personal``,
  ``val_loss_aux``, ``train_loss``, ``train_seconds`` (and ``local_train_loss``).
* **evaluate**: server -> client ``[]`` (the client evaluates its own ``theta_k`` from
  ``context.state``), or ``theta_hat_k`` when ``eval_aux`` is set (diagnostic
  ``aux_accuracy``); client -> server loss and metrics ``accuracy``, ``val_accuracy``,
  ``local_accuracy``, ``local_val_accuracy`` (LOCAL shadow model), ``trained``.
* A client whose partition id is unknown (no setup reply, or after a resume) is asked once by
  ``get_properties({"query": "partition-id"})`` -> ``{"partition_id"}`` (the base strategy's
  :meth:`~flwr_pfl.strategies.base.PFLStrategy.learn_partitions`).

Server state and memory
-----------------------
Two ``K x P`` float32 buffers (``theta``: each client's last uploaded model, ``theta_hat``:
each client's auxiliary model) plus ``K x K`` float64 matrices (S, W, P = D^-1 W and
M = (1 - kappa)(I - kappa P)^-1): ``8 K P + 32 K^2`` bytes, e.g. 36 clients x 199k parameters
= 57 MB, 1000 clients x 10k parameters = 80 MB + 32 MB. Nothing else of size K x P exists:
uploads are validated and copied into their row, ``theta_hat`` is written by one GEMM straight
into its buffer (``O(K^2 P)`` per round after one ``O(K^3)`` LU solve for M at setup), and
``theta_hat_k`` is sent as views of its row. :meth:`FEDORA.state_dict` exposes these buffers
(by reference, not copied) for the run's ``checkpoint.npz``; :meth:`FEDORA.load_state_dict`
restores them, so a run resumes without a new setup exchange.

Participation: clients not sampled keep their last ``theta_k`` row; Eq. 6 always mixes all K
rows (spec 9.12). Clients sampled but failed or rejected keep their previous ``theta_hat_k``
(spec 8.3). There is no global model: the Parameters Flower carries between rounds stay the
initial ones and nobody uses them.
"""

from __future__ import annotations

import concurrent.futures
import math
from dataclasses import replace
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common import (
    EvaluateIns,
    FitIns,
    Parameters,
    log,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from flwr_pfl.core import fedora as core
from flwr_pfl.errors import ConfigError, ReplyError
from flwr_pfl.strategies.base import NDArrays, PFLStrategy
from flwr_pfl.strategies.decode import decode_arrays
from flwr_pfl.strategies.validation import ClientReply, Scalar

PHASE_KEY = "fedora-phase"
SETUP_ERROR_KEY = "fedora-setup-error"
REPORT_ROUNDS = ("last", "best_val")


def client_rule_config(config: core.FedoraConfig, local_baseline: bool) -> dict[str, Scalar]:
    """The client-side rules of ``config`` as fit-config scalars (see the wire layout)."""
    sel, prox, val = config.selection, config.prox, config.validation
    return {
        "fedora-lambda-rule": sel.rule,
        "fedora-epsilon": float(sel.epsilon),
        "fedora-lambda-constant": float(sel.constant),
        "fedora-lambda-max": float(sel.lambda_max or 0.0),
        "fedora-on-nonfinite": sel.on_nonfinite,
        "fedora-prox-factor": float(prox.factor),
        "fedora-prox-mode": prox.mode,
        "fedora-val-metric": val.metric,
        "fedora-val-reduction": val.reduction,
        "fedora-val-batch-size": int(val.batch_size),
        "fedora-local-baseline": bool(local_baseline),
    }


def subspace_config(options: core.SubspaceOptions) -> dict[str, Scalar]:
    """The subspace options as setup-config scalars."""
    return {
        PHASE_KEY: "setup",
        "fedora-p": int(options.p),
        "fedora-use-labels": bool(options.use_labels),
        "fedora-center": bool(options.center),
        "fedora-label-scale": float(options.label_scale),
        "fedora-rank-rtol": float(options.rank_rtol),
    }


class FEDORA(PFLStrategy):
    """FEDORA (Algorithm 1): similarity from data subspaces once, then per-client propagation.

    Args:
        config: the core options (:func:`flwr_pfl.core.fedora.fedora_preset` or
            ``FedoraConfig()``, the spec's recommended default). The server uses ``subspace``,
            ``graph`` and ``propagation``; ``selection``, ``prox`` and ``validation`` travel to
            the clients in every fit instruction.
        local_baseline: ask clients to train a LOCAL shadow model on the same splits, for R-Acc
            and PTR in the same run (Def. 3.2-3.3).
        report_round: which evaluation round the ``reported_*`` metrics take: ``"last"`` or
            ``"best_val"`` (the official code's convention: the round with the best mean
            validation accuracy; LOCAL is selected by the same rule on its own curve).
        eval_aux: also send ``theta_hat_k`` at evaluation (diagnostic ``aux_accuracy``).
        eval_every: evaluate every this many rounds and after the last one (the official code:
            10); 1 = every round; 0 = after the last one only (:class:`PFLStrategy`'s).
        **kwargs: :class:`PFLStrategy`'s arguments (``num_clients`` = K, ``num_rounds``, Flower's
            FedAvg arguments). ``evaluate_fn`` is refused (there is no global model), and so is
            ``min_available_clients`` below K (the graph is built once, from every client).
            ``on_fit_config_fn``'s keys reach the train rounds, not the setup exchange.
    """

    name = "fedora"
    needs_partition_ids = True  # each client is sent its own row of theta_hat
    refused_hooks = {
        "evaluate_fn": "FEDORA has no global model to evaluate on the server: each client k trains its own "
        "theta_k from its auxiliary model theta_hat_k (evaluate them with the clients' evaluation)",
    }
    has_global_model = False  # each client its own model; the global arrays stay the initial ones

    def __init__(
        self,
        *,
        config: core.FedoraConfig | None = None,
        local_baseline: bool = True,
        report_round: str = "last",
        eval_aux: bool = False,
        eval_every: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(eval_every=eval_every, **kwargs)
        if self.min_available_clients < self.num_clients:
            raise ConfigError(
                f"min_available_clients={self.min_available_clients} < num_clients={self.num_clients} is not allowed "
                "for FEDORA: its similarity graph is built once, at the first round, from every client's subspace; "
                "a client that connects later would stay isolated for the whole run"
            )
        if report_round not in REPORT_ROUNDS:
            raise ValueError(f"report_round={report_round!r}; allowed: {list(REPORT_ROUNDS)}")
        self.config = config or core.FedoraConfig()
        self.local_baseline = local_baseline
        self.report_round = report_round
        self.eval_aux = eval_aux
        self.layout: core.ParameterLayout | None = None
        self.theta: np.ndarray | None = None
        self.theta_hat: np.ndarray | None = None
        self.graph: core.PropagationGraph | None = None
        self.setup_errors: dict[int, str] = {}
        self._sampled: set[int] = set()
        self._best: dict[str, dict[str, Any]] = {}
        self._current_round = 0
        #: the rows the last Eq. 6/7 update kept (None: no update yet, theta_hat == theta), so
        #: that a checkpoint needs only theta and those rows of theta_hat (see state_dict)
        self._last_frozen: list[int] | None = None

    # ---------------------------------------------------------------- setup exchange
    def _connected_clients(self, client_manager: ClientManager) -> list[ClientProxy]:
        """Every connected client in node order (setup learns their partitions from the replies)."""
        self.wait_for_clients(client_manager)
        return [proxy for _, proxy in sorted(client_manager.all().items())]

    def setup(self, server_round: int, parameters: Parameters, client_manager: ClientManager) -> bool:
        """Collect every client's ``U_k`` and build the graph and the two buffers (Alg. 1 l. 1-7).

        Returns False, building nothing, when a client failed or sent an invalid subspace and
        ``accept_failures`` is False: the round is skipped and the next one asks again.
        """
        init = parameters_to_ndarrays(parameters)
        self.layout = core.ParameterLayout.from_arrays(init)
        self.setup_errors = {}
        failed = 0
        k_total = self.num_clients
        ins = FitIns(Parameters(tensors=[], tensor_type="numpy.ndarray"), subspace_config(self.config.subspace))
        uploads: dict[int, np.ndarray] = {}
        clients = self._connected_clients(client_manager)

        def ask(proxy: ClientProxy) -> Any:
            try:
                return proxy.fit(ins, self.exchange_timeout(self.wait_timeout), server_round)
            except Exception as err:  # no reply or an error reply
                return err

        with concurrent.futures.ThreadPoolExecutor(max_workers=self.workers_for(len(clients))) as pool:
            replies = list(pool.map(ask, clients))  # read in node order, whatever answers first
        for proxy, reply in zip(clients, replies):
            try:
                if isinstance(reply, BaseException):
                    raise reply
                pid, u = self._read_setup(proxy, reply)
            except Exception as err:  # no reply, an error reply or a malformed one
                log(WARNING, "FEDORA setup: no subspace from client %s: %s", proxy.cid, err)
                failed += 1
                continue
            if u is not None:
                uploads[pid] = u
        subspaces = self._check_subspaces(uploads, k_total)
        failed += sum(1 for pid in uploads if subspaces[pid] is None)
        if self.refuses_failures(failed):
            log(WARNING, "FEDORA setup: %d client(s) failed and accept_failures=False: no graph is built; round %d "
                "is skipped and the next round asks every client again", failed, server_round)
            return False
        present = sum(u is not None for u in subspaces)
        if present == 0:
            raise RuntimeError(
                f"FEDORA setup: none of the {k_total} clients uploaded a valid subspace; "
                f"errors: {self.setup_errors}"
            )
        self.graph = core.build_propagation_graph(subspaces, self.config.graph, self.config.propagation)
        self.theta, self.theta_hat = core.init_server_buffers(self.layout.flatten(init), k_total)
        isolated = [k for k in range(k_total) if subspaces[k] is None]
        log(INFO, "FEDORA setup: %d/%d subspaces; graph %s, kappa=%.3f; isolated clients: %s; "
            "server buffers 2 x %d x %d float32 (%.1f MB)", present, k_total, self.config.graph,
            self.graph.kappa, isolated, k_total, self.layout.size, self.theta.nbytes * 2 / 2**20)
        return True

    def _read_setup(self, proxy: ClientProxy, res: Any) -> tuple[int, np.ndarray | None]:
        pid = int(res.metrics.get("partition_id", -1))
        if not 0 <= pid < self.num_clients:
            raise ReplyError(f"client {proxy.cid}: partition_id {pid} is not in [0, {self.num_clients})")
        self.partition_of[proxy.cid] = pid
        arrays = decode_arrays(res.parameters)
        if not arrays:
            reason = str(res.metrics.get(SETUP_ERROR_KEY, "the client sent no subspace"))
            self.setup_errors[pid] = reason
            log(WARNING, "FEDORA setup: client %s (partition %d) sent no subspace: %s", proxy.cid, pid, reason)
            return pid, None
        if len(arrays) != 1 or arrays[0].dtype.kind != "f":
            self.setup_errors[pid] = (f"sent {len(arrays)} arrays, expected 1" if len(arrays) != 1 else
                                      f"sent a {arrays[0].dtype} subspace, expected real floating-point numbers")
            log(WARNING, "FEDORA setup: partition %d %s", pid, self.setup_errors[pid])
            return pid, None
        return pid, arrays[0]

    def _check_subspaces(self, uploads: dict[int, np.ndarray], k_total: int) -> list[np.ndarray | None]:
        """Validate each ``U_k`` (shape, finite, orthonormal; one ``d`` for all, the most common)."""
        dims = [u.shape[0] for u in uploads.values() if u.ndim == 2]
        dim = max(set(dims), key=dims.count) if dims else None
        out: list[np.ndarray | None] = [None] * k_total
        for pid, u in sorted(uploads.items()):
            try:
                out[pid] = core.validate_subspace(u, p=self.config.subspace.p, dim=dim, client=pid)
            except ValueError as err:
                self.setup_errors[pid] = str(err)
                log(WARNING, "FEDORA setup: rejected the subspace of partition %d: %s", pid, err)
        return out

    # ---------------------------------------------------------------- instructions
    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        if self.global_arrays is None:
            self.global_arrays = parameters_to_ndarrays(parameters)
        if self.graph is None and not self.setup(server_round, parameters, client_manager):
            return []
        clients = self._sample(client_manager, server_round, self.fraction_fit, self.min_fit_clients)
        return self.fit_instructions(server_round, parameters, clients)

    def fit_instructions(
        self, server_round: int, parameters: Parameters, clients: list[ClientProxy]
    ) -> list[tuple[ClientProxy, FitIns]]:
        """Each sampled client k gets its own ``theta_hat_k`` (views of its buffer row)."""
        assert self.layout is not None and self.theta_hat is not None
        config = self.fit_config(server_round, {PHASE_KEY: "train", **client_rule_config(self.config, self.local_baseline)})
        out, self._sampled = [], set()
        for proxy in clients:
            pid = self.partition_of.get(proxy.cid)
            if pid is None:
                log(WARNING, "round %d: client %s has no known partition id; skipped", self.run_round(server_round), proxy.cid)
                continue
            self._sampled.add(pid)
            arrays = self.layout.unflatten(self.theta_hat[pid])
            out.append((proxy, FitIns(ndarrays_to_parameters(arrays), dict(config))))
        return out

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """Clients evaluate their own ``theta_k``: nothing is sent (``theta_hat_k`` with eval_aux)."""
        clients = self.evaluation_clients(server_round, client_manager)
        config = self.evaluate_config(server_round)
        empty = Parameters(tensors=[], tensor_type="numpy.ndarray")
        out = []
        for proxy in clients:
            pid = self.partition_of.get(proxy.cid)
            params = empty
            if self.eval_aux and pid is not None and self.theta_hat is not None and self.layout is not None:
                params = ndarrays_to_parameters(self.layout.unflatten(self.theta_hat[pid]))
            out.append((proxy, EvaluateIns(params, dict(config))))
        return out

    # ---------------------------------------------------------------- replies
    def expected_shapes(self, server_round: int) -> list[tuple[int, ...]]:
        if self.layout is None:
            return super().expected_shapes(server_round)
        return [tuple(s) for s in self.layout.shapes]

    def expected_dtypes(self, server_round: int) -> list[np.dtype | None]:
        if self.layout is None:
            return super().expected_dtypes(server_round)
        return [np.dtype(d) for d in self.layout.dtypes]

    def check_reply(self, server_round: int, proxy: ClientProxy, res: Any) -> ClientReply:
        reply = super().check_reply(server_round, proxy, res)
        known = self.partition_of.get(proxy.cid)
        if not 0 <= reply.partition_id < self.num_clients or reply.partition_id != known:
            raise ReplyError(
                f"client {proxy.cid}: partition_id {reply.partition_id} does not match its setup "
                f"partition {known} (must be in [0, {self.num_clients}))"
            )
        return reply

    def aggregate_replies(self, server_round: int, replies: list[ClientReply]) -> NDArrays:
        """Write the uploaded ``theta_k`` rows and recompute ``Theta_hat = M Theta`` (Eq. 6/7).

        Sampled clients without a valid reply keep their ``theta_hat_k`` (``frozen``).
        Returns the unchanged placeholder global arrays (FEDORA has no global model).
        """
        assert self.layout is not None and self.graph is not None
        assert self.theta is not None and self.theta_hat is not None
        uploads = {r.partition_id: self.layout.flatten(r.arrays) for r in replies}
        frozen = sorted(self._sampled - set(uploads))
        core.server_update(self.theta, self.theta_hat, uploads, self.graph, self.config.propagation, frozen=frozen)
        self._last_frozen = [int(k) for k in frozen]
        return self.global_arrays or []

    # ---------------------------------------------------------------- evaluation metrics
    def _notify(self, server_round: int, phase: str, metrics: dict[str, float], clients: dict[int, dict[str, Scalar]]) -> None:
        if phase == "evaluate" and clients:
            metrics.update(self.transfer_metrics(clients))
        super()._notify(server_round, phase, metrics, clients)

    def transfer_metrics(self, clients: dict[int, dict[str, Scalar]]) -> dict[str, float]:
        """R-Acc and PTR against the LOCAL shadow models (Def. 3.2-3.3), last and best-val round.

        Adds each client's ``r_acc`` to its metrics (written to the per-client results).
        """
        out: dict[str, float] = {}
        last = {k: m for k, m in clients.items() if _num(m, "accuracy") is not None}
        pairs = {k: m for k, m in last.items() if _num(m, "local_accuracy") is not None}
        if pairs:
            summary = _summary({k: _num(m, "accuracy") for k, m in pairs.items()},
                               {k: _num(m, "local_accuracy") for k, m in pairs.items()})
            out |= {f"{k}": v for k, v in summary.items()}
            for k, m in pairs.items():
                local = _num(m, "local_accuracy")
                if local:
                    m["r_acc"] = (_num(m, "accuracy") - local) / local
        # best validation round (official code's model selection), each method on its own curve
        for method, acc_key, val_key in (("fedora", "accuracy", "val_accuracy"), ("local", "local_accuracy", "local_val_accuracy")):
            vals = [_num(m, val_key) for m in last.values()]
            if not last or any(v is None for v in vals):
                continue
            score = float(np.mean(vals))
            best = self._best.get(method)
            if best is None or score > best["val"]:
                self._best[method] = {"val": score, "round": self._current_round,
                                      "acc": {k: _num(m, acc_key) for k, m in last.items()}}
        if "fedora" in self._best:
            best = self._best["fedora"]
            out["best_val_round"] = float(best["round"])
            out["accuracy_bestval_mean"] = float(np.mean(list(best["acc"].values())))
            if "local" in self._best:
                local = self._best["local"]["acc"]
                common = sorted(set(best["acc"]) & set(local))
                if common:
                    s = _summary({k: best["acc"][k] for k in common}, {k: local[k] for k in common})
                    out |= {f"{k}_bestval": v for k, v in s.items()}
        chosen = "" if self.report_round == "last" else "_bestval"
        for key, src in (("accuracy", "accuracy_fedora_mean"), ("r_acc", "r_acc"), ("ptr", "ptr")):
            if f"{src}{chosen}" in out:
                out[f"reported_{key}"] = out[f"{src}{chosen}"]
        return out

    def aggregate_evaluate(self, server_round: int, results: list, failures: list) -> tuple[float | None, dict[str, Scalar]]:
        self._current_round = self.run_round(server_round)
        return super().aggregate_evaluate(server_round, results, failures)

    # ---------------------------------------------------------------- new clients (Algorithm 2)
    def new_client_model(self, subspace: np.ndarray, subspaces: list[np.ndarray | None]) -> NDArrays:
        """``theta_hat`` for a client that joins after training (Algorithm 2; one hop from the
        new node over ``subspaces``, the old clients' ``U_k``), as the model's arrays."""
        assert self.layout is not None and self.theta_hat is not None
        vec, _ = core.new_client_auxiliary_model(subspace, subspaces, self.theta_hat, self.config.graph)
        return self.layout.unflatten(vec)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Base state plus ``arrays``: ``Theta`` (by reference, no copy) and the graph; plus the
        best-validation records (``reported_*`` with ``report_round="best_val"``) and the setup
        errors.

        ``Theta_hat`` is not stored: it is what the last update computed from the stored
        ``Theta`` (Eq. 6/7), so :meth:`load_state_dict` recomputes it by the same call, except
        the rows that update kept (``frozen``: sampled clients without a valid reply), which
        are stored. The checkpoint thus holds ``K x P`` values, not ``2 K x P``.
        """
        state = super().state_dict()
        if self.graph is None or self.theta is None or self.theta_hat is None or self.layout is None:
            return state
        g = self.graph
        frozen = self._last_frozen or []
        state["arrays"] = {
            "fedora_theta": self.theta,
            "fedora_theta_hat_frozen": self.theta_hat[frozen],
            "fedora_similarity": g.similarity,
            "fedora_weights": g.weights,
            "fedora_transition": g.transition,
            "fedora_propagation": g.propagation,
            "fedora_present": g.present,
            "fedora_kappa": np.array(g.kappa),
        }
        return state | {
            "fedora_last_frozen": self._last_frozen,
            "fedora_best": self._best,
            "fedora_setup_errors": dict(self.setup_errors),
        }

    def load_state_dict(self, state: dict[str, Any], rounds_done: int) -> None:
        """Resume from :meth:`state_dict` (or a checkpoint's ``state_*`` arrays)."""
        super().load_state_dict(state, rounds_done)
        arrays = state.get("arrays") or {}
        if "fedora_theta" not in arrays:
            return
        self.layout = core.ParameterLayout.from_arrays(self.global_arrays or [])
        theta = np.ascontiguousarray(arrays["fedora_theta"], dtype=np.float32)
        if theta.shape != (self.num_clients, self.layout.size):
            raise ValueError(f"checkpoint buffer Theta has shape {theta.shape}, expected "
                             f"({self.num_clients}, {self.layout.size})")
        kappa = float(arrays["fedora_kappa"])
        if abs(kappa - self.config.propagation.kappa) > 1e-12:
            raise ValueError(f"checkpoint was made with kappa={kappa}, the configuration has "
                             f"kappa={self.config.propagation.kappa}")
        transition = np.asarray(arrays["fedora_transition"], dtype=np.float64)
        graph = core.propagation_graph_from_similarity(
            np.asarray(arrays["fedora_similarity"]), self.config.graph, self.config.propagation,
            np.asarray(arrays["fedora_present"], dtype=bool))
        self.graph = replace(graph, weights=np.asarray(arrays["fedora_weights"]), transition=transition,
                             propagation=np.asarray(arrays["fedora_propagation"], dtype=np.float64))
        self.theta = theta
        self._last_frozen = state.get("fedora_last_frozen")
        self.theta_hat = self._recompute_theta_hat(np.asarray(arrays["fedora_theta_hat_frozen"], dtype=np.float32))
        self._best = state.get("fedora_best", {})
        self.setup_errors = {int(k): str(v) for k, v in state.get("fedora_setup_errors", {}).items()}

    def _recompute_theta_hat(self, frozen_rows: np.ndarray) -> np.ndarray:
        """``Theta_hat`` as the last update left it: that update's Eq. 6/7 call again on ``Theta``
        (no uploads: the same rows, the same GEMM, hence the same bits at the same thread
        count), then the rows it kept."""
        assert self.theta is not None and self.graph is not None
        if self._last_frozen is None:
            return self.theta.copy()  # no update yet: every row is still theta^0
        frozen = [int(k) for k in self._last_frozen]
        if frozen_rows.shape != (len(frozen), self.theta.shape[1]):
            raise ValueError(f"checkpoint keeps theta_hat rows of shape {frozen_rows.shape} for the "
                             f"frozen clients {frozen}; expected ({len(frozen)}, {self.theta.shape[1]})")
        theta_hat = np.empty_like(self.theta)
        core.server_update(self.theta, theta_hat, {}, self.graph, self.config.propagation, frozen=frozen)
        theta_hat[frozen] = frozen_rows
        return theta_hat


def _num(metrics: dict[str, Scalar], key: str) -> float | None:
    v = metrics.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _summary(acc: dict[int, float | None], local: dict[int, float | None]) -> dict[str, float]:
    """Mean accuracy of both methods, R-Acc (over clients with LOCAL accuracy > 0) and PTR."""
    keys = sorted(acc)
    a = np.array([acc[k] for k in keys], dtype=np.float64)
    b = np.array([local[k] for k in keys], dtype=np.float64)
    out = {
        "accuracy_fedora_mean": float(a.mean()),
        "accuracy_local_mean": float(b.mean()),
        "ptr": core.positive_transfer_ratio(a, b),
        "ptr_strict": core.positive_transfer_ratio(a, b, strict=True),
    }
    ok = b > 0
    if ok.any():
        rel = core.relative_improvement(a[ok], b[ok])
        out |= {"r_acc": float(rel.mean()), "r_acc_min": float(rel.min()), "r_acc_max": float(rel.max())}
    return out
