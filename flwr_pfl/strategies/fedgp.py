"""FedGP and FedDA (fixed or auto-weighted beta) for one data-poor target and N sources.

Jiang, Zhang, Koyejo, *Principled Federated Domain Adaptation: Gradient Projection and
Auto-Weighting* (ICLR 2024), Algorithm 1 with the server-side placement. The mathematics
(Definitions 4.1 / 4.3, App. C.9, Eq. 3, the App. A.5 estimators) lives in
:mod:`flwr_pfl.core.fedgp`; this module only moves data and keeps the server's state.

Participation. Every client takes part in every round (the paper's cross-silo protocol:
the target's update is the reference each FDA round is built on), so ``fraction_fit`` must be
1; anything less is refused when the strategy is built (see :func:`_require_full_participation`).

Roles. Exactly one client is the **target**; all others are **sources**. A client knows its own
role (from ``<algorithm>.target-partition`` or the node config ``fedgp-role``, see
:class:`flwr_pfl.clients.FedGPClient`) and reports it in every reply (metric ``is_target``).
The strategy learns the target's cid and partition id from those replies; with
``target_partition`` set it also checks that the right client claims the role. Two clients
claiming the target role stop the run with a :class:`~flwr_pfl.errors.ConfigError`.

Wire layout (every round every client is sent the same FitIns)
------------------------------------------------------------------
* server -> every client: the global arrays in ``state_dict`` order (L arrays, buffers
  included), config ``fedgp.phase`` (``warmup`` | ``fda``), ``fedgp.lr-scale`` (float),
  ``fedgp.sources-train`` / ``fedgp.target-trains`` (bool), ``fedgp.record-steps`` (bool),
  ``fedgp.step-upload`` (``matrix`` | ``summary``), ``fedgp.buffer-role``,
  ``fedgp.scalar-role`` (which tensors form the flattened vectors), ``fedgp.max-step-updates``
  (int, 0 = all).
* source -> server: the L trained arrays, ``num_examples`` = n_i; metrics ``is_target`` = 0,
  ``num_steps`` = K_i (optimizer steps), ``lr`` (learning rate used), ``train_loss``,
  ``buffer_mask`` (a string of '0'/'1', one per array, '1' = a ``named_buffers`` entry).
* target -> server: the L trained arrays, ``num_examples`` = n_T; metrics ``is_target`` = 1,
  ``num_steps`` = B, ``lr``, ``n_model_arrays`` = L. In auto mode with ``matrix`` upload one more
  array follows: G, float32 of shape (B', m), its per-step updates flattened over the
  ``aggregate`` tensors (B' = min(B, max-step-updates)): **4 B' m extra bytes per round**.
  With ``summary`` upload (FedDA only) no array is added; metrics ``step_var`` (S_T of App. A.5)
  and ``step_rows`` (B') carry the statistic: **one float**.
* a client that does not train this round (the target during warm-up and in Source Only, the
  sources in Target Only) replies with **zero arrays** and metric ``skipped`` = 1.
* evaluation: every client (or only the target, ``evaluate_sources=False``) evaluates the
  global model on its own test split; the strategy reports ``target_accuracy``,
  ``target_loss``, ``target_accuracy_last5`` (mean of the last five evaluations, the paper's
  metric) and ``source_accuracy_wmean`` beside the usual summaries.

Placement (``config.placement``). ``server`` (default, Algorithm 1): as above, one server round
per FDA round. ``target`` (App. C.1 / C.4): FDA round r takes two server rounds:

* round W + 2r - 1 (stage ``sources``): the sources train as above (the target, once known, is
  not sampled); the strategy keeps their replies and returns the global model unchanged; no
  evaluation.
* round W + 2r (stage ``target``): only the target is sent a FitIns, whose arrays are the L
  global arrays followed by the N kept source models (L arrays each, in an order shuffled per
  round with ``shuffle_sources``), with config ``fedgp.sources`` (JSON list of ``{"n", "lr",
  "steps"}``, one per source in that order) and ``fedgp.cfg.<option>`` (every
  :class:`~flwr_pfl.core.fedgp.FDAConfig` option). The target trains, runs
  :func:`~flwr_pfl.core.fedgp.fda_round` itself on its in-memory step updates and replies with
  the L arrays of the **new global model**, its per-source statistics as metrics
  ``fda.<name>_s<j>`` (j = position in the order it was sent), which the strategy records
  under the sources' partition ids. The B' x m upload disappears; the target downloads N x m.

``fedgp.seed-round`` (W + r under both placements) seeds every client's training, so the two
placements train identically and produce the same global models up to the order of a float sum.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    log,
    ndarrays_to_parameters,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from flwr_pfl.core.aggregation import weighted_average
from flwr_pfl.core.fedgp import (
    FDAConfig,
    Phase,
    Placement,
    Rule,
    SourceUpdate,
    Stage,
    TargetUpdate,
    TensorRole,
    fda_round,
    model_delta,
    plan_round,
    source_weights,
    tensor_roles,
)
from flwr_pfl.errors import ConfigError, ReplyError
from flwr_pfl.strategies.base import NDArrays, PFLStrategy
from flwr_pfl.strategies.decode import decode_arrays
from flwr_pfl.strategies.validation import ClientReply, Scalar, check_arrays, describe_failures

STEP_UPLOADS = ("matrix", "summary")


class FDAStrategy(PFLStrategy):
    """The machinery FedGP, FedDA, Target Only and Source Only share.

    Args:
        config: the aggregation options (:class:`flwr_pfl.core.fedgp.FDAConfig`).
        target_partition: the target's partition id, if known on the server (checked against
            the replies); None learns it from the clients' ``is_target`` metric.
        is_buffer: one flag per global array (True for buffers such as BatchNorm statistics);
            None learns them from the clients' ``buffer_mask`` metric.
        step_upload: ``matrix`` (the B' x m step updates, Algorithm 1) or ``summary`` (FedDA
            auto only: one float, :func:`~flwr_pfl.core.fedgp.estimate_fedda_stats_from_summary`).
        evaluate_sources: also evaluate on the sources' test splits (source-domain accuracy).
        shuffle_sources: under the ``target`` placement, send the sources' models to the target
            in an order shuffled every round (App. C.1), so it cannot tell which source is which.
        **kwargs: :class:`~flwr_pfl.strategies.base.PFLStrategy`'s arguments, Flower's FedAvg
            arguments included (``fraction_fit`` < 1 and ``min_available_clients`` < ``num_clients``
            are refused; with ``accept_failures=False`` under the ``target`` placement, a failure
            in the sources' round skips the whole FDA round).
    """

    name = "fda"
    #: "fda" (FedGP / FedDA), "target_only" or "source_only"
    mode = "fda"

    def __init__(
        self,
        *,
        config: FDAConfig | None = None,
        target_partition: int | None = None,
        is_buffer: Sequence[bool] | None = None,
        step_upload: str = "matrix",
        evaluate_sources: bool = True,
        shuffle_sources: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _require_full_participation(self.name, self.fraction_fit, self.min_available_clients, self.num_clients)
        self.config = config or FDAConfig()
        if step_upload not in STEP_UPLOADS:
            raise ConfigError(f"step_upload={step_upload!r} is unknown; allowed: {', '.join(STEP_UPLOADS)}")
        if step_upload == "summary" and self.config.rule is not Rule.FEDDA:
            raise ConfigError("step_upload='summary' is FedDA-only: FedGP's tau^2 d^2 needs the step matrix")
        if target_partition is not None and not 0 <= target_partition < self.num_clients:
            raise ConfigError(
                f"target-partition={target_partition} is outside the federation of num-clients="
                f"{self.num_clients} (allowed: -1 for the last partition, or 0..{self.num_clients - 1})"
            )
        self.step_upload = step_upload
        self.evaluate_sources = evaluate_sources
        self.shuffle_sources = shuffle_sources
        self.target_partition = target_partition
        self.target_cid: str | None = None
        self.is_buffer: list[bool] | None = list(is_buffer) if is_buffer is not None else None
        self.target_history: list[float] = []
        self._round_metrics: dict[str, float] = {}
        self._eval_target: dict[str, float] = {}
        self._current: dict[str, Scalar] = {}  # this round's fedgp.* instructions
        self._failures: list[Any] = []  # this round's failed or rejected fit replies
        # target placement: the sources' replies of the current FDA round, in the order sent
        # to the target, kept between its two server rounds
        self._pending: list[ClientReply] = []
        self._sources_refused = False  # target placement: the sources' round was not aggregated

    # ---------------------------------------------------------------- schedule
    def plan(self, server_round: int):
        """The core's round plan, adjusted for the baselines (Target Only: no warm-up)."""
        r = self.run_round(server_round)
        if self.mode == "target_only":
            return plan_round(r, _replace(self.config, warmup_rounds=0, auto_weight=False, placement=Placement.SERVER))
        if self.mode == "source_only":
            return plan_round(r, _replace(self.config, placement=Placement.SERVER))
        return plan_round(r, self.config)

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        if self.plan(server_round).stage is not Stage.TARGET:
            return super().configure_fit(server_round, parameters, client_manager)
        # target placement, second half: the target alone, with the sources' models
        if self._sources_refused:
            log(WARNING, "round %d: the sources' round was not aggregated (accept_failures=False); this FDA "
                "round is skipped", self.run_round(server_round))
            self._sources_refused, self._pending = False, []
            return []
        proxy = client_manager.all().get(self.target_cid) if self.target_cid is not None else None
        if proxy is None:
            log(WARNING, "round %d: the target client is unknown or gone; this FDA round is skipped", self.run_round(server_round))
            self._pending = []
            return []
        return self.fit_instructions(server_round, parameters, [proxy])

    def fit_instructions(self, server_round: int, parameters: Parameters, clients: list[ClientProxy]):
        plan = self.plan(server_round)
        fda = plan.phase is Phase.FDA
        if plan.stage is Stage.SOURCES:
            self._pending = []  # never forward an earlier round's sources
            if self.target_cid is not None:
                clients = [c for c in clients if c.cid != self.target_cid]
        extra: dict[str, Scalar] = {
            "fedgp.phase": plan.phase.value,
            "fedgp.stage": plan.stage.value,
            "fedgp.seed-round": plan.seed_round,
            "fedgp.lr-scale": float(plan.lr_scale),
            "fedgp.sources-train": self.mode != "target_only" and plan.sources_train,
            "fedgp.target-trains": fda and self.mode != "source_only" and plan.target_trains,
            "fedgp.record-steps": bool(plan.record_step_updates and self.mode == "fda"),
            "fedgp.step-upload": self.step_upload,
            "fedgp.buffer-role": self.config.buffer_role.value,
            "fedgp.scalar-role": self.config.scalar_role.value,
            "fedgp.max-step-updates": int(self.config.max_step_updates or 0),
        }
        if plan.stage is Stage.TARGET:
            parameters, extra = self._target_payload(server_round, extra)
        config = self.fit_config(server_round, extra)
        self._current = extra
        return [(proxy, FitIns(parameters, dict(config))) for proxy in clients]

    def _target_payload(self, server_round: int, extra: dict[str, Scalar]) -> tuple[Parameters, dict[str, Scalar]]:
        """The target's instructions under the target placement: the global arrays, then the
        kept source models (order shuffled per round), their metadata and the options."""
        if self.shuffle_sources and len(self._pending) > 1:
            rng = np.random.default_rng([self.run_round(server_round), len(self._pending)])
            self._pending = [self._pending[i] for i in rng.permutation(len(self._pending))]
        meta = [{"n": r.num_examples, "lr": float(r.metrics["lr"]), "steps": int(r.metrics["num_steps"])} for r in self._pending]
        arrays = list(self.global_arrays or []) + [a for r in self._pending for a in r.arrays]
        options = {f"fedgp.cfg.{k}": v for k, v in self.config.to_scalars().items()}
        return ndarrays_to_parameters(arrays), {**extra, **options, "fedgp.sources": json.dumps(meta)}

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        if self.plan(server_round).stage is Stage.SOURCES:
            return []  # the global model has not changed since the last evaluation
        pairs = super().configure_evaluate(server_round, parameters, client_manager)
        if not self.evaluate_sources and self.target_cid is not None:
            pairs = [(p, ins) for p, ins in pairs if p.cid == self.target_cid]
            if not pairs:  # the target was not sampled: ask it directly
                proxy = client_manager.all().get(self.target_cid)
                if proxy is not None:
                    pairs = [(proxy, EvaluateIns(parameters, self.evaluate_config(server_round)))]
        return pairs

    # ---------------------------------------------------------------- replies
    def check_reply(self, server_round: int, proxy: ClientProxy, res: FitRes) -> ClientReply:
        metrics = dict(res.metrics)
        pid = self.check_partition(proxy.cid, metrics.get("partition_id", -1))
        who = f"{proxy.cid} (partition {pid})"
        arrays = decode_arrays(res.parameters)
        expected = self.expected_shapes(server_round)
        is_target = bool(metrics.get("is_target", 0))
        if metrics.get("skipped"):
            if arrays:
                raise ReplyError(f"client {who}: marked 'skipped' but sent {len(arrays)} arrays")
            check_arrays(who, [], [], res.num_examples)
        else:
            n_model = len(expected)
            check_arrays(who, arrays[:n_model], expected, res.num_examples, self.expected_dtypes(server_round))
            extra = arrays[n_model:]
            wants_matrix = (
                is_target
                and bool(self._current.get("fedgp.record-steps"))
                and self.step_upload == "matrix"
                and self._current.get("fedgp.stage") == Stage.ALL.value
            )
            if len(extra) != int(wants_matrix):
                raise ReplyError(f"client {who}: sent {len(arrays)} arrays, expected {n_model + int(wants_matrix)}")
            if wants_matrix:
                self._check_step_matrix(who, extra[0])
            for key in ("num_steps", "lr"):
                value = metrics.get(key)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value <= 0:
                    raise ReplyError(f"client {who}: metric {key!r} must be a positive number; got {value!r}")
        if not is_target and self.target_partition is not None and pid == self.target_partition:
            raise ConfigError(
                f"client {who} answered as a source but the server's target-partition="
                f"{self.target_partition}; its node config fedgp-role and target-partition disagree "
                "(allowed roles: 'target', 'source'; set the role on the target node only)"
            )
        self._learn_buffers(metrics.get("buffer_mask"), len(expected))
        if pid >= 0:
            self.partition_of[proxy.cid] = pid
        if is_target:
            self.target_cid = proxy.cid
        return ClientReply(proxy.cid, pid, res.num_examples, arrays, metrics)

    def _roles(self) -> list[TensorRole]:
        return tensor_roles(self.global_arrays or [], self.config, self.is_buffer)

    def _check_step_matrix(self, who: str, g: np.ndarray) -> None:
        m = int(sum(a.size for a, r in zip(self.global_arrays or [], self._roles()) if r is TensorRole.AGGREGATE))
        if g.ndim != 2 or g.shape[1] != m or g.shape[0] < 1:
            raise ReplyError(f"client {who}: step-update matrix has shape {g.shape}, expected (B, {m})")
        if not np.all(np.isfinite(g)):
            raise ReplyError(f"client {who}: step-update matrix contains NaN or Inf")

    def _learn_buffers(self, mask: Any, n: int) -> None:
        if self.is_buffer is not None or not isinstance(mask, str):
            return
        if len(mask) != n or set(mask) - {"0", "1"}:
            log(WARNING, "ignoring a malformed buffer_mask %r (need %d characters of 0/1)", mask, n)
            return
        self.is_buffer = [c == "1" for c in mask]

    # ---------------------------------------------------------------- aggregation
    def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[Parameters | None, dict[str, Scalar]]:
        self._failures = failures  # the base appends rejected replies to this list
        parameters, metrics = super().aggregate_fit(server_round, results, failures)
        if self.plan(server_round).stage is Stage.SOURCES:
            self._sources_refused = self.refuses_failures(len(failures))
        return parameters, metrics

    def aggregate_replies(self, server_round: int, replies: list[ClientReply]) -> NDArrays:
        glob = self.global_arrays
        assert glob is not None
        targets = [r for r in replies if r.metrics.get("is_target")]
        if len(targets) > 1:
            pids = sorted(r.partition_id for r in targets)
            raise ConfigError(
                f"round {server_round}: {len(targets)} clients claim the target role (partitions {pids}); "
                "exactly one may: set <algorithm>.target-partition or the node config fedgp-role once"
            )
        target = targets[0] if targets else None
        plan = self.plan(server_round)
        target_asked = not (plan.stage is Stage.SOURCES and self.target_cid is not None)
        if target is None and target_asked:
            self._check_target_absence(server_round, replies, plan.phase)
        if target is not None and self.target_partition is not None and target.partition_id != self.target_partition:
            raise ConfigError(
                f"partition {target.partition_id} claims the target role but target_partition="
                f"{self.target_partition}; the clients and the server disagree on the target"
            )
        sources = [r for r in replies if not r.metrics.get("is_target") and not r.metrics.get("skipped")]
        metrics: dict[str, float] = {"fda_round": float(plan.fda_round), "num_sources": float(len(sources))}
        self._round_metrics = metrics
        if plan.phase is Phase.WARMUP or self.mode == "source_only":
            if not sources:
                log(WARNING, "round %d: no source update; the global model is unchanged", self.run_round(server_round))
                return glob
            w = source_weights([r.num_examples for r in sources], self.config.source_weighting)
            return weighted_average([r.arrays for r in sources], list(w))
        if plan.stage is Stage.SOURCES:
            self._pending = sources
            return glob
        if target is None or target.metrics.get("skipped"):
            log(WARNING, "round %d: no update from the target client; the global model is unchanged", self.run_round(server_round))
            metrics["target_missing"] = 1.0
            return glob
        target_arrays = target.arrays[: len(glob)]
        if plan.stage is Stage.TARGET:
            return self._adopt_target_aggregate(target, target_arrays, metrics)
        if self.mode == "target_only" or not sources:
            if self.mode != "target_only":
                log(WARNING, "round %d: no source update; the target's model becomes the global model", self.run_round(server_round))
            return [np.asarray(a) for a in target_arrays]
        return self._fda_update(glob, target, target_arrays, sources, metrics)

    def _check_target_absence(self, server_round: int, replies: list[ClientReply], phase: Phase) -> None:
        """Stop the run when the target's absence from this round's replies is a configuration
        problem rather than a passing failure.

        * Every client answered and none is the target: nobody holds the role.
        * Some clients failed, the target is needed (an FDA round) and no reply of the run,
          fit or evaluate, ever came from it: the target node cannot even start (a misspelt
          ``fedgp-role``, more target samples asked for than it has, ...). Its error, among
          this round's failures, is quoted. Without this check the run would finish every round
          with ``target_missing`` = 1 and no adaptation at all.

        A target that answered before and fails now is a passing failure: the round keeps the
        global model (metric ``target_missing``).
        """
        configure = ("configure one: <algorithm>.target-partition (-1 = the last partition) or the "
                     "node config fedgp-role='target' on one node")
        if not self._failures:
            raise ConfigError(f"round {server_round}: all {len(replies)} clients replied and none is the target; {configure}")
        if self.target_cid is None and phase is Phase.FDA:
            raise ConfigError(
                f"round {server_round}: the target has never answered: no reply of this run came from "
                f"a client in the target role, and {len(self._failures)} client(s) failed this round: "
                f"{describe_failures(self._failures)}. Fix the target node's error, or {configure}"
            )

    def _adopt_target_aggregate(self, target: ClientReply, arrays: NDArrays, metrics: dict[str, float]) -> NDArrays:
        """Target placement: the target's reply is the new global model; its per-source
        statistics (``fda.<name>_s<j>``, j = position sent) are recorded by partition id."""
        pids = [r.partition_id for r in self._pending]
        metrics["num_sources"] = float(len(pids))
        for key, value in target.metrics.items():
            if not key.startswith("fda.") or isinstance(value, (str, bytes)):
                continue
            name = key[len("fda."):]
            stem, _, j = name.rpartition("_s")
            if stem and j.isdigit() and int(j) < len(pids):
                name = f"{stem}_p{pids[int(j)]}"
            metrics[name] = float(value)
        self._pending = []
        return [np.asarray(a) for a in arrays]

    def _fda_update(
        self, glob: NDArrays, target: ClientReply, target_arrays: NDArrays, sources: list[ClientReply], metrics: dict[str, float]
    ) -> NDArrays:
        """Server placement: :func:`~flwr_pfl.core.fedgp.fda_round` on the replies."""
        n_model = len(glob)
        step_matrix = target.arrays[n_model] if n_model < len(target.arrays) else None
        update = TargetUpdate(
            model_delta(target_arrays, glob),
            lr=float(target.metrics["lr"]),
            steps=int(target.metrics["num_steps"]),
            step_matrix=step_matrix,
            step_var=float(target.metrics["step_var"]) if "step_var" in target.metrics else None,
            step_rows=int(target.metrics.get("step_rows", 0)),
        )
        result = fda_round(glob, update, [source_update(r, glob) for r in sources], self.config, self._roles())
        for note in result.notes:
            log(WARNING, "%s", note)
        metrics.update(result.metrics([f"p{r.partition_id}" for r in sources]))
        return result.new_global

    def fit_metric_keys(self, replies: list[ClientReply]) -> list[str]:
        skip = ("is_target", "skipped", "n_model_arrays", "step_rows")
        return [k for k in super().fit_metric_keys(replies) if k not in skip and not k.startswith("fda.")]

    # ---------------------------------------------------------------- evaluation
    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        self._eval_target = {}
        for proxy, res in results:  # a target whose fit fails has still answered as the target
            if res.metrics.get("is_target") and self.target_cid is None:
                self.target_cid = proxy.cid
        loss, metrics = super().aggregate_evaluate(server_round, results, failures)
        if "target_loss" in self._eval_target:
            log(INFO, "round %d: target accuracy %.4f (last-5 mean %.4f)", self.run_round(server_round),
                self._eval_target.get("target_accuracy", float("nan")), self._eval_target.get("target_accuracy_last5", float("nan")))
            return self._eval_target["target_loss"], {**metrics, **self._eval_target}
        return loss, metrics

    def _notify(self, server_round: int, phase: str, metrics: dict[str, float], clients: dict[int, dict[str, Scalar]]) -> None:
        if phase == "fit":
            metrics = {**metrics, **self._round_metrics}
            self._round_metrics = {}
        elif phase == "evaluate":
            extra = self._target_metrics(clients)
            self._eval_target = extra
            metrics = {**metrics, **extra}
        super()._notify(server_round, phase, metrics, clients)

    def _target_metrics(self, clients: dict[int, dict[str, Scalar]]) -> dict[str, float]:
        out: dict[str, float] = {}
        target = [m for m in clients.values() if m.get("is_target")]
        sources = [m for m in clients.values() if not m.get("is_target")]
        if target:
            t = target[0]
            out["target_loss"] = float(t["loss"])
            if "accuracy" in t:
                self.target_history.append(float(t["accuracy"]))
                out["target_accuracy"] = float(t["accuracy"])
                out["target_accuracy_last5"] = float(np.mean(self.target_history[-5:]))
        if sources:
            n = np.array([float(m.get("num_examples", 1)) for m in sources])
            out["source_loss_wmean"] = float(np.average([float(m["loss"]) for m in sources], weights=n))
            if all("accuracy" in m for m in sources):
                out["source_accuracy_wmean"] = float(np.average([float(m["accuracy"]) for m in sources], weights=n))
        return out

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The base state plus the target's identity, the buffer flags, the target's accuracy
        history (``target_accuracy_last5``) and, under the target placement between an FDA
        round's two server rounds, the sources' kept replies."""
        pending = [
            {"cid": r.cid, "partition_id": r.partition_id, "num_examples": r.num_examples,
             "arrays": [a.copy() for a in r.arrays], "metrics": dict(r.metrics)}
            for r in self._pending
        ]
        return super().state_dict() | {
            "target_cid": self.target_cid,
            "is_buffer": None if self.is_buffer is None else list(self.is_buffer),
            "target_history": list(self.target_history),
            "pending": pending,
        }

    def load_state_dict(self, state: dict[str, Any], rounds_done: int) -> None:
        super().load_state_dict(state, rounds_done)
        self.target_cid = state.get("target_cid", self.target_cid)
        if state.get("is_buffer") is not None:
            self.is_buffer = [bool(x) for x in state["is_buffer"]]
        self.target_history = [float(a) for a in state.get("target_history", self.target_history)]
        self._pending = [
            ClientReply(str(r["cid"]), int(r["partition_id"]), int(r["num_examples"]),
                        [np.asarray(a) for a in r["arrays"]], dict(r["metrics"]))
            for r in state.get("pending", [])
        ]


def _require_full_participation(name: str, fraction_fit: float, min_available: int, num_clients: int) -> None:
    """Refuse ``fraction_fit`` < 1, or starting rounds before every client is connected
    (``min_available_clients`` < ``num_clients``), before any training.

    The paper's protocol is cross-silo with full participation: every FDA round is built on the
    target's update (and Target Only trains nothing else), so a round that leaves the target out
    cannot aggregate. The strategy learns which client is the target only from its replies, so
    it cannot guarantee the target a place in a partial sample (nor in a round that starts
    before it connects); sub-sampling the sources only (the official code's unused
    ``part_rate``) is not offered.
    """
    if fraction_fit < 1.0:
        raise ConfigError(
            f"fraction-fit={fraction_fit} is not allowed for {name}: every round needs the target "
            "client, and the FedGP/FedDA family (FedGP, FedDA, Target Only, Source Only) samples "
            "every client every round; allowed: fraction-fit=1.0"
        )
    if min_available < num_clients:
        raise ConfigError(
            f"min_available_clients={min_available} < num_clients={num_clients} is not allowed for {name}: every "
            "round needs every client, the target included, so rounds wait for all of them"
        )


def source_update(reply: ClientReply, glob: NDArrays) -> SourceUpdate:
    """A source's reply as the core's :class:`~flwr_pfl.core.fedgp.SourceUpdate`."""
    return SourceUpdate(
        model_delta(reply.arrays, glob), reply.num_examples, float(reply.metrics["lr"]), int(reply.metrics["num_steps"])
    )


def _replace(cfg: FDAConfig, **changes: Any) -> FDAConfig:
    from dataclasses import replace

    return replace(cfg, **changes)


class FedGP(FDAStrategy):
    """FedGP (Definition 4.3 / App. C.9): the target update plus the sources' updates projected
    onto (and filtered by) the target direction, per tensor; fixed beta or auto-weighted
    (Eq. 3). ``config.rule`` must be ``fedgp``."""

    name = "fedgp"

    def __init__(self, *, config: FDAConfig | None = None, **kwargs: Any) -> None:
        config = config or FDAConfig(rule=Rule.FEDGP)
        if config.rule is not Rule.FEDGP:
            raise ConfigError(f"FedGP needs config.rule='fedgp'; got {config.rule.value!r} (use FedDA)")
        super().__init__(config=config, **kwargs)


class FedDA(FDAStrategy):
    """FedDA (Definition 4.1): the convex combination (1 - beta_i) Delta_T + beta_i Delta_i;
    fixed beta or auto-weighted (Eq. 3). ``config.rule`` must be ``fedda``."""

    name = "fedda"

    def __init__(self, *, config: FDAConfig | None = None, **kwargs: Any) -> None:
        config = config or FDAConfig(rule=Rule.FEDDA)
        if config.rule is not Rule.FEDDA:
            raise ConfigError(f"FedDA needs config.rule='fedda'; got {config.rule.value!r} (use FedGP)")
        super().__init__(config=config, **kwargs)


class TargetOnly(FDAStrategy):
    """Target Only (beta = 0): the target trains alone from the global model; the sources idle.
    No warm-up (the DomainBed code's Target Only)."""

    name = "target-only"
    mode = "target_only"


class SourceOnly(FDAStrategy):
    """Source Only: FedAvg over the sources (equal to FedDA with beta = 1 on every floating
    tensor); the target never trains and only evaluates."""

    name = "source-only"
    mode = "source_only"
