"""examples/quickstart_pytorch: Flower's quickstart-pytorch (its ``Net``, a flwr-datasets
partitioner and dict batches) switched to FedRep, pFedFDA and FEDORA, run in-process for each;
slow: one run under ``flwr run``."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from flwr_pfl.app import launch
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.strategies.base import PFLStrategy
from flwr_pfl.training import load_arrays

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "quickstart_pytorch"


def load_example(monkeypatch, directory: Path, package: str, data_dir: Path):
    """An example project's ClientApp, ServerApp and run config (with the test's data
    directory), imported afresh from ``directory``."""
    monkeypatch.syspath_prepend(str(directory))
    for name in [m for m in sys.modules if m.startswith(package)]:
        monkeypatch.delitem(sys.modules, name)
    client = importlib.import_module(f"{package}.client_app")
    server = importlib.import_module(f"{package}.server_app")
    config = tomllib.loads((directory / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    return client.app, server.app, {**config, "data-dir": str(data_dir)}


@pytest.fixture
def example(monkeypatch, data_dir):
    return load_example(monkeypatch, EXAMPLE, "pytorchexample", data_dir)


@pytest.mark.parametrize("algorithm", ["fedrep", "pfedfda", "fedora"])
def test_the_quickstart_runs_each_algorithm_and_personalizes(example, monkeypatch, algorithm):
    client_app, server_app, config = example
    rows: list[tuple[str, dict]] = []
    monkeypatch.setattr(PFLStrategy, "_notify", lambda self, r, phase, metrics, clients: rows.append((phase, metrics)))
    grid = run_inprocess(server_app, client_app, 4, {**config, "algorithm": algorithm})
    evaluations = [m for phase, m in rows if phase == "evaluate"]
    assert len(evaluations) == config["num-server-rounds"]
    assert all(m["num_failures"] == 0 for _, m in rows if "num_failures" in m)
    # Learned, with the user's Net: ten classes (chance 0.1); measured 0.59 / 0.66 / 0.37 (seed 0).
    assert evaluations[-1]["accuracy_wmean"] > 0.25
    assert evaluations[-1]["accuracy_wmean"] > evaluations[0]["accuracy_wmean"]
    for context in grid.contexts.values():
        if algorithm == "fedrep":  # the personal part is exactly the user's fc3 (weight, bias)
            head = load_arrays(context.state, "personal")
            assert [a.shape for a in head] == [(10, 84), (10,)] and all(np.isfinite(a).all() for a in head)
        else:
            assert len(context.state.keys()) > 0


def flwr_run_example(directory: Path, pairs: str, tmp_path: Path, port: int) -> None:
    """``flwr run`` on an example's directory (Flower's default federation) with the run config
    ``pairs``, on a private SuperLink at ``port`` (stopped afterwards); asserted to end
    ``finished:completed`` (``flwr run`` itself exits 0 either way)."""
    flwr = launch.flwr_executable()
    env = launch.flwr_env(tmp_path / "flwr-home", port, flwr)
    try:
        result = subprocess.run([str(flwr), "run", ".", "--stream", "--run-config", pairs],
                                cwd=directory, env=env, capture_output=True, text=True, timeout=600)
        status = launch.last_run_status(env, flwr)
    finally:
        launch.stop_superlink(tmp_path / "flwr-home")
    assert result.returncode == 0 and status == "finished:completed", (status, result.stdout[-3000:] + result.stderr[-3000:])


@pytest.mark.slow
def test_the_quickstart_runs_under_flwr_run(tmp_path, data_dir):
    """``flwr run`` on the example's directory (Flower's default federation: 2 SuperNodes)."""
    pairs = f"algorithm='pfedfda' num-clients=2 num-server-rounds=2 max-samples=600 data-dir='{data_dir}'"
    flwr_run_example(EXAMPLE, pairs, tmp_path, 39593)
