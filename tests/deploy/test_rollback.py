"""A SuperLink killed mid-round on a deployment, FedRep with each node's state on its own disk:
the nodes have already trained the round's personal heads (their state files say so) when the
server dies before its checkpoint of that round. Resumed (``resume=true``), the nodes roll their
state back to the checkpoint's round instead of training that round's head twice, and the run
ends with the uninterrupted run's numbers, exactly: those of the same configuration run
uninterrupted in one process (the same numbers on every engine)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import time

import pytest

from flwr_pfl.app.appdir import default_run_config
from flwr_pfl.app.checkpoint import read_checkpoint
from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.node_state import decode
from flwr_pfl.app.overrides import parse_overrides
from flwr_pfl.app.server_app import app as server_app


def node_rounds(state_files) -> list[int]:
    return [decode(f.read_bytes())[0]["round"] if f.exists() else -1 for f in state_files]


@pytest.mark.slow
def test_a_server_killed_after_the_nodes_trained_a_round_resumes_to_the_uninterrupted_numbers(fleet, tmp_path, data_dir):
    state_dirs = {i: tmp_path / f"node-{i}" for i in range(3)}
    fleet.node_config = lambda i: f"state-dir='{state_dirs[i]}'"
    fleet.start_superlink()
    for i in range(3):  # under a supervisor that restarts always: nodes exit after a SuperLink restart (docs/deployment.md)
        node = " ".join(shlex.quote(a) for a in fleet.supernode_args(i))
        fleet.start(f"supernode-{i}", ["bash", "-c", f"while true; do {node}; sleep 1; done"])
    fleet.write_federation()
    out = tmp_path / "out"

    def overrides(name: str) -> str:
        return (f"algorithm='fedrep' dataset='fashion-mnist' data-dir='{data_dir}' max-samples=900 model='mlp' "
                f"num-clients=3 wait-timeout=180.0 num-server-rounds=2 checkpoint-interval=1 output-dir='{out}' "
                f"run-name='{name}'")

    run_inprocess(server_app, client_app, 3, default_run_config(parse_overrides([overrides("clean")])))  # as flwr run fuses it

    fleet.submit_run(overrides("killed"))
    checkpoint = out / "killed" / "checkpoint.npz"
    files = [state_dirs[i] / "killed" / f"partition-{i}.state" for i in range(3)]
    deadline, killed_at = time.time() + 300, None
    while time.time() < deadline and killed_at is None:
        done = read_checkpoint(checkpoint).rounds_done if checkpoint.exists() else 0
        if done == 1 and max(node_rounds(files)) >= 2:  # a node has trained round 2, the server has not checkpointed it
            os.killpg(fleet.procs.pop("superlink").pid, signal.SIGKILL)
            killed_at = (done, node_rounds(files))
        time.sleep(0.02)
    assert killed_at is not None, ("no moment between a node's round-2 state and the round-2 checkpoint", fleet.logs())
    time.sleep(2)
    fleet.start_superlink()
    fleet.submit_run(overrides("killed") + " resume=true")
    assert fleet.wait_for_run("loop", timeout=600) == "finished:completed", fleet.logs()

    def evaluations(name: str) -> list[dict]:
        rows = json.loads((out / name / "metrics.json").read_text())
        return [{k: v for k, v in r.items() if k.startswith(("accuracy", "loss"))} for r in rows if r["phase"] == "evaluate"]

    clean, resumed = evaluations("clean"), evaluations("killed")
    assert len(clean) == len(resumed) == 2
    assert resumed == clean, (killed_at, resumed, clean)
