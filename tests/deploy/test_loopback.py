"""A real deployment on loopback: one SuperLink, three SuperNodes, `flwr run . <federation>`.

The run is FedRep (each client's head is personal) and every SuperNode keeps its state on its
own disk (node config ``state-dir``). One SuperNode is killed as soon as it has written its
state (in the first round) and started again with the same node config: the run (min-clients=2,
round-timeout set) must go on, finish, say in every results row who took part, and write its
results; the restarted node must have read its personal state back and trained on from it. Every process the test starts runs in its own
process group and is killed at the end (tests/deploy/conftest.py).
"""

from __future__ import annotations

import json
import time

import pytest

from flwr_pfl.app.node_state import RESTORED_KEY, decode


@pytest.mark.slow
def test_a_supernode_that_dies_and_comes_back_continues_with_its_state(fleet, tmp_path, data_dir):
    state_dirs = {i: tmp_path / f"node-{i}" / "state" for i in range(3)}  # each node's own disk
    fleet.node_config = lambda i: f"state-dir='{state_dirs[i]}'"
    fleet.start_superlink()
    for i in range(3):
        fleet.start_supernode(i)
    fleet.write_federation()
    out = tmp_path / "out"
    overrides = (
        f"algorithm='fedrep' dataset='fashion-mnist' data-dir='{data_dir}' max-samples=600 model='mlp' "
        f"num-clients=3 min-clients=2 round-timeout=180.0 wait-timeout=120.0 num-server-rounds=3 "
        f"output-dir='{out}' run-name='run'"
    )
    fleet.submit_run(overrides)
    metrics = out / "run" / "metrics.json"
    state_file = state_dirs[2] / "run" / "partition-2.state"
    # mid-run: as soon as node 2 has written its state (its head trained in round 1's fit)
    deadline = time.time() + 240
    while not state_file.exists() and time.time() < deadline and fleet.procs["supernode-2"].poll() is None:
        time.sleep(0.1)
    assert state_file.exists(), fleet.logs()
    fleet.kill("supernode-2")
    at_kill, _ = decode(state_file.read_bytes())
    fleet.start_supernode(2)  # the same node config, so the same state-dir

    status = fleet.wait_for_run("loop", timeout=600)
    assert status == "finished:completed", (status, fleet.logs())
    rows = json.loads(metrics.read_text())
    evaluations = [r for r in rows if r["phase"] == "evaluate"]
    assert [r["round"] for r in evaluations] == [1, 2, 3]
    fits = [r for r in rows if r["phase"] == "fit"]
    for row in rows:
        if row["phase"] in ("fit", "evaluate"):
            assert row["participants"] >= 2 and set("0 1".split()) <= set(row["participant_ids"].split()), row
    assert (out / "run" / "clients.json").exists() and (out / "run" / "config.json").exists()
    # the restarted node took part again and went on from the state it had before the kill
    assert any("2" in r["participant_ids"].split() for r in fits[1:]), rows
    header, state = decode(state_file.read_bytes())
    assert header["flower-run-id"] == at_kill["flower-run-id"] and header["body-sha256"] != at_kill["body-sha256"]
    assert state[RESTORED_KEY]["restores"] == 1 and "personal" in state
    assert "restored the node state of partition 2" in fleet.log("supernode-2"), fleet.log("supernode-2")[-3000:]
    for i in (0, 1):  # the others never restarted
        _, other = decode((state_dirs[i] / "run" / f"partition-{i}.state").read_bytes())
        assert RESTORED_KEY not in other and "personal" in other
