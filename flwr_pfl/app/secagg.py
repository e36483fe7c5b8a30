"""Secure aggregation of the fit replies with Flower's SecAgg+ (run-config key ``secure-aggregation``).

SecAgg+ (Bell et al., CCS 2020) lets the server learn the sum of the clients' vectors and
nothing else about any one of them: each client quantizes its vector and adds pairwise masks
agreed with its neighbours (which cancel in the sum) and a private mask (whose seed it
secret-shares with them); a client that drops out mid-protocol has its masks removed from the
shares of the others. The protocol is Flower's own: :class:`~flwr.server.workflow.SecAggPlusWorkflow`
on the server (legacy flavour, ``api = "numpyclient"``) and
:func:`~flwr.client.mod.secaggplus_mod` on the clients. Each client uploads
``[w, w * arrays]`` with ``w = num_examples / max_weight``, so the server obtains the
example-weighted mean of the replies (FedAvg's aggregate) and the clients' metrics, which are
not masked.

What this module adds around Flower's protocol:

* :class:`SecureAggregation` checks the settings before training, for the number of clients a
  round samples: a protocol that cannot reach its threshold halts every round (in Flower,
  logged, and the round "completes" without training);
* :func:`secagg_client_mod` refuses, on the client, a reply the protocol would corrupt without a
  word: more examples than ``max_weight`` (its weight overflows) or a value outside
  ``clipping_range`` once weighted (quantization clips it);
* :func:`run_secure` drives the rounds in Flower's :class:`~flwr.server.workflow.DefaultWorkflow`
  with the suite's bookkeeping (failures, checkpoints), and a round in which the protocol halted
  counts as a round in which no client trained, never as a success.

The strategy receives, for every client that completed the protocol, a reply whose arrays are
the aggregate (:meth:`~flwr_pfl.strategies.base.PFLStrategy.aggregate_replies` takes it as
it is); it cannot see, screen or clip one client's update, so the algorithms that need to
(:attr:`~flwr_pfl.strategies.base.PFLStrategy.robust_refusal`) refuse secure aggregation, and
it does not combine with the reply bounds or client-level DP (both act on single updates).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from logging import WARNING
from typing import Any, cast

import numpy as np
from flwr.app import Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.app.message_type import MessageType
from flwr.common import log, parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE
from flwr.server import ServerConfig
from flwr.server.compat import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, Key
from flwr.server.workflow.default_workflows import default_evaluate_workflow
from flwr.serverapp import Grid

from flwr_pfl.app.results import ResultsWriter
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.base import PFLStrategy
from flwr_pfl.training.seed import client_seed

#: the values of the run-config key ``secure-aggregation``
SECURE_AGGREGATIONS = ("off", "secagg+")
#: the run-config key a client reads to know that its run aggregates securely
RUN_KEY = "secure-aggregation"


@dataclass(frozen=True)
class SecureAggregation:
    """SecAgg+ settings (run-config keys ``secagg-*``), checked when built.

    Attributes:
        num_shares: > 2: the shares of each client's secrets (its neighbours, itself included);
            in (0, 1]: that fraction of the clients a round samples (Flower rounds it and makes
            it odd). More shares tolerate more dropouts and cost more.
        threshold: >= 2: the shares that reconstruct a secret; in (0, 1): that fraction of the
            shares (at least 2). A higher threshold resists more colluding clients and
            tolerates fewer dropouts: a round goes on while every client keeps ``threshold``
            active neighbours.
        clipping_range: each weighted value ``w * x`` must lie in ``[-clipping_range,
            clipping_range]``; quantization would clip it (the client refuses instead).
        quantization_range: the integer levels of ``[-clipping_range, clipping_range]``; the
            rounding error of a weighted value is at most ``clipping_range / quantization_range``.
        max_weight: the largest ``num_examples`` a client may train on (``w`` is
            ``num_examples / max_weight``); a client with more refuses.
    """

    num_shares: float = 1.0
    threshold: float = 0.5
    clipping_range: float = 8.0
    quantization_range: int = 1 << 22
    max_weight: float = 1000.0

    def __post_init__(self) -> None:
        if not (self.num_shares > 2 and float(self.num_shares).is_integer()) and not 0 < self.num_shares <= 1:
            raise ConfigError(f"secagg-num-shares={self.num_shares}: an integer > 2 (shares per client) or a fraction in "
                              "(0, 1] of the clients a round samples")
        if not (self.threshold >= 2 and float(self.threshold).is_integer()) and not 0 < self.threshold < 1:
            raise ConfigError(f"secagg-threshold={self.threshold}: an integer >= 2 (shares that reconstruct a secret) "
                              "or a fraction in (0, 1) of the shares")
        if self.num_shares > 2 and self.threshold >= 2 and self.threshold >= self.num_shares:
            raise ConfigError(f"secagg-threshold={self.threshold:g} must be less than secagg-num-shares={self.num_shares:g}")
        if not self.clipping_range > 0:
            raise ConfigError(f"secagg-clipping-range={self.clipping_range} must be > 0")
        if not 0 < self.quantization_range < 1 << 32 or bin(self.quantization_range).count("1") != 1:
            raise ConfigError(f"secagg-quantization-range={self.quantization_range} must be a power of 2 below 2**32 "
                              "(the protocol's masks are drawn modulo 2**32)")
        if not self.max_weight >= 1:
            raise ConfigError(f"secagg-max-weight={self.max_weight} must be >= 1 (the most examples a client trains on)")

    def shares_and_threshold(self, sampled: int) -> tuple[int, int]:
        """The shares and threshold Flower's workflow derives for a round of ``sampled`` clients."""
        if self.num_shares > 2:
            shares = int(self.num_shares)
        else:
            shares = round(self.num_shares * sampled)
            if shares < sampled and shares % 2 == 0:
                shares += 1
            if shares <= 2:
                shares = sampled
        if shares != sampled and shares % 2 == 0:
            shares += 1
        threshold = int(self.threshold) if self.threshold >= 2 else max(round(self.threshold * shares), 2)
        return shares, threshold

    def check_sampled(self, sampled: int) -> None:
        """ConfigError, before training, when a round of ``sampled`` clients cannot complete the
        protocol even with no client dropping out (Flower would halt every round)."""
        if sampled < 3:
            raise ConfigError(f"secure-aggregation needs at least 3 clients per round (a sum of two reveals each one to "
                              f"the other), but a round samples {sampled}; raise fraction-fit or num-clients")
        shares, threshold = self.shares_and_threshold(sampled)
        neighbours = min(shares, sampled)  # each client's neighbourhood, itself included
        if threshold > neighbours:
            raise ConfigError(f"secure-aggregation: secagg-threshold gives {threshold} shares to reconstruct a secret, but "
                              f"a client has only {neighbours} neighbours (itself included) in a round of {sampled} "
                              "clients; every round would halt. Lower secagg-threshold or raise secagg-num-shares")

    def workflow(self, timeout: float | None) -> KeptStateSecAggPlus:
        """Flower's server side of the protocol with these settings."""
        return KeptStateSecAggPlus(
            num_shares=int(self.num_shares) if self.num_shares > 2 else float(self.num_shares),
            reconstruction_threshold=int(self.threshold) if self.threshold >= 2 else float(self.threshold),
            max_weight=self.max_weight,
            clipping_range=self.clipping_range,
            quantization_range=self.quantization_range,
            timeout=timeout,
        )


class KeptStateSecAggPlus(SecAggPlusWorkflow):
    """Flower's workflow, keeping the latest round's protocol state (whose failures, the clients'
    errors, Flower drops when the protocol halts), and mending how it treats a client that drops
    out during the key exchange.

    Flower 1.42 counts such a client among the dead ones whose masks the others must help
    remove, so in the unmask stage it asks every other client for shares of that client's
    secret, which none received (a KeyError in each of them): the round halts. Nobody's vector
    holds a mask shared with it either, since masks are agreed only with the neighbours whose
    encrypted shares arrived. After the key exchange the protocol is therefore over the clients
    that completed it: :meth:`share_keys_stage` narrows the sampled clients and their
    neighbourhoods to them.
    """

    state: WorkflowState

    def setup_stage(self, grid: Grid, context: LegacyContext, state: WorkflowState) -> bool:
        self.state = state
        return super().setup_stage(grid, context, state)

    def share_keys_stage(self, grid: Grid, context: LegacyContext, state: WorkflowState) -> bool:
        go_on = super().share_keys_stage(grid, context, state)
        shared = set(state.active_node_ids)
        state.sampled_node_ids = shared
        state.nid_to_neighbours = {nid: neighbours & shared for nid, neighbours in state.nid_to_neighbours.items()
                                   if nid in shared}
        return go_on


# ---------------------------------------------------------------------------- client side
def secure_run(context: Context) -> bool:
    """Whether the node's run aggregates securely (its run config says so)."""
    return context.run_config.get(RUN_KEY, "off") != "off"


def secagg_client_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """ClientApp mod: the client side of SecAgg+ (Flower's :func:`secaggplus_mod`) for a run with
    secure aggregation, with the reply checked before it is masked (:func:`check_maskable`).

    In such a run a train message without the protocol's stage is refused: the client would
    otherwise send its update in the clear to a server that was to see only the sum."""
    if message.metadata.message_type != MessageType.TRAIN:
        return call_next(message, context)
    staged = RECORD_KEY_CONFIGS in message.content.config_records
    if not secure_run(context):
        if staged:
            raise ValueError("a secure-aggregation stage arrived in a run without secure-aggregation; refused")
        return call_next(message, context)
    if not staged:
        raise ValueError("this run aggregates securely (secure-aggregation), but the train message carries no "
                         "SecAgg+ stage: the reply would reach the server in the clear; refused")

    def checked(inner: Message, ctxt: Context) -> Message:
        reply = call_next(inner, ctxt)
        if not reply.has_error():
            state = ctxt.state.config_records[RECORD_KEY_STATE]
            fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
            check_maskable(parameters_to_ndarrays(fitres.parameters), fitres.num_examples,
                           float(cast(float, state["max_weight"])), float(cast(float, state["clipping_range"])))
        return reply

    with rounding_seeded(context, message):
        return secaggplus_mod(message, context, checked)


@contextmanager
def rounding_seeded(context: Context, message: Message) -> Iterator[None]:
    """NumPy's global generator seeded per run seed, node and round for the block, then restored.

    Flower's SecAgg+ quantizes with stochastic rounding drawn from NumPy's global generator; seeded
    like this, the same config and seed give the same aggregate on every engine, and no other code
    sees its draws. The rounding is not what keeps a reply secret (the masks are)."""
    node = context.node_config.get("partition-id", context.node_id)
    seed = client_seed(int(context.run_config.get("seed", 0)), int(node), int(message.metadata.group_id) if message.metadata.group_id.isdigit() else 0)
    saved = np.random.get_state()
    np.random.seed(seed % (1 << 32))
    try:
        yield
    finally:
        np.random.set_state(saved)


def check_maskable(arrays: Sequence[np.ndarray], num_examples: int, max_weight: float, clipping_range: float) -> None:
    """ValueError when SecAgg+ would corrupt this reply without a word: ``num_examples`` above
    ``max_weight`` (the weight overflows the quantized range) or a weighted value
    ``num_examples / max_weight * x`` outside ``[-clipping_range, clipping_range]`` (it would be
    clipped), or a value that is not finite."""
    if num_examples > max_weight:
        raise ValueError(f"SecAgg+: this client trained on {num_examples} examples, more than secagg-max-weight="
                         f"{max_weight:g}; its weight would overflow the protocol's range. Set secagg-max-weight to at "
                         "least the largest client's number of training examples")
    weight = num_examples / max_weight
    for index, array in enumerate(arrays):
        values = np.asarray(array, dtype=np.float64)
        if values.size == 0:
            continue
        if not np.isfinite(values).all():
            raise ValueError(f"SecAgg+: array {index} of the reply holds NaN or Inf; it cannot be aggregated")
        largest = float(np.abs(values).max())
        if largest * weight > clipping_range:
            raise ValueError(f"SecAgg+: array {index} of the reply holds {largest:.4g}, which weighted by "
                             f"{num_examples}/{max_weight:g} exceeds secagg-clipping-range={clipping_range:g} and would "
                             "be clipped; raise secagg-clipping-range (or secagg-max-weight)")


# ---------------------------------------------------------------------------- server side
class RecordingStrategy(Strategy):
    """The run's strategy as Flower's workflow calls it, telling the results writer which clients
    failed in each phase, as :class:`~flwr_pfl.app.flavours.RoundServer` does in the plain loop."""

    def __init__(self, logic: PFLStrategy, writer: ResultsWriter) -> None:
        self.logic = logic
        self.writer = writer
        self.sampled: dict[str, int] = {}  # phase -> clients asked in the latest round
        self.aggregated: set[int] = set()  # rounds whose fit replies reached aggregate_fit

    def initialize_parameters(self, client_manager: Any) -> Any:
        return self.logic.initialize_parameters(client_manager)

    def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> Any:
        instructions = self.logic.configure_fit(server_round, parameters, client_manager)
        self.sampled["fit"] = len(instructions)
        return instructions

    def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
        self.aggregated.add(server_round)
        failures = distinct_failures(failures)
        answer = self.logic.aggregate_fit(server_round, results, failures)
        self.writer.record_failures(self.logic.run_round(server_round), "fit", failures, len(results) + len(failures))
        return answer

    def configure_evaluate(self, server_round: int, parameters: Any, client_manager: Any) -> Any:
        return self.logic.configure_evaluate(server_round, parameters, client_manager)

    def aggregate_evaluate(self, server_round: int, results: Any, failures: Any) -> Any:
        answer = self.logic.aggregate_evaluate(server_round, results, failures)
        self.writer.record_failures(self.logic.run_round(server_round), "evaluate", failures, len(results) + len(failures))
        return answer

    def evaluate(self, server_round: int, parameters: Any) -> Any:
        return self.logic.evaluate(server_round, parameters)


def distinct_failures(failures: list[Any]) -> list[Any]:
    """``failures`` with each client's error once: Flower 1.42's workflow wraps the error reply
    of a client that failed at the masked-vector stage into two exceptions (one per loop over
    the replies), which would count one failed client twice."""
    seen: set[int] = set()
    distinct = []
    for failure in failures:
        wrapped = failure.args[0] if isinstance(failure, Exception) and failure.args else None
        key = id(wrapped) if wrapped is not None and not isinstance(wrapped, str) else id(failure)
        if key not in seen:
            seen.add(key)
            distinct.append(failure)
    return distinct


class SecAggHalted(RuntimeError):
    """A round whose SecAgg+ protocol stopped before the sum (too many clients dropped out)."""


def fit_workflow(secagg: KeptStateSecAggPlus, strategy: RecordingStrategy) -> Callable[[Grid, Context], None]:
    """Flower's SecAgg+ fit round. Where the protocol halted, Flower's workflow returns without
    calling the strategy (and the round would pass for one that trained); here the strategy then
    aggregates no reply and every client asked as failed, so the round's fit row records it (the
    global model is unchanged, and a run of such rounds has trained nothing:
    :func:`~flwr_pfl.app.results.judge_run`)."""

    def fit(grid: Grid, context: Context) -> None:
        server_round = int(cast(int, context.state.config_records[MAIN_CONFIGS_RECORD][Key.CURRENT_ROUND]))
        secagg(grid, cast(LegacyContext, context))  # its setup stage asks configure_fit: sampled is this round's
        if server_round not in strategy.aggregated and strategy.sampled["fit"]:
            asked = strategy.sampled["fit"]
            log(WARNING, "round %d: secure aggregation halted: too few of the %d clients asked completed the protocol "
                "to reconstruct the sum; the global model is unchanged", strategy.logic.run_round(server_round), asked)
            errors = distinct_failures(secagg.state.failures)  # set by setup_stage, which ran: clients were sampled
            halted = [SecAggHalted(f"secure aggregation halted: too few of the {asked} clients completed the protocol")
                      for _ in range(asked - len(errors))] + errors
            strategy.aggregate_fit(server_round, [], halted)  # the round's fit row: every client asked lost

    return fit


def evaluate_workflow(strategy: RecordingStrategy) -> Callable[[Grid, Context], None]:
    """Flower's evaluation round, then the round's end for the results writer (checkpoints)."""

    def evaluate(grid: Grid, context: Context) -> None:
        default_evaluate_workflow(grid, context)
        server_round = int(cast(int, context.state.config_records[MAIN_CONFIGS_RECORD][Key.CURRENT_ROUND]))
        strategy.writer.end_round(strategy.logic.run_round(server_round))

    return evaluate


def secure_driver(settings: SecureAggregation) -> Callable[..., None]:
    """A round driver of :mod:`flwr_pfl.app.flavours`' signature that aggregates with SecAgg+."""

    def run_secure(grid: Grid, strategy: PFLStrategy, writer: ResultsWriter, workers: int, rounds: int,
                   round_timeout: float | None) -> None:
        recording = RecordingStrategy(strategy, writer)
        context = LegacyContext(
            Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(), run_config={}),
            config=ServerConfig(num_rounds=rounds, round_timeout=round_timeout),
            strategy=recording,
        )
        workflow = DefaultWorkflow(fit_workflow=fit_workflow(settings.workflow(round_timeout), recording),
                                   evaluate_workflow=evaluate_workflow(recording))
        workflow(grid, context)

    return run_secure
