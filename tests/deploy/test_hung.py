"""A hung node on loopback: one SuperLink, three SuperNodes, and one of them frozen mid-run.

After round 1 the SuperNode of partition 2 is stopped with SIGSTOP (with its ClientApp process:
they share a process group), so it still counts as connected but answers nothing. With
``round-timeout`` set, each exchange it was sent waits that long at most (less once the SuperLink
stops counting the silent node as connected), then the round goes on with the other two; the results rows and the server's log name it as dropped, and the run completes.
Every process the test starts is killed at the end (tests/deploy/conftest.py), stopped or not.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest


@pytest.mark.slow
def test_a_hung_supernode_is_dropped_after_round_timeout_and_the_run_completes(fleet, tmp_path, data_dir):
    fleet.start_superlink()
    for i in range(3):
        fleet.start_supernode(i)
    fleet.write_federation()
    out = tmp_path / "out"
    overrides = (
        f"algorithm='fedavg' dataset='fashion-mnist' data-dir='{data_dir}' max-samples=600 model='mlp' "
        f"num-clients=3 min-clients=2 round-timeout=60.0 wait-timeout=120.0 num-server-rounds=2 "
        f"output-dir='{out}' run-name='run'"
    )
    submitted = fleet.submit_run(overrides)
    assert fleet.wait_for_evaluation(out / "run" / "metrics.jsonl", 1), fleet.logs()
    os.killpg(fleet.procs["supernode-2"].pid, signal.SIGSTOP)  # hung: connected, silent
    frozen_at = time.time()

    status = fleet.wait_for_run("loop", timeout=600)
    assert status == "finished:completed", (status, fleet.logs())
    assert time.time() - frozen_at >= 60  # round 2's fit waited round-timeout for it
    timings = {(r["round"], r["phase"]): r for r in json.loads((out / "run" / "timings.json").read_text())}
    assert timings[(1, "fit")]["exchange_seconds"] < 60  # the healthy round's exchange stayed within the limit
    # the frozen node's exchange ends at round-timeout at the latest (sooner when the SuperLink
    # stops counting the silent node as connected); either way it is recorded, and bounded
    assert 0 < timings[(2, "fit")]["exchange_seconds"] < 60 + 15
    rows = json.loads((out / "run" / "metrics.json").read_text())
    by_phase = {(r["round"], r["phase"]): r for r in rows if r["phase"] in ("fit", "evaluate")}
    assert by_phase[(1, "fit")]["participant_ids"] == "0 1 2"
    assert by_phase[(1, "evaluate")]["participant_ids"] == "0 1 2"
    fit = by_phase[(2, "fit")]
    assert (fit["participants"], fit["participant_ids"], fit["num_dropped"], fit["dropped_ids"]) == (2.0, "0 1", 1.0, "2"), fit
    evaluation = by_phase[(2, "evaluate")]
    # by then the SuperLink may have marked the silent node offline (it misses its heartbeats):
    # it is either sampled and dropped again, or no longer sampled
    assert evaluation["participant_ids"] == "0 1" and evaluation["dropped_ids"] in ("2", ""), evaluation
    assert evaluation.get("accuracy_wmean") is not None
    run_id = re.search(r"Successfully started run (\d+)", submitted.stdout).group(1)
    server_log = fleet.flwr("log", run_id, "loop", "--show").stdout
    assert "round 2: fit: 1 of 3 sampled clients dropped" in server_log and "going on with partitions [0 1]" in server_log, server_log[-3000:]
