"""The base of every strategy in the suite: sampling, reply checks, metrics, results, state.

Subclasses say what the wire carries and how to combine it, by overriding
:meth:`PFLStrategy.expected_shapes`, :meth:`PFLStrategy.aggregate_replies` and, for per-client
payloads, :meth:`PFLStrategy.fit_instructions`. Everything else (waiting for clients, rejecting
bad replies, summarising metrics, recording results, checkpoint state) is written once here.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetPropertiesIns,
    Parameters,
    log,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg

from flwr_pfl.core.aggregation import weighted_average
from flwr_pfl.core.metrics import aggregate_client_metrics
from flwr_pfl.errors import ReplyError
from flwr_pfl.strategies.decode import decode_arrays
from flwr_pfl.strategies.sampling import PARTITION_QUERY, in_partition_order, sample_indices, sampling_rng
from flwr_pfl.strategies.validation import ClientReply, Scalar, check_arrays

NDArrays = list[np.ndarray]
#: called after every evaluation round with (round, phase, aggregated metrics, per-client metrics)
RoundCallback = Callable[[int, str, dict[str, float], dict[int, dict[str, Scalar]]], None]


class PFLStrategy(FedAvg):
    """FedAvg's sampling with the suite's reply checks, metric summaries and state.

    Wire (this base class, i.e. FedAvg): fit and evaluate instructions carry the global arrays
    in the model's ``state_dict`` order; fit replies carry arrays of the same shapes plus
    metrics ``partition_id``, ``train_loss``, ``train_seconds``.

    Args:
        num_clients: clients expected in the federation; the first round waits for all of them
            (up to ``wait_timeout`` seconds) so that sampling sees the whole federation.
        fraction_fit / fraction_evaluate: fraction of clients sampled per round.
        min_fit_clients: a round needs at least this many sampled clients.
        initial_arrays: the starting global arrays; None asks one client for them.
        fit_config: scalars added to every fit instruction (``server-round`` is always added).
        on_round: called after each fit and evaluate aggregation (results writers hook in here).
        wait_timeout: seconds to wait for ``num_clients`` clients before giving up with a
            message that names the numbers.
        seed: seeds client sampling (:mod:`flwr_pfl.strategies.sampling`): the same seed
            samples the same partitions in every round of every rerun.
    """

    name = "fedavg"
    #: the run's total number of rounds (0: unknown); the app sets it after building the
    #: strategy, for algorithms that treat the last round differently (pFedFDA: all clients)
    num_rounds: int = 0
    #: whether every sampled client's partition id must be known before instructions are built
    #: (algorithms with per-client server state); otherwise ids are asked for only when a
    #: round samples part of the federation
    needs_partition_ids: bool = False
    #: clients contacted at once in the strategy's own exchanges (partition queries, setup
    #: rounds); the app sets it from ``server-workers``, like the legacy server's pool
    max_workers: int = 32

    def __init__(
        self,
        *,
        num_clients: int,
        fraction_fit: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_fit_clients: int = 1,
        initial_arrays: NDArrays | None = None,
        fit_config: dict[str, Scalar] | None = None,
        on_round: RoundCallback | None = None,
        wait_timeout: float = 600.0,
        seed: int = 0,
    ) -> None:
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        for key, value in (("fraction_fit", fraction_fit), ("fraction_evaluate", fraction_evaluate)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{key} must be in [0, 1], got {value}")
        super().__init__(
            fraction_fit=fraction_fit,
            fraction_evaluate=fraction_evaluate,
            min_fit_clients=min(min_fit_clients, num_clients),
            min_evaluate_clients=1 if fraction_evaluate > 0 else 0,
            min_available_clients=num_clients,
            initial_parameters=ndarrays_to_parameters(initial_arrays) if initial_arrays is not None else None,
        )
        self.num_clients = num_clients
        self.extra_fit_config = dict(fit_config or {})
        self.on_round = on_round
        self.wait_timeout = wait_timeout
        self.seed = int(seed)
        self.global_arrays: NDArrays | None = initial_arrays
        self.round_offset = 0  # rounds completed before a resume
        self.partition_of: dict[str, int] = {}  # cid -> partition id, learned from replies

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_clients={self.num_clients}, fraction_fit={self.fraction_fit})"

    # ---------------------------------------------------------------- sampling and instructions
    def wait_for_clients(self, client_manager: ClientManager) -> None:
        """Wait up to ``wait_timeout`` seconds for ``num_clients`` connected clients."""
        if client_manager.num_available() < self.num_clients:
            log(INFO, "waiting up to %.0f s for num-clients=%d clients (%d connected); in simulation "
                "the federation's num-supernodes must equal num-clients",
                self.wait_timeout, self.num_clients, client_manager.num_available())
        if not client_manager.wait_for(self.num_clients, timeout=int(self.wait_timeout)):
            raise RuntimeError(
                f"only {client_manager.num_available()} of num-clients={self.num_clients} clients "
                f"connected within {self.wait_timeout:.0f} s; in simulation, set the federation's "
                f"num-supernodes to {self.num_clients} (flwr run . --federation-config "
                f"\"num-supernodes={self.num_clients}\") or change num-clients"
            )

    def query_properties(
        self, server_round: int, clients: list[ClientProxy], config: dict[str, Scalar]
    ) -> list[dict[str, Scalar] | BaseException]:
        """One ``get_properties(config)`` exchange with each of ``clients``, in parallel; the
        answers (or the error of a client that could not answer) in the order of ``clients``."""
        ins = GetPropertiesIns(dict(config))

        def ask(proxy: ClientProxy) -> dict[str, Scalar] | BaseException:
            try:
                return dict(proxy.get_properties(ins, timeout=self.wait_timeout, group_id=server_round).properties)
            except Exception as err:  # no answer or an error reply
                return err

        if not clients:
            return []
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.workers_for(len(clients))) as pool:
            return list(pool.map(ask, clients))

    def workers_for(self, num_clients: int) -> int:
        """Threads for an exchange with ``num_clients`` clients (at least 1, at most ``max_workers``)."""
        return max(1, min(self.max_workers, num_clients))

    def learn_partitions(self, server_round: int, clients: Iterable[ClientProxy]) -> None:
        """Ask the clients whose partition id is unknown for it; a client that cannot answer
        stays unknown and is asked again next time."""
        unknown = [p for p in clients if p.cid not in self.partition_of]
        config = {**PARTITION_QUERY, "server-round": self.round_offset + server_round}
        for proxy, answer in zip(unknown, self.query_properties(server_round, unknown, config)):
            partition = _partition_id(answer)
            if partition is not None and 0 <= partition < self.num_clients:
                self.partition_of[proxy.cid] = partition
            else:
                log(WARNING, "round %d: client %s did not report a partition id in [0, %d): %r",
                    server_round, proxy.cid, self.num_clients, answer)

    def all_clients(self, server_round: int, client_manager: ClientManager) -> list[ClientProxy]:
        """Every connected client whose partition id is known, in partition order (after waiting
        for ``num_clients``)."""
        self.wait_for_clients(client_manager)
        clients = list(client_manager.all().values())
        self.learn_partitions(server_round, clients)
        known = [p for p in clients if p.cid in self.partition_of]
        return sorted(known, key=lambda p: (self.partition_of[p.cid], p.cid))

    def _sample(
        self, client_manager: ClientManager, server_round: int, fraction: float, min_clients: int, stage: str = "fit"
    ) -> list[ClientProxy]:
        """``max(fraction * K, min_clients)`` of the K connected clients, the same ones in every
        rerun: drawn by partition id from the round's own seeded generator
        (:func:`~flwr_pfl.strategies.sampling.sampling_rng`), never from Python's ``random``."""
        self.wait_for_clients(client_manager)
        available = client_manager.num_available()
        size = min(max(int(available * fraction), min_clients), available)
        if size >= available and not self.needs_partition_ids:
            clients = list(client_manager.all().values())  # everyone: no need to know who is who
            return sorted(clients, key=lambda p: (self.partition_of.get(p.cid, -1), p.cid))
        clients = self.all_clients(server_round, client_manager)
        rng = sampling_rng(self.seed, stage, self.round_offset + server_round)
        return [clients[i] for i in sample_indices(len(clients), size, rng)]

    def fit_instructions(
        self, server_round: int, parameters: Parameters, clients: list[ClientProxy]
    ) -> list[tuple[ClientProxy, FitIns]]:
        """One FitIns per sampled client; override to send each client its own payload."""
        config: dict[str, Scalar] = {**self.extra_fit_config, "server-round": self.round_offset + server_round}
        return [(proxy, FitIns(parameters, dict(config))) for proxy in clients]

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        if self.global_arrays is None:
            self.global_arrays = parameters_to_ndarrays(parameters)
        clients = self._sample(client_manager, server_round, self.fraction_fit, self.min_fit_clients)
        return self.fit_instructions(server_round, parameters, clients)

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        if self.fraction_evaluate == 0.0:
            return []
        clients = self._sample(client_manager, server_round, self.fraction_evaluate, self.min_evaluate_clients, "evaluate")
        config: dict[str, Scalar] = {"server-round": self.round_offset + server_round}
        return [(proxy, EvaluateIns(parameters, dict(config))) for proxy in clients]

    # ---------------------------------------------------------------- replies
    def expected_shapes(self, server_round: int) -> list[tuple[int, ...]]:
        """Shapes of the arrays a fit reply must carry (default: those of the global arrays)."""
        return [tuple(a.shape) for a in (self.global_arrays or [])]

    def check_reply(self, server_round: int, proxy: ClientProxy, res: FitRes) -> ClientReply:
        """Decode and validate one fit reply; raise ReplyError naming the client and problem."""
        partition_id = int(res.metrics.get("partition_id", -1))
        who = f"{proxy.cid} (partition {partition_id})"
        arrays = decode_arrays(res.parameters)
        check_arrays(who, arrays, self.expected_shapes(server_round), res.num_examples)
        if partition_id >= 0:
            self.partition_of[proxy.cid] = partition_id
        return ClientReply(proxy.cid, partition_id, res.num_examples, arrays, dict(res.metrics))

    def aggregate_replies(self, server_round: int, replies: list[ClientReply]) -> NDArrays:
        """Combine validated replies into the new global arrays (default: FedAvg, Eq. in Alg. 1)."""
        if not replies[0].arrays:
            return []
        return weighted_average([r.arrays for r in replies], [r.num_examples for r in replies])

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        start = time.perf_counter()
        replies: list[ClientReply] = []
        rejected = 0
        for proxy, res in in_partition_order(results):  # sums must not depend on arrival order
            try:
                replies.append(self.check_reply(server_round, proxy, res))
            except ReplyError as err:
                log(WARNING, "round %d: rejected a fit reply: %s", server_round, err)
                failures.append((proxy, res))
                rejected += 1
        for failure in failures:
            if isinstance(failure, BaseException):
                log(WARNING, "round %d: a client failed: %r", server_round, failure)
        metrics: dict[str, Any] = {"num_failures": float(len(failures)), "num_rejected": float(rejected)}
        if not replies:
            log(WARNING, "round %d: no valid fit replies; the global model is unchanged", server_round)
            self._notify(server_round, "fit", metrics, {})
            return None, metrics
        arrays = self.aggregate_replies(server_round, replies)
        self.global_arrays = arrays
        metrics |= aggregate_client_metrics(
            [(r.num_examples, r.metrics) for r in replies], keys=self.fit_metric_keys(replies)
        )
        metrics["aggregate_seconds"] = time.perf_counter() - start
        self._notify(server_round, "fit", metrics, {r.partition_id: r.metrics for r in replies})
        return ndarrays_to_parameters(arrays), metrics

    def fit_metric_keys(self, replies: list[ClientReply]) -> list[str]:
        """Numeric fit metrics to summarise (all but bookkeeping)."""
        keys = {k for r in replies for k, v in r.metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return sorted(keys - {"partition_id"})

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        valid: list[tuple[ClientProxy, EvaluateRes]] = []
        for proxy, res in in_partition_order(results):
            if res.num_examples > 0 and np.isfinite(res.loss):
                valid.append((proxy, res))
            else:
                log(WARNING, "round %d: rejected evaluation of client %s (loss %s, %d examples)",
                    server_round, proxy.cid, res.loss, res.num_examples)
        metrics: dict[str, Any] = {"num_failures": float(len(failures) + len(results) - len(valid))}
        if not valid:
            self._notify(server_round, "evaluate", metrics, {})
            return None, metrics
        per_client = [(r.num_examples, {**r.metrics, "loss": r.loss}) for _, r in valid]
        metrics |= aggregate_client_metrics(per_client)
        clients = {int(r.metrics.get("partition_id", -1)): {**r.metrics, "loss": r.loss, "num_examples": r.num_examples} for _, r in valid}
        self._notify(server_round, "evaluate", metrics, clients)
        log(INFO, "round %d: %s", server_round, _headline(metrics))
        return metrics.get("loss_wmean"), metrics

    def _notify(self, server_round: int, phase: str, metrics: dict[str, float], clients: dict[int, dict[str, Scalar]]) -> None:
        if self.on_round is not None:
            self.on_round(self.round_offset + server_round, phase, metrics, clients)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: the global arrays and the rounds already done."""
        return {"global_arrays": [a.copy() for a in (self.global_arrays or [])], "round_offset": self.round_offset}

    def load_state_dict(self, state: dict[str, Any], rounds_done: int) -> None:
        """Resume from :meth:`state_dict`; the next round is numbered ``rounds_done + 1``."""
        self.global_arrays = [np.asarray(a) for a in state["global_arrays"]]
        self.initial_parameters = ndarrays_to_parameters(self.global_arrays)
        self.round_offset = rounds_done


def _partition_id(answer: dict[str, Scalar] | BaseException) -> int | None:
    """The ``partition_id`` of a ``get_properties`` answer, or None."""
    if isinstance(answer, BaseException):
        return None
    try:
        return int(answer["partition_id"])
    except (KeyError, TypeError, ValueError):
        return None


def _headline(metrics: dict[str, float]) -> str:
    keys = ("accuracy_wmean", "accuracy_min", "loss_wmean", "acc_domain_min")
    return ", ".join(f"{k}={metrics[k]:.4f}" for k in keys if k in metrics)
