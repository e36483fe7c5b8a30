"""The ServerApp that ``flwr run .`` starts: parse the config, build the strategy, run, write results.

A run that trained nothing (:func:`~flwr_pfl.app.results.judge_run`) raises
:class:`~flwr_pfl.app.results.RunFailed` once its results are written, unless
``fail-on-no-training = false``: an exception is how a ServerApp tells every engine that it failed
(``flwr run`` then lists the run as ``finished:failed``)."""

from __future__ import annotations

from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from flwr_pfl.app.checkpoint import CHECKPOINT_NAME, RESUMABLE_CHANGES, Checkpoint, changed_keys, read_checkpoint
from flwr_pfl.app.config import Experiment, parse_experiment
from flwr_pfl.app.export import export_global_model, request_client_exports
from flwr_pfl.app.flavours import RoundServer, flavour  # noqa: F401 - RoundServer stays importable here
from flwr_pfl.app.nodes import resolve_num_clients
from flwr_pfl.app.results import ResultsWriter, refuse_existing
from flwr_pfl.app.secagg import secure_driver
from flwr_pfl.app.tracking import Progress, build_trackers, parse_tracking
from flwr_pfl.app.traffic import MeteredGrid
from flwr_pfl.data.vision import VISION_SPECS
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.base import PFLStrategy
from flwr_pfl.strategies.sampling import sample_size
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
        stop_if_nothing_trains=False,  # the results writer judges the whole run at its end
        wait_timeout=run.wait_timeout,
        min_available_clients=run.min_available_clients,
        round_timeout=run.round_timeout_seconds,
        seed=run.seed,
        num_rounds=run.num_server_rounds,
        eval_every=experiment.eval_every,
        **run.reply_bounds,
        **spec.strategy_kwargs(experiment.options),
    )
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
    return min(experiment.run.num_clients or limit, limit)  # num-clients = 0: not known yet


def load_checkpoint(strategy: PFLStrategy, path: Path, key: bytes | None = None) -> int:
    """Restore ``strategy`` from a run's ``checkpoint.npz`` (signed with ``key`` when given);
    returns the rounds already done."""
    checkpoint = read_checkpoint(path, key)
    strategy.load_state_dict(checkpoint.state, checkpoint.rounds_done)
    return checkpoint.rounds_done


def check_resumable(experiment: Experiment, checkpoint: Checkpoint) -> None:
    """ConfigError unless ``experiment`` continues ``checkpoint``'s run: the same configuration
    but for ``RESUMABLE_CHANGES`` (and keys added to the app since, at their defaults), and at
    least as many rounds as are done."""
    current = experiment.to_dict()
    saved = checkpoint.config
    differing = changed_keys(saved, current, RESUMABLE_CHANGES)
    if differing:
        changes = "; ".join(f"{k}: checkpoint {_shown(saved, k)}, now {_shown(current, k)}" for k in differing)
        raise ConfigError(
            f"resume=true with a configuration that differs from the checkpoint's in {', '.join(differing)} "
            f"({changes}); a resume may change only {', '.join(sorted(RESUMABLE_CHANGES))}; restore those keys, or start a new "
            "run under another run-name"
        )
    rounds = experiment.run.num_server_rounds
    if rounds < checkpoint.rounds_done:
        raise ConfigError(
            f"num-server-rounds={rounds} but the checkpoint has {checkpoint.rounds_done} rounds done; "
            f"set num-server-rounds >= {checkpoint.rounds_done} to resume (equal: only the results are rewritten)"
        )


_MISSING = object()


def _shown(config: dict[str, Any], key: str) -> str:
    value = config.get(key, _MISSING)
    return "(absent)" if value is _MISSING else repr(value)


def run_directory(experiment: Experiment) -> Path:
    """The run's output directory; an unnamed run gets the first free ``<default>[-<n>]`` name."""
    output = experiment.output_path()
    if experiment.run.run_name:
        return output
    candidate, n = output, 1
    while candidate.exists():
        n += 1
        candidate = output.with_name(f"{output.name}-{n}")
    return candidate


def run_server(grid: Grid, context: Context) -> ResultsWriter:
    """Run one experiment on ``grid`` and return its results writer."""
    experiment = parse_experiment(context.run_config)  # stops here on a bad key or value
    grid = MeteredGrid(grid)  # every message counted (traffic.json)
    # num-clients = 0 is the federation's size; a set value must equal it. Every node connected by
    # then (at least min-clients of them) is asked: a wrong node setting stops the run here.
    drive, node_proxy = flavour(experiment.run.api)
    num_clients = resolve_num_clients(grid, experiment.run.num_clients, experiment.run.wait_timeout,
                                      wanted=experiment.run.min_clients, workers=server_workers(experiment, grid),
                                      proxy=node_proxy)
    experiment = experiment.with_num_clients(num_clients)
    secagg = experiment.run.secagg
    if secagg is not None:  # Flower's SecAgg+ workflow drives the rounds instead
        secagg.check_sampled(sample_size(num_clients, experiment.run.fraction_fit, 1))
        drive = secure_driver(secagg)
    seed_everything(experiment.run.seed)
    # The server's own tensor work (FEDORA's propagation GEMM, FedDAR-SA's solves) uses the
    # clients' thread count: a matrix product's rounding depends on how it is split across
    # threads, and in-process the server shares torch with the clients anyway.
    set_num_threads(experiment.run.num_threads)
    output = run_directory(experiment)
    checkpoint = None
    if experiment.run.resume:
        path = output / CHECKPOINT_NAME
        if not path.exists():
            raise ConfigError(f"resume=true but there is no checkpoint at {path}; set run-name to the run to resume")
        checkpoint = read_checkpoint(path, experiment.run.checkpoint_key())
        check_resumable(experiment, checkpoint)
    else:
        refuse_existing(output)
    writer = ResultsWriter(
        output,
        experiment.to_dict(),
        checkpoint_interval=experiment.run.checkpoint_interval,
        last_round=experiment.run.num_server_rounds,
        resume_from=checkpoint,
        fail_on_no_training=experiment.run.fail_on_no_training,
        num_classes=known_num_classes(experiment),
        checkpoint_key=experiment.run.checkpoint_key(),
        progress=Progress(experiment.run.num_server_rounds, first_round=checkpoint.rounds_done + 1 if checkpoint else 1),
    )
    workers = server_workers(experiment, grid)
    strategy = build_strategy(experiment, writer, workers)
    writer.state_fn = strategy.state_dict
    writer.traffic_fn = lambda: grid.traffic.rows(strategy.partition_of, strategy.round_offset)
    request_client_exports(strategy, output)
    rounds = experiment.run.num_server_rounds
    if checkpoint is not None:
        strategy.load_state_dict(checkpoint.state, checkpoint.rounds_done)
        log(INFO, "resuming %s from round %d (checkpoint %s)", output.name, checkpoint.rounds_done, output / CHECKPOINT_NAME)
        rounds -= checkpoint.rounds_done
    log(INFO, "flwr_pfl: %s, results in %s", experiment.algorithm.summary, output)
    writer.track(build_trackers(parse_tracking(experiment.run.tracking), output, output.name))
    try:
        if rounds > 0:
            drive(grid, strategy, writer, workers, rounds, experiment.run.round_timeout_seconds)
    except Exception as err:  # the results so far and a summary that says why, then the error
        _finish_after(writer, err)
        raise
    except BaseException:  # an interrupt: the rows so far as metrics.json/.csv, nothing more
        writer.export()
        writer.close_trackers()
        raise
    writer.finish()
    export_global_model(grid, strategy, output, experiment.run.wait_timeout, node_proxy)
    writer.raise_if_failed()  # a run that trained nothing ends as failed, its results written
    return writer


def known_num_classes(experiment: Experiment) -> int | None:
    """The classes of ``experiment``'s dataset where the server knows them without loading any
    data (the torchvision datasets), else None: the chance level of
    :func:`~flwr_pfl.app.results.divergence` is then not used."""
    spec = VISION_SPECS.get(experiment.data.dataset)
    return spec.num_classes if spec is not None else None


def _finish_after(writer: ResultsWriter, err: Exception) -> None:
    """``writer.finish`` naming ``err`` as why the run stopped; a failure here is logged, not
    raised, so that ``err`` stays the error the caller sees."""
    try:
        writer.finish(stopped=f"{type(err).__name__}: {err}")
    except Exception as second:  # noqa: BLE001 - reported, the run's own error follows
        log(WARNING, "could not write the results after the run stopped: %r", second)


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, context)
