"""A SuperLink restart with SuperNodes under a supervisor: the run resumes with the same nodes.

After the SuperLink goes away, Flower 1.42's SuperNodes exit with status 0 ("terminated
gracefully"), so a supervisor that restarts only on failure (systemd's ``Restart=on-failure``)
leaves them down. Each node here runs under the smallest supervisor that restarts always (a
shell loop, as systemd's ``Restart=always`` or a container's ``restart: unless-stopped`` do;
docs/deployment.md, *Nodes under a supervisor*). The SuperLink is killed after round 1 and started again on
its port; the nodes come back by themselves, and the run, submitted again with ``resume=true``,
completes from its checkpoint with all three partitions.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import time

import pytest



@pytest.mark.slow
def test_nodes_under_a_supervisor_come_back_after_a_superlink_restart_and_the_run_resumes(make_fleet, tmp_path, data_dir):
    fleet = make_fleet(num_nodes=3)
    fleet.start_superlink()
    for i in range(3):
        node = " ".join(shlex.quote(a) for a in fleet.supernode_args(i))
        fleet.start(f"supernode-{i}", ["bash", "-c", f"while true; do {node}; echo restarting >&2; sleep 1; done"])
    fleet.write_federation()
    out = tmp_path / "out"
    overrides = (
        f"algorithm='fedavg' dataset='fashion-mnist' data-dir='{data_dir}' max-samples=600 model='mlp' "
        f"num-clients=3 wait-timeout=180.0 num-server-rounds=3 output-dir='{out}' run-name='run'"
    )
    fleet.submit_run(overrides)
    checkpoint = out / "run" / "checkpoint.npz"
    deadline = time.time() + 300
    while not checkpoint.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert checkpoint.exists(), fleet.logs()
    os.killpg(fleet.procs.pop("superlink").pid, signal.SIGKILL)  # the SuperLink and its ServerApp
    time.sleep(3)
    fleet.start_superlink()  # the same port; the supervised nodes reconnect by themselves
    resumed = fleet.submit_run(overrides + " resume=true")
    status = fleet.wait_for_run("loop", timeout=600)
    assert status == "finished:completed", (status, fleet.logs())
    rows = json.loads((out / "run" / "metrics.json").read_text())
    fits = {r["round"]: r for r in rows if r["phase"] == "fit"}
    assert sorted(fits) == [1, 2, 3]
    assert fits[3]["participant_ids"] == "0 1 2"
    assert all("restarting" in fleet.log(f"supernode-{i}") for i in range(3))  # each node exited and came back
    run_id = re.search(r"Successfully started run (\d+)", resumed.stdout).group(1)
    server_log = fleet.flwr("log", run_id, "loop", "--show").stdout
    assert re.search(r"resuming run from round [12] ", server_log), server_log[-3000:]  # killed before the end
