"""Secure aggregation on loopback: one SuperLink, four SuperNodes, Flower's SecAgg+ in every
round, and one node killed after round 1. Round 2's protocol goes on without it (the node is
dropped when it does not answer in ``round-timeout``, or is no longer sampled once the SuperLink
marks it offline), aggregates the three others and the run completes; nothing is ever sent in the
clear (every client's train message carried a protocol stage, which the clients check).
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest


@pytest.mark.slow
def test_secagg_runs_on_real_supernodes_and_survives_a_node_that_dies(make_fleet, tmp_path, data_dir):
    fleet = make_fleet(num_nodes=4)
    fleet.start_superlink()
    for i in range(4):
        fleet.start_supernode(i)
    fleet.write_federation()
    out = tmp_path / "out"
    overrides = (
        f"algorithm='fedavg' dataset='fashion-mnist' data-dir='{data_dir}' max-samples=800 model='mlp' "
        f"num-clients=4 min-clients=3 round-timeout=30.0 wait-timeout=120.0 num-server-rounds=2 "
        f"secure-aggregation='secagg+' output-dir='{out}' run-name='run'"
    )
    submitted = fleet.submit_run(overrides)
    assert fleet.wait_for_evaluation(out / "run" / "metrics.jsonl", 1), fleet.logs()
    os.killpg(fleet.procs["supernode-3"].pid, signal.SIGKILL)

    status = fleet.wait_for_run("loop", timeout=600)
    assert status == "finished:completed", (status, fleet.logs())
    rows = json.loads((out / "run" / "metrics.json").read_text())
    fits = {r["round"]: r for r in rows if r["phase"] == "fit"}
    assert fits[1]["participant_ids"] == "0 1 2 3"
    assert fits[2]["participant_ids"] == "0 1 2", fits[2]
    final = [r for r in rows if r["phase"] == "evaluate"][-1]
    assert final["accuracy_wmean"] > 0.2  # ten classes (chance 0.1): it trained
    run_id = re.search(r"Successfully started run (\d+)", submitted.stdout).group(1)
    server_log = fleet.flwr("log", run_id, "loop", "--show").stdout
    assert server_log.count("Secure aggregation completed") == 2, server_log[-3000:]
