"""The step of a run that drives the strategy, in either flavour of the app (key ``api``).

Everything else of a run (config, results writer, checkpoints, resume, model export) is
:func:`~flwr_pfl.app.server_app.run_server`'s and the same in both flavours; here the built
round logic (a legacy :class:`~flwr_pfl.strategies.base.PFLStrategy`) runs its rounds:

* ``numpyclient``: Flower's legacy server loop (:class:`RoundServer`) over legacy messages;
* ``message``: Flower's Message-API ``Strategy.start()`` of
  :class:`~flwr_pfl.serverapp.strategy.PFLMessageStrategy` over native messages.

Both tell the results writer which clients failed in each phase and when each round is over,
so that checkpoints hold whole rounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flwr.app import ArrayRecord
from flwr.server import Server, ServerConfig, SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat import start_grid
from flwr.serverapp import Grid

from flwr_pfl.app.nodes import NodeProxy, legacy_proxy
from flwr_pfl.app.results import ResultsWriter
from flwr_pfl.serverapp.nodes import MessageNode
from flwr_pfl.serverapp.strategy import PFLMessageStrategy
from flwr_pfl.strategies.base import PFLStrategy


class RoundServer(Server):
    """Flower's legacy server loop, telling the results writer which clients failed and when
    each round is over (after its evaluation, or where it evaluates nothing, after its fit), so
    that checkpoints hold whole rounds; it contacts up to ``workers`` clients at once
    (:func:`~flwr_pfl.app.server_app.server_workers`)."""

    def __init__(self, strategy: PFLStrategy, writer: ResultsWriter, workers: int) -> None:
        super().__init__(client_manager=SimpleClientManager(), strategy=strategy)
        self.set_max_workers(workers)
        self.pfl_strategy = strategy
        self.writer = writer

    def fit_round(self, server_round: int, timeout: float | None):  # type: ignore[no-untyped-def]
        result = super().fit_round(server_round, timeout)
        if result is not None:
            results, failures = result[2]
            self.writer.record_failures(self._global(server_round), "fit", failures, len(results) + len(failures))
        return result

    def evaluate_round(self, server_round: int, timeout: float | None):  # type: ignore[no-untyped-def]
        result = super().evaluate_round(server_round, timeout)
        if result is not None:
            results, failures = result[2]
            self.writer.record_failures(self._global(server_round), "evaluate", failures, len(results) + len(failures))
        self.writer.end_round(self._global(server_round))
        return result

    def _global(self, server_round: int) -> int:
        return self.pfl_strategy.run_round(server_round)


class RecordingMessageStrategy(PFLMessageStrategy):
    """:class:`PFLMessageStrategy` telling the results writer what :class:`RoundServer` tells it."""

    def __init__(self, logic: PFLStrategy, writer: ResultsWriter) -> None:
        super().__init__(logic)
        self.writer = writer

    def phase_done(self, server_round: int, phase: str, results: Sequence[tuple[ClientProxy, Any]], failures: list[Any]) -> None:
        self.writer.record_failures(self.logic.run_round(server_round), phase, failures, len(results) + len(failures))

    def round_done(self, server_round: int) -> None:
        self.writer.end_round(self.logic.run_round(server_round))


def run_numpyclient(grid: Grid, strategy: PFLStrategy, writer: ResultsWriter, workers: int, rounds: int, round_timeout: float | None) -> None:
    """``rounds`` rounds of ``strategy`` in Flower's legacy server loop."""
    start_grid(grid=grid, server=RoundServer(strategy, writer, workers), config=ServerConfig(num_rounds=rounds, round_timeout=round_timeout))


def run_message(grid: Grid, strategy: PFLStrategy, writer: ResultsWriter, workers: int, rounds: int, round_timeout: float | None) -> None:
    """``rounds`` rounds of ``strategy`` through Flower's Message-API ``Strategy.start()``;
    the initial arrays are the strategy's (a checkpoint's) or one node's, as in the legacy loop."""
    RecordingMessageStrategy(strategy, writer).start(
        grid=grid, initial_arrays=ArrayRecord(), num_rounds=rounds, timeout=round_timeout  # type: ignore[arg-type]
    )


#: api -> (how a run drives its strategy, how the server asks one node a question)
FLAVOURS = {
    "numpyclient": (run_numpyclient, legacy_proxy),
    "message": (run_message, MessageNode),
}


def flavour(api: str) -> tuple[Any, NodeProxy]:
    """The driver and node proxy of ``api`` (a value :class:`~flwr_pfl.app.config.RunConfig` checked)."""
    return FLAVOURS[api]
