"""A real deployment on loopback: one SuperLink, three SuperNodes, `flwr run . <federation>`.

One SuperNode is killed after the first round and started again: the run (min-clients=2,
round-timeout set) must go on, finish, say in every results row who took part, and write its
results. Every process the test starts runs in its own process group and is killed at the end
(tests/deploy/conftest.py).
"""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_a_supernode_that_dies_and_comes_back_does_not_stop_the_run(fleet, tmp_path, data_dir):
    fleet.start_superlink()
    for i in range(3):
        fleet.start_supernode(i)
    fleet.write_federation()
    out = tmp_path / "out"
    overrides = (
        f"algorithm='fedavg' dataset='fashion-mnist' data-dir='{data_dir}' max-samples=600 model='mlp' "
        f"num-clients=3 min-clients=2 round-timeout=60.0 wait-timeout=120.0 num-server-rounds=3 "
        f"output-dir='{out}' run-name='run'"
    )
    submitted = fleet.flwr("run", ".", "loop", "--run-config", overrides)
    assert submitted.returncode == 0 and "Successfully started run" in submitted.stdout, submitted.stdout + submitted.stderr
    metrics = out / "run" / "metrics.json"
    killed = restarted = False

    def churn() -> None:
        nonlocal killed, restarted
        rows = json.loads(metrics.read_text()) if metrics.exists() else []
        if not killed and any(r["phase"] == "evaluate" and r["round"] == 1 for r in rows):
            fleet.kill("supernode-2")  # mid-run: after round 1
            killed = True
        elif killed and not restarted:
            fleet.start_supernode(2)
            restarted = True

    status = fleet.wait_for_run("loop", timeout=480, on_poll=churn)
    assert status == "finished:completed", (status, fleet.logs())
    assert killed and restarted
    rows = json.loads(metrics.read_text())
    evaluations = [r for r in rows if r["phase"] == "evaluate"]
    assert [r["round"] for r in evaluations] == [1, 2, 3]
    assert evaluations[0]["participant_ids"] == "0 1 2"
    for row in rows:
        if row["phase"] in ("fit", "evaluate"):
            assert row["participants"] >= 2 and set("0 1".split()) <= set(row["participant_ids"].split()), row
    assert (out / "run" / "clients.json").exists() and (out / "run" / "config.json").exists()
