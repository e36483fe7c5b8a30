"""The ServerApp that ``flwr run .`` starts: parse the config, build the strategy, run, write results."""

from __future__ import annotations

from logging import INFO
from pathlib import Path

import numpy as np
from flwr.app import Context
from flwr.common import log
from flwr.server import ServerConfig
from flwr.server.compat import start_grid
from flwr.serverapp import Grid, ServerApp

from flwr_pfl.app.config import Experiment, parse_experiment
from flwr_pfl.app.export import export_global_model, request_client_exports
from flwr_pfl.app.nodes import resolve_num_clients
from flwr_pfl.app.results import ResultsWriter
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.base import PFLStrategy
from flwr_pfl.training import seed_everything, set_num_threads


def build_strategy(experiment: Experiment, writer: ResultsWriter | None = None) -> PFLStrategy:
    """The registered strategy for ``experiment``, wired to ``writer``."""
    run = experiment.run
    spec = experiment.algorithm
    strategy = spec.strategy(
        num_clients=run.num_clients,
        fraction_fit=run.fraction_fit,
        fraction_evaluate=run.fraction_evaluate,
        on_round=writer.on_round if writer is not None else None,
        wait_timeout=run.wait_timeout,
        min_available_clients=run.min_available_clients,
        round_timeout=run.round_timeout_seconds,
        seed=run.seed,
        num_rounds=run.num_server_rounds,
        **spec.strategy_kwargs(experiment.options),
    )
    return strategy


def load_checkpoint(strategy: PFLStrategy, path: Path) -> int:
    """Restore ``strategy`` from a run's ``checkpoint.npz``; returns the rounds already done."""
    with np.load(path) as ckpt:
        rounds_done = int(ckpt["rounds_done"])
        arrays = [ckpt[f"global_{i}"] for i in range(sum(k.startswith("global_") for k in ckpt.files))]
        extra = {k[len("state_"):]: ckpt[k] for k in ckpt.files if k.startswith("state_")}
    strategy.load_state_dict({"global_arrays": arrays, "arrays": extra}, rounds_done)
    return rounds_done


def run_server(grid: Grid, context: Context) -> ResultsWriter:
    """Run one experiment on ``grid`` and return its results writer."""
    experiment = parse_experiment(context.run_config)  # stops here on a bad key or value
    # num-clients = 0 is the federation's size; a set value must equal it
    num_clients = resolve_num_clients(grid, experiment.run.num_clients, experiment.run.wait_timeout)
    experiment = experiment.with_num_clients(num_clients)
    seed_everything(experiment.run.seed)
    # The server's own tensor work (FEDORA's propagation GEMM, FedDAR-SA's solves) uses the
    # clients' thread count: a matrix product's rounding depends on how it is split across
    # threads, and in-process the server shares torch with the clients anyway.
    set_num_threads(experiment.run.num_threads)
    output = experiment.output_path()
    checkpoint = output / "checkpoint.npz"
    resumed = experiment.run.resume
    if resumed and not checkpoint.exists():
        raise ConfigError(f"resume=true but there is no checkpoint at {checkpoint}; set run-name to the run to resume")
    writer = ResultsWriter(output, experiment.to_dict())
    strategy = build_strategy(experiment, writer)
    writer.state_fn = strategy.state_dict
    request_client_exports(strategy, output)
    rounds = experiment.run.num_server_rounds
    if resumed:
        done = load_checkpoint(strategy, checkpoint)
        log(INFO, "resuming %s from round %d (checkpoint %s)", output.name, done, checkpoint)
        rounds -= done
    log(INFO, "flwr_pfl: %s, results in %s", experiment.algorithm.summary, output)
    if rounds > 0:
        start_grid(grid=grid, strategy=strategy, config=ServerConfig(num_rounds=rounds, round_timeout=experiment.run.round_timeout_seconds))
    writer.finish()
    export_global_model(grid, strategy, output, experiment.run.wait_timeout)
    return writer


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, context)
