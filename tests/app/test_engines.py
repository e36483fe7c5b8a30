"""The same apps through Flower's real engines: the Ray simulation and `flwr run .`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.server_app import app as server_app

REPO_ROOT = Path(__file__).resolve().parents[2]


def tiny(data_dir: Path, out: Path, **extra) -> dict:
    return {
        "dataset": "fashion-mnist",
        "data-dir": str(data_dir),
        "max-samples": 900,
        "model": "mlp",
        "num-clients": 3,
        "num-server-rounds": 2,
        "output-dir": str(out),
        "run-name": "run",
        **extra,
    }


class _ConfiguredClientApp(ClientApp):
    """run_simulation leaves run_config empty; hand the clients ours (state stays shared)."""

    def __init__(self, inner: ClientApp, run_config: dict) -> None:
        super().__init__()
        self._inner, self._config = inner, run_config

    def __call__(self, message, context):
        ctx = Context(run_id=context.run_id, node_id=context.node_id, node_config=context.node_config,
                      state=context.state, run_config={**self._config, **context.run_config})
        return self._inner(message, ctx)


def _configured_server_app(inner: ServerApp, run_config: dict) -> ServerApp:
    app = ServerApp()

    @app.main()
    def _main(grid, context):
        context.run_config.update(run_config)
        inner(grid, context)

    return app


@pytest.mark.slow
def test_ray_simulation_engine(tmp_path, data_dir):
    from flwr.simulation import run_simulation

    cfg = tiny(data_dir, tmp_path, algorithm="fedrep")
    run_simulation(
        server_app=_configured_server_app(server_app, cfg),
        client_app=_ConfiguredClientApp(client_app, cfg),
        num_supernodes=3,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                        "init_args": {"num_cpus": 2, "logging_level": "ERROR", "log_to_driver": False}},
    )
    rows = json.loads((tmp_path / "run" / "metrics.json").read_text())
    evaluations = [r for r in rows if r["phase"] == "evaluate"]
    assert [r["round"] for r in evaluations] == [1, 2]
    assert evaluations[-1]["num_clients"] == 3.0 and evaluations[-1]["accuracy_wmean"] > 0.3


def launch(tmp_path: Path, cfg: dict) -> subprocess.CompletedProcess:
    """Run the launcher (the real `flwr run .`) with ``cfg`` as overrides, privately."""
    overrides = " ".join(f"{k}='{v}'" if isinstance(v, str) else f"{k}={v}" for k, v in cfg.items())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "flwr_pfl.app.launch", "--flwr-home", str(tmp_path / "flwr-home"),
         "--port", "39391", "-c", overrides],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )


@pytest.mark.slow
def test_flwr_run_end_to_end(tmp_path, data_dir):
    """The real `flwr run .` via the launcher: it must finish and write its results."""
    cfg = tiny(data_dir, tmp_path)
    result = launch(tmp_path, cfg)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "run status: finished:completed" in result.stdout
    out = tmp_path / "run"
    for name in ("config.json", "metrics.csv", "clients.csv", "learning_curves.png", "summary.txt"):
        assert (out / name).exists(), name
    assert json.loads((out / "config.json").read_text())["num-clients"] == 3


@pytest.mark.slow
def test_flwr_run_reports_a_failed_app(tmp_path, data_dir):
    """A bad value stops the ServerApp; `flwr run` exits 0 anyway, the launcher must not."""
    cfg = tiny(data_dir, tmp_path, **{"learning-rate": -1.0})
    result = launch(tmp_path, cfg)
    assert result.returncode == 1
    assert "learning-rate" in result.stdout + result.stderr
    assert "finished:failed" in result.stdout
