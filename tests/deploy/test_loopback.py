"""A real deployment on loopback: one SuperLink, three SuperNodes, `flwr run . <federation>`.

One SuperNode is killed after the first round and started again: the run (min-clients=2,
round-timeout set) must go on, finish, say in every results row who took part, and write its
results. Every process the test starts runs in its own process group and is killed at the end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s")


class Fleet:
    """The processes of one loopback deployment (each in its own process group)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.env = {**os.environ, **ENV, "FLWR_HOME": str(home / "flwr-home")}
        self.procs: dict[str, subprocess.Popen] = {}
        self.superlink_port = free_port()
        self.node_ports = [free_port() for _ in range(3)]

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = (self.home / f"{name}.log").open("ab")
        proc = subprocess.Popen(args, env=self.env, cwd=self.home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def start_superlink(self) -> None:
        proc = self.start("superlink", [str(BIN / "flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
                                        "--port", str(self.superlink_port)])
        wait_for_port(self.superlink_port, proc)

    def start_supernode(self, i: int) -> None:
        proc = self.start(f"supernode-{i}", [
            str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{self.superlink_port}",
            "--port", str(self.node_ports[i]), "--node-config", f"partition-id={i} num-partitions=3",
        ])
        wait_for_port(self.node_ports[i], proc)

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.kill(name)

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "flwr"), *args], env=self.env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)

    def write_federation(self) -> None:
        """The Flower config entry that tells ``flwr run . loop`` where the SuperLink is."""
        home = self.home / "flwr-home"
        home.mkdir(exist_ok=True)
        (home / "config.toml").write_text(
            '[superlink]\ndefault = "loop"\n\n'
            f'[superlink.loop]\naddress = "127.0.0.1:{self.superlink_port}"\ninsecure = true\n'
        )


@pytest.fixture
def fleet(tmp_path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    try:
        yield f
    finally:
        f.stop_all()


def run_status(fleet: Fleet) -> str:
    out = fleet.flwr("list", "--format", "json")
    try:
        runs = json.loads(out.stdout).get("runs", [])
    except json.JSONDecodeError:
        return "unknown"
    return str(runs[-1].get("status", "unknown")) if runs else "none"


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
    status = "none"
    end = time.time() + 480
    while time.time() < end:
        rows = json.loads(metrics.read_text()) if metrics.exists() else []
        if not killed and any(r["phase"] == "evaluate" and r["round"] == 1 for r in rows):
            fleet.kill("supernode-2")  # mid-run: after round 1
            killed = True
        elif killed and not restarted:
            fleet.start_supernode(2)
            restarted = True
        status = run_status(fleet)
        if status.startswith("finished"):
            break
        time.sleep(2)
    logs = {p.name: p.read_text(errors="replace")[-3000:] for p in tmp_path.glob("*.log")}
    assert status == "finished:completed", (status, logs)
    assert killed and restarted
    rows = json.loads(metrics.read_text())
    evaluations = [r for r in rows if r["phase"] == "evaluate"]
    assert [r["round"] for r in evaluations] == [1, 2, 3]
    assert evaluations[0]["participant_ids"] == "0 1 2"
    for row in rows:
        if row["phase"] in ("fit", "evaluate"):
            assert row["participants"] >= 2 and set("0 1".split()) <= set(row["participant_ids"].split()), row
    assert (out / "run" / "clients.json").exists() and (out / "run" / "config.json").exists()
