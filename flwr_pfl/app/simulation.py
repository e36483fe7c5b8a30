"""Run the app in Flower's Ray simulation engine from Python, with a given run config.

``flwr.simulation.run_simulation`` leaves ``context.run_config`` empty (it reads no
pyproject.toml), so these wrappers hand the server and every client the run config; the
clients' ``context.state`` is passed through untouched, so personal state persists as under
``flwr run``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp


class ConfiguredClientApp(ClientApp):
    """A ClientApp that sees ``run_config`` (merged under the engine's own)."""

    def __init__(self, inner: ClientApp, run_config: Mapping[str, Any]) -> None:
        super().__init__()
        self._inner, self._config = inner, dict(run_config)

    def __call__(self, message: Message, context: Context) -> Message:
        configured = Context(
            run_id=context.run_id,
            node_id=context.node_id,
            node_config=context.node_config,
            state=context.state,
            run_config={**self._config, **context.run_config},
        )
        return self._inner(message, configured)


def configured_server_app(inner: ServerApp, run_config: Mapping[str, Any]) -> ServerApp:
    """A ServerApp that sees ``run_config``."""
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        context.run_config.update(run_config)
        inner(grid, context)

    return app


def run_ray_simulation(
    run_config: Mapping[str, Any],
    num_clients: int,
    cpus_per_client: int = 1,
    gpus_per_client: float = 0.0,
    total_cpus: int | None = None,
) -> None:
    """Run the suite's ServerApp and ClientApp in the Ray engine with ``run_config``.

    ``gpus_per_client`` gives each simulated client that fraction of a GPU (scheduling only:
    it does not cap memory).
    """
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        from flwr_pfl.errors import missing_extra

        raise missing_extra("ray", "simulation", "Flower's Ray simulation engine")
    from flwr.simulation import run_simulation

    from flwr_pfl.app.client_app import app as client_app
    from flwr_pfl.app.server_app import app as server_app

    init_args: dict[str, Any] = {"logging_level": "ERROR", "log_to_driver": False}
    if total_cpus:
        init_args["num_cpus"] = total_cpus
    run_simulation(
        server_app=configured_server_app(server_app, run_config),
        client_app=ConfiguredClientApp(client_app, run_config),
        num_supernodes=num_clients,
        backend_config={
            "client_resources": {"num_cpus": cpus_per_client, "num_gpus": gpus_per_client},
            "init_args": init_args,
        },
    )
