"""examples/quickstart_message: Flower's Message-API quickstart (``@app.train()`` /
``@app.evaluate()`` handlers, ``strategy.start(...)``) switched to FedRep, pFedFDA and FEDORA,
run in-process for each; slow: one run under ``flwr run``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from app.test_examples import flwr_run_example, load_example
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.strategies.base import PFLStrategy
from flwr_pfl.training import load_arrays

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "quickstart_message"
BODY = ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
WHOLE = [*BODY, "fc3.weight", "fc3.bias"]  # the user's Net: the shared body trained, the head as start() was given it


@pytest.fixture
def example(monkeypatch, data_dir):
    return load_example(monkeypatch, EXAMPLE, "messageexample", data_dir)


@pytest.mark.parametrize("algorithm", ["fedrep", "pfedfda", "fedora"])
def test_the_message_quickstart_runs_each_algorithm_and_personalizes(example, monkeypatch, tmp_path, algorithm):
    client_app, server_app, config = example
    rows: list[tuple[str, dict]] = []
    monkeypatch.setattr(PFLStrategy, "_notify", lambda self, r, phase, metrics, clients: rows.append((phase, metrics)))
    final = tmp_path / "final_model.pt"
    grid = run_inprocess(server_app, client_app, 4, {**config, "algorithm": algorithm, "final-model": str(final)})
    evaluations = [m for phase, m in rows if phase == "evaluate"]
    assert len(evaluations) == config["num-server-rounds"]
    assert all(m["num_failures"] == 0 for _, m in rows if "num_failures" in m)
    # ten classes (chance 0.1); the personalized models learn within three rounds
    assert evaluations[-1]["accuracy_wmean"] > 0.25
    assert evaluations[-1]["accuracy_wmean"] > evaluations[0]["accuracy_wmean"]
    saved = torch.load(final, weights_only=True)
    for context in grid.contexts.values():
        assert len(context.state.keys()) > 0
    if algorithm == "fedrep":
        # the server saved the user's whole Net under its own names; each node kept its fc3
        assert list(saved) == WHOLE
        for context in grid.contexts.values():
            head = load_arrays(context.state, "personal")
            assert [a.shape for a in head] == [(10, 84), (10,)] and all(np.isfinite(a).all() for a in head)


@pytest.mark.slow
def test_the_message_quickstart_runs_under_flwr_run(tmp_path, data_dir):
    """``flwr run`` on the example's directory (Flower's default federation)."""
    final = tmp_path / "final_model.pt"
    pairs = f"algorithm='fedrep' num-server-rounds=2 max-samples=600 data-dir='{data_dir}' final-model='{final}'"
    flwr_run_example(EXAMPLE, pairs, tmp_path, 39597)
    assert list(torch.load(final, weights_only=True)) == WHOLE
