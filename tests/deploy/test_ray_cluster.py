"""The simulation engine on a Ray cluster started beforehand: a head and a second Ray node on
loopback, one CPU each, and ``flwr run`` (through the launcher) attached to it by ``RAY_ADDRESS``.

Each simulated client asks for one CPU, so Flower's actor pool has two actors, one per Ray node:
while the run goes on, the cluster reports both CPUs in use. The run must finish with the
numbers the in-process engine gives for the same configuration. The cluster is stopped at the
end (tests/deploy/conftest.py, ``ray_cluster``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_simulation_runs_on_a_two_node_ray_cluster(ray_cluster, tmp_path, data_dir):
    from flwr_pfl.app.appdir import default_run_config
    from flwr_pfl.app.client_app import app as client_app
    from flwr_pfl.app.inprocess import run_inprocess
    from flwr_pfl.app.server_app import app as server_app

    ray_cluster.start_head(num_cpus=1)
    ray_cluster.wait_for_cpus(1.0)
    ray_cluster.add_node(num_cpus=1)
    ray_cluster.wait_for_cpus(2.0)

    overrides = {"algorithm": "fedavg", "dataset": "fashion-mnist", "data-dir": str(data_dir), "max-samples": 600,
                 "model": "mlp", "num-clients": 4, "num-server-rounds": 2, "partitioner": "dirichlet",
                 "output-dir": str(tmp_path / "out"), "run-name": "ray"}
    usage: list[str] = []
    done = threading.Event()

    def watch() -> None:  # what the cluster has in use while the run goes on
        while not done.is_set():
            usage.extend(line.strip() for line in ray_cluster.status().splitlines() if line.strip().endswith(" CPU"))
            time.sleep(1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    text = " ".join(f"{k}='{v}'" if isinstance(v, str) else f"{k}={v}" for k, v in overrides.items())
    port = 39491  # the launcher's private SuperLink (and port + 1), as in tests/app/test_engines.py
    result = subprocess.run(
        [sys.executable, "-m", "flwr_pfl.app.launch", "--flwr-home", str(tmp_path / "flwr-home"),
         "--port", str(port), "--cpus", "1", "-c", text],
        cwd=REPO_ROOT, env=ray_cluster.env, capture_output=True, text=True, timeout=600,
    )
    done.set()
    watcher.join(timeout=90)
    assert result.returncode == 0 and "run status: finished:completed" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2.0/2.0 CPU" in usage, usage  # one client actor on each Ray node

    rows = json.loads((tmp_path / "out" / "ray" / "metrics.json").read_text())
    assert [r["round"] for r in rows if r["phase"] == "evaluate"] == [1, 2]
    assert all(r["participant_ids"] == "0 1 2 3" for r in rows if r["phase"] in ("fit", "evaluate"))
    # the same numbers as the in-process engine
    run_inprocess(server_app, client_app, 4, default_run_config(overrides | {"output-dir": str(tmp_path / "ref")}))
    assert rows == json.loads((tmp_path / "ref" / "ray" / "metrics.json").read_text())
