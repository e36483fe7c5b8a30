"""The ServerApp that ``flwr run .`` starts: parse the config, build the strategy, run, write results."""

from __future__ import annotations

from logging import INFO
from pathlib import Path

import numpy as np
from flwr.app import Context
from flwr.common import log
from flwr.server import Server, ServerConfig
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat import start_grid
from flwr.serverapp import Grid, ServerApp

from flwr_pfl.app.config import Experiment, parse_experiment
from flwr_pfl.app.results import ResultsWriter
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.base import PFLStrategy
from flwr_pfl.training import seed_everything, set_num_threads


def build_strategy(experiment: Experiment, writer: ResultsWriter | None = None, workers: int | None = None) -> PFLStrategy:
    """The registered strategy for ``experiment``, wired to ``writer``."""
    run = experiment.run
    spec = experiment.algorithm
    strategy = spec.strategy(
        num_clients=run.num_clients,
        fraction_fit=run.fraction_fit,
        fraction_evaluate=run.fraction_evaluate,
        on_round=writer.on_round if writer is not None else None,
        wait_timeout=run.wait_timeout,
        seed=run.seed,
        **spec.strategy_kwargs(experiment.options),
    )
    strategy.num_rounds = run.num_server_rounds
    strategy.max_workers = workers or server_workers(experiment)
    return strategy


#: clients the server contacts at once unless ``server-workers`` says otherwise (see server_workers)
DEFAULT_SERVER_WORKERS = 32


def server_workers(experiment: Experiment, grid: Grid | None = None) -> int:
    """Clients the server contacts at once: ``server-workers`` when set, else up to
    :data:`DEFAULT_SERVER_WORKERS` of the federation's clients, or one where the grid runs
    clients one at a time anyway (its ``max_concurrent_clients``, as the in-process grid says).

    Each contacted client holds a thread that polls for its reply (every 0.1 s in the simulation
    engine). Flower's own default of min(32, CPUs + 4) threads, 6 on two cores, kept too few
    messages in flight: at 1,000 clients a round spent most of its time in those polling steps.
    Far more threads cost more than they save, in polling and in the engine's scan of pending
    messages (measured in ``docs/benchmark/README.md``).
    """
    if experiment.run.server_workers:
        return experiment.run.server_workers
    limit = getattr(grid, "max_concurrent_clients", None) or DEFAULT_SERVER_WORKERS
    return min(experiment.run.num_clients, limit)


def build_server(strategy: PFLStrategy, workers: int) -> Server:
    """Flower's legacy server around ``strategy``, contacting up to ``workers`` clients at once."""
    server = Server(client_manager=SimpleClientManager(), strategy=strategy)
    server.set_max_workers(workers)
    return server


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
    workers = server_workers(experiment, grid)
    strategy = build_strategy(experiment, writer, workers)
    writer.state_fn = strategy.state_dict
    rounds = experiment.run.num_server_rounds
    if resumed:
        done = load_checkpoint(strategy, checkpoint)
        log(INFO, "resuming %s from round %d (checkpoint %s)", output.name, done, checkpoint)
        rounds -= done
    log(INFO, "flwr_pfl: %s, results in %s", experiment.algorithm.summary, output)
    if rounds > 0:
        start_grid(grid=grid, server=build_server(strategy, workers), config=ServerConfig(num_rounds=rounds))
    writer.finish()
    return writer


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, context)
