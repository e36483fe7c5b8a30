"""A Flower Message-API strategy that drives a legacy flwr_pfl strategy (the round logic).

:class:`PFLMessageStrategy` holds no algorithm of its own. Each Message-API step calls the
round logic's legacy counterpart and translates:

* ``configure_train`` / ``configure_evaluate``: the logic's ``configure_fit`` /
  ``configure_evaluate`` pick nodes (through :class:`~flwr_pfl.serverapp.nodes.GridClientManager`,
  refreshed from the grid each round) and build each node's instruction, running their own side
  exchanges (partition queries, FedDAR's head phase, FEDORA's setup) through
  :class:`~flwr_pfl.serverapp.nodes.MessageNode`; each (node, instruction) becomes one Message,
  the user's ``train_config`` / ``evaluate_config`` under the logic's own keys;
* ``aggregate_train`` / ``aggregate_evaluate``: each reply becomes the node's FitRes /
  EvaluateRes, or a failure (an error reply, malformed content, no reply), and the logic's
  ``aggregate_fit`` / ``aggregate_evaluate`` check, reject and aggregate them as in the
  NumPyClient flavour. The returned MetricRecord holds the numeric metrics.

The legacy server loop's other steps happen where its order puts them: the initial arrays and
the logic's server-side evaluation of round 0 in the first ``configure_train``, its evaluation
of each later round after ``aggregate_train``. Flower's own ``start()`` runs the rounds
unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from logging import INFO, WARNING
from typing import Any, TypeVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import EvaluateRes, FitRes, GetPropertiesIns, Parameters, log, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_proxy import ClientProxy
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from flwr_pfl import messages
from flwr_pfl.app.nodes import ask_a_node, first_answer, partition_count, wait_for_nodes
from flwr_pfl.clients.base import FEDERATION_QUERY, WIRE_LAYOUT_QUERY
from flwr_pfl.errors import ConfigError
from flwr_pfl.serverapp.layout import (
    Layout,
    is_positional,
    outside_user_model,
    parse_layout,
    record_arrays,
    select_wire_arrays,
    user_name,
)
from flwr_pfl.serverapp.nodes import EVALUATE, TRAIN, GridClientManager, MessageNode, NodeFailure, reply_content
from flwr_pfl.strategies import hooks
from flwr_pfl.strategies.wrappers import calling_wrapper, check_wrapped
from flwr_pfl.strategies.base import PFLStrategy

Res = TypeVar("Res", FitRes, EvaluateRes)
#: how long a subclass's own round loop (which calls configure_train without start) waits for a
#: first node when the federation's size must be learned from the grid: Flower's start() default
DEFAULT_WAIT_SECONDS = 3600.0
Failures = list[Any]


class PFLMessageStrategy(Strategy):
    """Flower's Message-API ``Strategy`` over ``logic``, a legacy flwr_pfl strategy.

    Args:
        logic: the round logic (any :class:`~flwr_pfl.strategies.base.PFLStrategy`, built with
            its usual arguments); it keeps all algorithm state (``logic.global_arrays``,
            ``logic.state_dict()``).

    ``start(grid, initial_arrays, ...)`` is Flower's. ``initial_arrays`` may be the wire arrays
    by position, the model's whole ``state_dict`` (the shared group is selected by name, after
    asking one node for its wire layout), or empty: then the logic's own initial arrays (its
    ``initial_arrays`` argument, or a checkpoint's) are used, else one node is asked for its
    initial arrays (a ``query.parameters`` message), as the legacy server asks a client.
    """

    def __init__(
        self,
        logic: PFLStrategy | None = None,
        *,
        build: Callable[[int, int], PFLStrategy] | None = None,
        num_clients: int | None = None,
    ) -> None:
        if (logic is None) == (build is None):
            raise TypeError("give the round logic, or build ((num_clients, num_rounds) -> round logic) to make it "
                            "when the first round starts")
        if logic is not None and not isinstance(logic, PFLStrategy):
            raise TypeError(f"logic must be a flwr_pfl PFLStrategy, got {type(logic).__name__}")
        self._logic = logic
        self._build = build
        self._num_clients = num_clients  # for build; None: learned from the grid
        #: names of the global arrays on the wire (None: unknown; arrays named by position)
        self.wire_names: list[str] | None = None
        self._manager: GridClientManager | None = None
        self._parameters: Parameters | None = None  # the current global arrays, as the logic has them
        self._returned: ArrayRecord | None = None  # the record last handed to Flower's loop
        self._started = False
        self._pending: dict[str, dict[int, MessageNode]] = {}  # phase -> node id -> node asked
        self._layout: Layout | None = None  # the clients' wire layout, once asked
        #: the user's whole state_dict the first named arrays held (name -> array), or None
        self._template: dict[str, Any] | None = None
        #: the global wire arrays that have no place in the user's model (pFedFDA's class
        #: statistics, FedDAR's heads of domains 1..M-1), by wire name, as of the latest round;
        #: empty when there are none or the arrays are not named
        self.extra_arrays = ArrayRecord()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._logic!r})"

    @property
    def logic(self) -> PFLStrategy:
        """The round logic. A strategy made without ``num_clients`` (or one whose logic needs the
        run's rounds, which only ``start`` is told) builds it when the first round starts:
        in :meth:`start`, or in the first :meth:`configure_train` of a subclass that runs its own
        round loop, as Flower's advanced-pytorch example does."""
        if self._logic is None:
            raise RuntimeError(
                f"{type(self).__name__}'s round logic is built when the first round starts (start() or the first "
                "configure_train), once the federation's size is known; give num_clients (and num_rounds) to the "
                "constructor to build it at once"
            )
        return self._logic

    def ensure_logic(self, grid: Grid, timeout: float, num_rounds: int = 0) -> PFLStrategy:
        """The round logic, built now if it is not yet: with ``num_clients`` from the constructor
        or the grid (:meth:`federation_size`), and ``num_rounds`` (0: unknown)."""
        if self._logic is None:
            assert self._build is not None
            size = self._num_clients if self._num_clients is not None else self.federation_size(grid, timeout)
            self._logic = self._build(size, num_rounds)
        return self._logic

    def adopt_num_rounds(self, num_rounds: int) -> None:
        """Tell the round logic the run's rounds that ``start`` was given, when its constructor
        was not; a constructor's ``num_rounds`` that disagrees with them is refused (the last
        round, which several algorithms treat differently, would be the wrong one).

        Raises:
            ConfigError: the two numbers differ (both are named).
        """
        logic = self.logic
        total = logic.round_offset + num_rounds
        if not logic.num_rounds:
            logic.num_rounds = total
        elif logic.num_rounds != total:
            done = f" after the {logic.round_offset} rounds resumed" if logic.round_offset else ""
            raise ConfigError(
                f"{type(self).__name__}(num_rounds={logic.num_rounds}) but start(num_rounds={num_rounds}){done}: "
                f"the run would end at round {total}; pass the same number to both, or leave num_rounds out of the "
                "constructor (start() tells it)"
            )

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's ``start``. A strategy made without ``num_clients`` (as Flower's own are: they
        sample among the nodes there are) first learns the federation's size from the grid
        (:meth:`federation_size`) and builds its round logic with it; ``num_rounds`` is the
        logic's too (:meth:`adopt_num_rounds`). ``evaluate_fn`` is refused, with the reason,
        by an algorithm without a global model (FEDORA, Local, ...): it would score the
        untouched initial model every round."""
        self.ensure_logic(grid, timeout, num_rounds)
        self.adopt_num_rounds(num_rounds)
        hooks.check_hook(type(self).__name__, "evaluate_fn", evaluate_fn, self.logic.refused_hooks)
        return super().start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config, evaluate_fn)

    def federation_size(self, grid: Grid, timeout: float) -> int:
        """The number of partitions the nodes say the federation has (their node config's
        ``num-partitions``, asked of the first node that answers), else the number of nodes
        connected once the first has.

        Raises:
            RuntimeError: no node connected within ``timeout`` seconds.
        """
        nodes = wait_for_nodes(grid, timeout)
        try:
            size = partition_count(ask_a_node(grid, FEDERATION_QUERY, timeout, MessageNode))
        except RuntimeError:  # the nodes are there but none answered: count them
            size = None
        if size is not None:
            log(INFO, "the federation has %d partitions (the nodes' num-partitions)", size)
            return size
        log(INFO, "the nodes do not say the federation's size: %d connected nodes are the clients", len(nodes))
        return len(nodes)

    # ---------------------------------------------------------------- hooks for subclasses
    def phase_done(self, server_round: int, phase: str, results: Sequence[tuple[ClientProxy, Any]], failures: Failures) -> None:
        """Called after each aggregation (``phase``: "fit" or "evaluate") with its results and
        failures (including the replies the logic rejected), as the legacy loop has them."""

    def round_done(self, server_round: int) -> None:
        """Called once a round (training and evaluation) is over."""

    # ---------------------------------------------------------------- nodes and arrays
    def manager(self, grid: Grid) -> GridClientManager:
        """The client manager over ``grid``'s nodes, refreshed now."""
        if self._manager is None or self._manager.grid is not grid:
            self._manager = GridClientManager(grid, lambda: self.wire_names)
        self._manager.refresh()
        return self._manager

    def _first_answer(self, manager: GridClientManager, ask: Callable[[MessageNode], Any], what: str) -> Any:
        """``ask(node)`` of the first node (in node-id order) that answers (:func:`first_answer`)."""
        self.logic.wait_for_clients(manager)
        node_ids = sorted(int(proxy.cid) for proxy in manager.all().values())
        return first_answer(node_ids, lambda node_id: ask(manager.node(node_id)), f"the {what} query")

    def wire_layout(self, manager: GridClientManager) -> Layout:
        """The clients' wire layout, asked of one node once (and its names kept for naming arrays)."""
        if self._layout is not None:
            return self._layout
        timeout = self.logic.exchange_timeout(self.logic.wait_timeout)
        answer = self._first_answer(
            manager, lambda node: node.get_properties(GetPropertiesIns(dict(WIRE_LAYOUT_QUERY)), timeout, None).properties, "wire-layout"
        )
        layout = parse_layout(dict(answer))
        self.wire_names = [user_name(name) for name, _ in layout]
        self._layout = layout
        return layout

    def initial_parameters(self, manager: GridClientManager) -> Parameters:
        """The logic's initial arrays, or one node's (the legacy server's order)."""
        initial = self.logic.initialize_parameters(manager)
        if initial is not None:
            return initial
        log(INFO, "asking one node for the initial global arrays")
        record = self.node_initial_arrays(manager)
        if not is_positional(record):
            self.wire_names = list(record.keys())
        return ndarrays_to_parameters(messages.unpack_arrays(record))

    def node_initial_arrays(self, manager: GridClientManager) -> ArrayRecord:
        """One node's initial global arrays (a ``query.parameters`` message), named by its client."""
        timeout = self.logic.exchange_timeout(self.logic.wait_timeout)
        return self._first_answer(manager, lambda node: node.initial_arrays({}, timeout), "parameters")

    def parameters_of(self, arrays: ArrayRecord, manager: GridClientManager) -> Parameters:
        """``arrays`` (what Flower's loop passes) as the logic's global Parameters."""
        if arrays is self._returned and self._parameters is not None:
            return self._parameters
        if len(arrays) == 0:
            parameters = self._parameters if self._parameters is not None else self.initial_parameters(manager)
        else:
            if self._template is None and not is_positional(arrays):
                self._template = {name: array.numpy() for name, array in arrays.items()}
            ordered = record_arrays(arrays, self.wire_names)
            if ordered is None:
                current = None
                if self._parameters is not None and self.wire_names is not None:
                    current = dict(zip(self.wire_names, parameters_to_ndarrays(self._parameters)))
                ordered = select_wire_arrays(  # an algorithm's own arrays (pFedFDA's statistics) from a node
                    arrays, self.wire_layout(manager), lambda: _by_name(self.node_initial_arrays(manager)), current)
            parameters = ndarrays_to_parameters(ordered)
        self._parameters = parameters
        return parameters

    def record(self, parameters: Parameters) -> ArrayRecord:
        """``parameters`` as the ArrayRecord handed back to Flower's loop: what ``evaluate_fn``
        receives and ``Result.arrays`` holds.

        When the arrays first given (``start()``'s ``initial_arrays``) were the user's whole
        ``state_dict``, it is that ``state_dict`` again, loadable into the user's model with
        ``load_state_dict``: the global arrays by name, and where the algorithm shares only a
        part (FedRep's and pFedFDA's body, FedBN's layers outside BatchNorm), the rest as it
        was given (the clients' own parts stay on the nodes), except a head the global model
        implies (pFedFDA's LDA head of the global statistics, :meth:`_server_head`). The global arrays that have no
        place in the user's model are kept apart in :attr:`extra_arrays`. Otherwise the wire
        arrays, named when known."""
        arrays = parameters_to_ndarrays(parameters)
        names = self.wire_names
        if self._template is None or names is None or len(names) != len(arrays):
            self._returned = messages.pack_arrays(arrays, names)
            return self._returned
        trained = dict(zip(names, arrays))
        model = {name: trained.get(name, initial) for name, initial in self._template.items()}
        model.update(self._server_head({name: a for name, a in model.items() if name not in trained}))
        self.extra_arrays = messages.pack_arrays(*_named({n: a for n, a in trained.items() if n not in model}))
        outside = [n for n in trained if n not in model and not outside_user_model(n)]
        if outside:  # a wire array neither in the user's model nor the algorithm's own: keep the wire arrays
            self._returned = messages.pack_arrays(arrays, names)
            return self._returned
        self._returned = messages.pack_arrays(*_named(model))
        return self._returned

    def _server_head(self, unshared: dict[str, Any]) -> dict[str, Any]:
        """The logic's :meth:`~flwr_pfl.strategies.base.PFLStrategy.server_head` in place of the
        user's head: the one unshared weight and bias of its shapes (pFedFDA's ``fc3``); nothing
        when the logic implies no head or the shapes do not single one out."""
        head = self.logic.server_head()
        if head is None:
            return {}
        out = {}
        for array in head:
            fits = [name for name, given in unshared.items() if np.shape(given) == np.shape(array)]
            if len(fits) != 1:
                return {}
            out[fits[0]] = np.asarray(array, dtype=np.asarray(unshared[fits[0]]).dtype)
        return out

    # ---------------------------------------------------------------- Message-API steps
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        wrapper = calling_wrapper(self)  # a Flower DP wrapper around this strategy: refused where it cannot apply
        self.ensure_logic(grid, DEFAULT_WAIT_SECONDS)  # a subclass's own round loop may not call start()
        if wrapper is not None:
            check_wrapped(self.logic, wrapper)
        manager = self.manager(grid)
        parameters = self.parameters_of(arrays, manager)
        if wrapper is not None and hasattr(wrapper, "current_arrays"):
            # Flower's server-side DP wrappers clip each reply against the arrays their loop passed
            # here; the replies carry the wire arrays this round sends, which differ from those when
            # the loop passes none (a node gives them) or the user's whole state_dict (an algorithm
            # that shares a part of the model)
            wrapper.current_arrays = messages.pack_arrays(parameters_to_ndarrays(parameters), self.wire_names)
        if not self._started:  # the legacy loop evaluates the initial arrays before round 1
            self._started = True
            self.logic.evaluate(0, parameters)
        instructions = self.logic.configure_fit(server_round, parameters, manager)
        return self._send(TRAIN, server_round, instructions, config)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        out: tuple[ArrayRecord | None, MetricRecord | None] = (None, None)
        pending = self._pending.pop(TRAIN, None)
        if pending is not None:  # the legacy loop aggregates nothing where it sent nothing
            results, failures = self._collect(pending, replies, TRAIN, MessageNode.fit_res)
            parameters, metrics = self.logic.aggregate_fit(server_round, results, failures)
            self.phase_done(server_round, "fit", results, failures)
            if parameters is not None:
                self._parameters = parameters
            hands_back = parameters is not None and self.logic.has_global_model
            out = (self.record(parameters) if hands_back else None, self.metric_record(metrics))
        if self._parameters is not None:  # the legacy loop's server-side evaluation of the round
            self.logic.evaluate(server_round, self._parameters)
        return out

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        self.ensure_logic(grid, DEFAULT_WAIT_SECONDS)
        manager = self.manager(grid)
        instructions = self.logic.configure_evaluate(server_round, self.parameters_of(arrays, manager), manager)
        return self._send(EVALUATE, server_round, instructions, config)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        out = None
        pending = self._pending.pop(EVALUATE, None)
        if pending is not None:
            results, failures = self._collect(pending, replies, EVALUATE, MessageNode.evaluate_res)
            _, metrics = self.logic.aggregate_evaluate(server_round, results, failures)
            self.phase_done(server_round, "evaluate", results, failures)
            out = self.metric_record(metrics)
        self.round_done(server_round)
        return out

    def metric_record(self, metrics: dict[str, Any]) -> MetricRecord:
        """An aggregation's metrics as the MetricRecord handed to Flower's loop: the numeric
        ones, with each client metric also under Flower's and the user's names
        (:func:`~flwr_pfl.strategies.hooks.flower_named`, the logic's ``metric_names``)."""
        return numeric_record(hooks.flower_named(metrics, self.logic.metric_names))

    def summary(self) -> None:
        if self._logic is None:  # Flower's examples log the summary before the first round
            log(INFO, "\t└── flwr_pfl round logic: %s, built when the first round starts (the federation's size "
                "is learned then)", type(self).__name__)
            return
        logic = self.logic
        log(INFO, "\t├── flwr_pfl round logic: %s (%s)", type(logic).__name__, logic.name)
        log(INFO, "\t├── clients: %d, fraction fit %s, fraction evaluate %s, min available %d",
            logic.num_clients, logic.fraction_fit, logic.fraction_evaluate, logic.min_available_clients)
        log(INFO, "\t└── seed %s, round timeout %s", logic.seed, logic.round_timeout)

    # ---------------------------------------------------------------- translation
    def _send(self, phase: str, server_round: int, instructions: Sequence[tuple[ClientProxy, Any]], config: ConfigRecord) -> list[Message]:
        """One Message per (node, instruction); remembers whom it asked."""
        if not instructions:
            return []
        user = dict(config)
        hooks.report_unread_keys(type(self).__name__, f"{phase}_config", user, self.logic.reported_config_keys)
        timeout = self.logic.round_timeout
        assert self._manager is not None
        pending: dict[int, MessageNode] = {}
        out = []
        for proxy, ins in instructions:
            node = self._manager.node(int(proxy.cid))  # the proxy the logic sampled, or one like it
            build = node.train_message if phase == TRAIN else node.evaluate_message
            out.append(build(ins, timeout, server_round, user))
            pending[node.node_id] = node
        self._pending[phase] = pending
        return out

    def _collect(
        self, pending: dict[int, MessageNode], replies: Iterable[Message], phase: str, read: Callable[[MessageNode, Any], Res]
    ) -> tuple[list[tuple[ClientProxy, Res]], Failures]:
        """The replies as the legacy loop's (results, failures): an error reply, malformed
        content, or no reply from a node asked is a failure; a reply from a node not asked is
        ignored (logged)."""
        results: list[tuple[ClientProxy, Res]] = []
        failures: Failures = []
        answered: set[int] = set()
        for reply in replies:
            node_id = reply.metadata.src_node_id
            node = pending.get(node_id)
            if node is None or node_id in answered:
                log(WARNING, "a %s reply from node %d, which was not asked (or answered twice): ignored", phase, node_id)
                continue
            answered.add(node_id)
            try:
                results.append((node, read(node, reply_content(reply, node_id, phase))))
            except Exception as err:  # noqa: BLE001 - an error reply or malformed content: a failure
                failures.append(err)
        failures += [NodeFailure(f"node {node_id}: no {phase!r} reply in time (timed out, or the node left)")
                     for node_id in pending if node_id not in answered]
        return results, failures


def numeric_record(metrics: dict[str, Any]) -> MetricRecord:
    """The numeric entries of ``metrics`` (no booleans, strings or None) as a MetricRecord."""
    return MetricRecord({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})


def _named(arrays: dict[str, Any]) -> tuple[list[Any], list[str]]:
    """``arrays`` as the (arrays, names) that :func:`~flwr_pfl.messages.pack_arrays` takes."""
    return list(arrays.values()), list(arrays)


def _by_name(record: ArrayRecord) -> dict[str, Any]:
    return {name: array.numpy() for name, array in record.items()}
