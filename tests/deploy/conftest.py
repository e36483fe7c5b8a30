"""Helpers for the loopback deployment tests: free ports, a private FLWR_HOME, and the
SuperLink / SuperNode / `flwr` processes of one deployment, each in its own process group and
all killed when the test ends (the ``fleet`` fixture); a Ray cluster likewise (``ray_cluster``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
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
    """The processes of one loopback deployment (each in its own process group).

    ``security`` holds the flags that replace ``--insecure``: the SuperLink's TLS (and
    authentication) flags and the SuperNodes' ``--root-certificates``; empty means insecure.
    """

    def __init__(self, home: Path, num_nodes: int = 3, num_partitions: int | None = None) -> None:
        self.home = home
        self.num_partitions = num_partitions or num_nodes
        self.flwr_home = home / "flwr-home"
        self.env = {**os.environ, **ENV, "FLWR_HOME": str(self.flwr_home)}
        self.procs: dict[str, subprocess.Popen] = {}
        self.superlink_port = free_port()
        self.node_ports = [free_port() for _ in range(num_nodes)]
        self.superlink_security: list[str] = ["--insecure"]
        self.supernode_security: list[str] = ["--insecure"]
        #: node ``i``'s node-config entries beyond its partition (e.g. ``state-dir='...'``)
        self.node_config: Callable[[int], str] = lambda i: ""

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = (self.home / f"{name}.log").open("ab")
        proc = subprocess.Popen(args, env=self.env, cwd=self.home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        path = self.home / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self, tail: int = 3000) -> dict[str, str]:
        return {p.name: p.read_text(errors="replace")[-tail:] for p in self.home.glob("*.log")}

    def start_superlink(self, *extra: str) -> None:
        proc = self.start("superlink", [str(BIN / "flower-superlink"), *self.superlink_security, *extra,
                                        "--disable-runtime-dependency-installation", "--port", str(self.superlink_port)])
        wait_for_port(self.superlink_port, proc)

    def supernode_args(self, i: int, *extra: str, partition_id: int | None = None) -> list[str]:
        """Node ``i`` (its own ``--port``) serving ``partition_id`` (default ``i``)."""
        partition = i if partition_id is None else partition_id
        return [
            str(BIN / "flower-supernode"), *self.supernode_security, *extra,
            "--superlink", f"127.0.0.1:{self.superlink_port}",
            "--port", str(self.node_ports[i]),
            "--node-config", f"partition-id={partition} num-partitions={self.num_partitions} {self.node_config(i)}".strip(),
        ]

    def start_supernode(self, i: int, *extra: str) -> None:
        proc = self.start(f"supernode-{i}", self.supernode_args(i, *extra))
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

    def submit_run(self, run_config: str, federation: str = "loop") -> subprocess.CompletedProcess:
        """``flwr run . <federation> --run-config <run_config>``, asserted submitted (it returns at once)."""
        submitted = self.flwr("run", ".", federation, "--run-config", run_config)
        assert submitted.returncode == 0 and "Successfully started run" in submitted.stdout, submitted.stdout + submitted.stderr
        return submitted

    def write_federation(self, name: str = "loop", root_certificates: Path | None = None) -> None:
        """The Flower config entry that tells ``flwr run . <name>`` where the SuperLink is
        (``insecure = true``, or the CA that signed the SuperLink's certificate)."""
        self.flwr_home.mkdir(exist_ok=True)
        security = f'root-certificates = "{root_certificates}"' if root_certificates else "insecure = true"
        (self.flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{name}"\n\n'
            f'[superlink.{name}]\naddress = "127.0.0.1:{self.superlink_port}"\n{security}\n'
        )

    def run_status(self, federation: str = "loop") -> str:
        """The status of the latest run (``finished:completed``, ``running``, ...)."""
        out = self.flwr("list", federation, "--format", "json")
        try:
            runs = json.loads(out.stdout).get("runs", [])
        except json.JSONDecodeError:
            return "unknown"
        return str(runs[-1].get("status", "unknown")) if runs else "none"

    @staticmethod
    def wait_for_evaluation(rows: Path, server_round: int, timeout: float = 300.0) -> bool:
        """Wait until a run's ``metrics.jsonl`` (appended as each phase ends) holds the evaluation
        of ``server_round``; whether it does."""
        def evaluated() -> bool:
            lines = rows.read_text().splitlines() if rows.exists() else []
            return any(json.loads(line)["phase"] == "evaluate" and json.loads(line)["round"] == server_round
                       for line in lines)

        deadline = time.time() + timeout
        while not evaluated() and time.time() < deadline:
            time.sleep(0.2)
        return evaluated()

    def wait_for_run(self, federation: str = "loop", timeout: float = 480, on_poll=None) -> str:
        """Poll until the latest run finishes (or ``timeout`` s); ``on_poll()`` runs before each poll."""
        status = "none"
        end = time.time() + timeout
        while time.time() < end:
            if on_poll is not None:
                on_poll()
            status = self.run_status(federation)
            if status.startswith("finished"):
                break
            time.sleep(2)
        return status


@pytest.fixture
def make_fleet(tmp_path) -> Iterator[Callable[..., Fleet]]:
    """``make_fleet(num_nodes=..., num_partitions=...)``: a Fleet in ``tmp_path``, stopped at the end."""
    made: list[Fleet] = []

    def make(num_nodes: int = 3, num_partitions: int | None = None) -> Fleet:
        made.append(Fleet(tmp_path, num_nodes, num_partitions))
        return made[-1]

    try:
        yield make
    finally:
        for f in made:
            f.stop_all()


@pytest.fixture
def fleet(make_fleet) -> Fleet:
    """Three SuperNodes, three partitions."""
    return make_fleet()


class RayCluster:
    """A Ray cluster on loopback: ``ray start --block`` processes, each in its own process group
    (killed at the end: never ``ray stop``, which stops every Ray instance on the machine), with
    ``RAY_TMPDIR`` private, so that a bare ``ray.init()`` elsewhere does not find this cluster.
    ``env`` (with ``RAY_ADDRESS``) attaches Ray clients, ``ray status`` and ``flwr`` to it."""

    def __init__(self, home: Path) -> None:
        self.home = home
        # a short directory: Ray's Unix socket paths under it must stay within 107 bytes
        self.ray_dir = Path(tempfile.mkdtemp(prefix="rpfl-"))
        self.port = free_port()
        self.env = {**os.environ, **ENV, "RAY_TMPDIR": str(self.ray_dir), "RAY_USAGE_STATS_ENABLED": "0",
                    "RAY_ADDRESS": f"127.0.0.1:{self.port}"}
        self.procs: list[subprocess.Popen] = []

    def _start(self, name: str, args: list[str], num_cpus: int) -> None:
        log = (self.home / f"{name}.log").open("ab")
        self.procs.append(subprocess.Popen(
            [str(BIN / "ray"), "start", *args, "--block", "--node-ip-address", "127.0.0.1",
             "--num-cpus", str(num_cpus), "--disable-usage-stats"],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        ))

    def start_head(self, num_cpus: int = 1) -> None:
        self._start("ray-head", ["--head", "--port", str(self.port), "--include-dashboard=false"], num_cpus)

    def add_node(self, num_cpus: int = 1) -> None:
        self._start(f"ray-node-{len(self.procs)}", ["--address", f"127.0.0.1:{self.port}"], num_cpus)

    def status(self) -> str:
        """``ray status`` (empty while the cluster does not answer)."""
        result = subprocess.run([str(BIN / "ray"), "status"], env=self.env, capture_output=True, text=True, timeout=60)
        return result.stdout if result.returncode == 0 else ""

    def wait_for_cpus(self, cpus: float, timeout: float = 120) -> None:
        end = time.time() + timeout
        while time.time() < end:
            if f"/{cpus:.1f} CPU" in self.status():
                return
            time.sleep(1)
        raise TimeoutError(f"the Ray cluster did not report {cpus} CPUs within {timeout:.0f} s")

    def stop(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # `ray start` and the Ray processes of its node
                proc.wait(timeout=30)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        self.procs.clear()
        shutil.rmtree(self.ray_dir, ignore_errors=True)


@pytest.fixture
def ray_cluster(tmp_path) -> Iterator[RayCluster]:
    """An empty :class:`RayCluster` (start its head and nodes), stopped at the end."""
    cluster = RayCluster(tmp_path)
    try:
        yield cluster
    finally:
        cluster.stop()
