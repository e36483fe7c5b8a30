"""Submitting to a deployment with the launcher (``--federation``): a run-config key the app does
not have is refused by name before anything reaches the SuperLink (which would answer only
``[code: 15] Invalid run configuration.``); a checked run is submitted, followed, and its final
status decides the exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_launcher_names_a_bad_key_then_submits_and_follows_a_good_run(fleet, tmp_path, data_dir):
    fleet.start_superlink()
    for i in range(3):
        fleet.start_supernode(i)
    fleet.write_federation()

    def launch(run_config: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flwr_pfl.app.launch", "--federation", "loop", "-c", run_config],
                              env=fleet.env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)

    refused = launch("num-clinets=3")
    assert refused.returncode == 1 and "did you mean 'num-clients'?" in refused.stdout + refused.stderr
    assert json.loads(fleet.flwr("list", "loop", "--format", "json").stdout).get("runs", []) == []  # nothing submitted

    out = tmp_path / "out"
    done = launch(f"algorithm='fedavg' dataset='fashion-mnist' data-dir='{data_dir}' max-samples=300 model='mlp' "
                  f"num-clients=3 num-server-rounds=1 round-timeout=120.0 output-dir='{out}' run-name='run'")
    assert done.returncode == 0 and "run status: finished:completed" in done.stdout, (done.stdout[-3000:], done.stderr[-3000:])
    assert [r["round"] for r in json.loads((out / "run" / "metrics.json").read_text()) if r["phase"] == "evaluate"] == [1]
