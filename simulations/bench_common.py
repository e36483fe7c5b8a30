"""Shared pieces of the benchmark scripts in this folder: fresh-process runs, `flwr run` through
the launcher, process-tree memory, the plain-PyTorch floor, round times from a run's
``timings.json``, the machine.

Every measured configuration runs in a process of its own, so that its peak memory is its own
(nothing left over from a configuration measured before) and caches start cold.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "BENCHMARK-RESULT "
#: the environment `flwr run` needs offline (as the launcher sets it), and one torch thread
CHILD_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": str(REPO_ROOT),
}


# ------------------------------------------------------------------------------ this process
def best_of(fn: Any, repeats: int) -> float:
    """The shortest wall time of ``repeats`` calls of ``fn`` (the least disturbed by a shared
    machine)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def reset_peak_memory() -> None:
    """Reset the kernel's peak-RSS counter for this process (Linux; no-op elsewhere)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_mb(pid: int | str = "self") -> float:
    """Peak resident set size of a process, in MiB (Linux: VmHWM; NaN when unreadable)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    if pid == "self":
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return float("nan")


def report(result: dict[str, Any]) -> None:
    """Hand a child's result to its parent (one line on stdout)."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what :mod:`platform` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """Where and when: platform, CPU (model, count and the vector instruction set torch's kernels
    use: runs are bit-identical only where these agree), Python and torch versions, UTC time."""
    import torch

    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def fresh_run(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` after removing the results a previous benchmark left under its ``output-dir``
    and ``run-name`` (the app refuses to overwrite a run's results)."""
    shutil.rmtree(Path(config["output-dir"]) / config["run-name"], ignore_errors=True)
    return config


# ------------------------------------------------------------------------------ the floor
def floor_rounds(config: dict[str, Any], device: str) -> list[tuple[float, float]]:
    """FedAvg's computation as a plain PyTorch loop (no Flower, no messages): every round sets
    the global weights, trains each client in turn, reads its weights back, averages them
    weighted by training-set size and evaluates every client with the average.

    The data, model, optimizer and train/evaluate functions are the ones the clients use, from
    ``config`` (an experiment's run config). The clients' data is loaded and the model built
    before the clock starts, and the peak-memory counter is reset there. Returns the wall and
    CPU clocks (``perf_counter``, ``process_time``) at the start and at the end of every round,
    so a caller can average whichever rounds it compares."""
    from flwr_pfl.app.config import parse_experiment
    from flwr_pfl.core.aggregation import weighted_average
    from flwr_pfl.data.federated import load_client_data
    from flwr_pfl.models import build_model
    from flwr_pfl.training import evaluate, get_arrays, resolve_device, seed_everything, set_arrays, train

    experiment = parse_experiment(config)
    run, torch_device = experiment.run, resolve_device(device)
    clients = [load_client_data(experiment.data, pid, run.num_clients) for pid in range(run.num_clients)]
    seed_everything(run.seed)
    model = build_model(run.model, clients[0].input_shape, clients[0].num_outputs)
    reset_peak_memory()
    ends = [(time.perf_counter(), time.process_time())]
    global_arrays = get_arrays(model)
    for _ in range(run.num_server_rounds):
        updates, sizes = [], []
        for data in clients:
            set_arrays(model, global_arrays)
            train(model, data.train.loader(run.batch_size, shuffle=True),
                  optimizer=run.optimizer_config(), device=torch_device, epochs=run.local_epochs)
            updates.append(get_arrays(model))
            sizes.append(len(data.train))
        global_arrays = weighted_average(updates, sizes)
        set_arrays(model, global_arrays)
        for data in clients:
            evaluate(model, data.test, device=torch_device)
        ends.append((time.perf_counter(), time.process_time()))
    return ends


# ------------------------------------------------------------------------------ child processes
def run_child(args: Sequence[str], timeout: float) -> dict[str, Any]:
    """Run ``python <args>`` in a fresh process; its reported result plus ``wall_seconds``.

    A child that fails or times out gives ``{"status": "failed" | "timeout", ...}``.
    """
    env = {**os.environ, **CHILD_ENV}
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "wall_seconds": time.perf_counter() - start}
    wall = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        return {"status": "failed", "wall_seconds": wall, "error": (done.stdout + done.stderr)[-3000:]}
    return {"status": "ok", "wall_seconds": wall, **json.loads(lines[-1][len(RESULT_PREFIX):])}


class TreeMemory:
    """Samples, every ``interval`` seconds, the summed RSS of the processes whose command line
    contains ``marker`` and of all their descendants (a SuperLink, its simulation process,
    Ray and its actors), and each process's own peak (VmHWM) as last seen."""

    def __init__(self, marker: str, interval: float = 0.5) -> None:
        self.marker, self.interval = marker, interval
        self.peak_total_mb = 0.0
        self.peaks: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def _sample(self) -> None:
        children: dict[int, list[int]] = {}
        commands: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
        roots = [pid for pid, command in commands.items() if self.marker in command]
        tree, stack = set(), list(roots)
        while stack:
            pid = stack.pop()
            if pid not in tree:
                tree.add(pid)
                stack += children.get(pid, [])
        total = 0.0
        for pid in tree:
            rss, hwm = _rss_and_peak_mb(pid)
            total += rss
            if hwm == hwm:  # not NaN
                self.peaks[pid] = (commands.get(pid, "")[:120], hwm)
        self.peak_total_mb = max(self.peak_total_mb, total)

    def peak_of(self, needle: str) -> float:
        """Largest peak (VmHWM) seen among processes whose command line contains ``needle``."""
        found = [hwm for command, hwm in self.peaks.values() if needle in command]
        return max(found) if found else float("nan")


def _rss_and_peak_mb(pid: int) -> tuple[float, float]:
    rss = hwm = float("nan")
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
    except OSError:
        pass
    return (0.0 if rss != rss else rss), hwm


#: log lines that mark the phases of a run (first occurrence), by name
PHASE_MARKS = (
    ("superlink", "Using SuperLink"),
    ("simulation", "Starting Flower Simulation"),
    ("serverapp", "Starting Flower ServerApp"),
    ("first_reply", "Received initial parameters"),
    ("first_round", "[ROUND 1]"),
    ("summary", "[SUMMARY]"),
    ("status", "run status:"),
)


def run_timed(command: Sequence[str], marker: str, timeout: float) -> dict[str, Any]:
    """Run ``command`` (from the repository root, with :data:`CHILD_ENV`), noting when each of
    :data:`PHASE_MARKS` first appears in its output (seconds after start) and the peak memory of
    the processes whose command line holds ``marker``, and all their descendants."""
    env = {**os.environ, **CHILD_ENV, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    marks: dict[str, float] = {}
    tail: list[str] = []
    start = time.perf_counter()
    with TreeMemory(marker) as memory:
        process = subprocess.Popen(command, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(timeout, process.kill)
        timer.start()
        assert process.stdout is not None
        for line in process.stdout:
            now = time.perf_counter() - start
            for key, needle in PHASE_MARKS:
                if needle in line and key not in marks:
                    marks[key] = now
            tail = (tail + [line.rstrip()])[-40:]
        code = process.wait()
        timer.cancel()
    wall = time.perf_counter() - start
    status = "ok" if code == 0 else ("timeout" if wall >= timeout else "failed")
    return {
        "status": status,
        "wall_seconds": wall,
        "marks": marks,
        "peak_total_mb": memory.peak_total_mb,
        "server_peak_mb": memory.peak_of("flwr-simulation"),
        **({"error": "\n".join(tail)} if status != "ok" else {}),
    }


def launch(run_config: dict[str, Any], flwr_home: Path, port: int, timeout: float, extra_args: Sequence[str] = ()) -> dict[str, Any]:
    """The real `flwr run` through the launcher, with ``run_config`` as overrides: wall time,
    exit status, phase marks and peak memory (:func:`run_timed`; ``server_peak_mb`` is the
    simulation process, which hosts the ServerApp)."""
    from flwr_pfl.app.overrides import to_toml

    flwr_home.mkdir(parents=True, exist_ok=True)
    overrides = flwr_home / "benchmark-overrides.toml"
    overrides.write_text(to_toml(run_config))
    command = [sys.executable, "-u", "-m", "flwr_pfl.app.launch", "--flwr-home", str(flwr_home), "--port", str(port),
               "-c", str(overrides), *extra_args]
    return run_timed(command, str(flwr_home), timeout)


# ------------------------------------------------------------------------------ results
class RoundClock:
    """Wall and CPU time at the end of every round, from the results writer's callback."""

    def __init__(self) -> None:
        self.ends: dict[int, tuple[float, float]] = {}
        from flwr_pfl.app import results

        original = results.ResultsWriter.on_round

        @functools.wraps(original)
        def on_round(writer, server_round, phase, metrics, clients):
            original(writer, server_round, phase, metrics, clients)
            self.ends[server_round] = (time.perf_counter(), time.process_time())

        results.ResultsWriter.on_round = on_round

    def steady(self, last: int | None = None) -> tuple[float, float]:
        """Mean wall and CPU seconds of rounds 2..``last`` (default: the last round)."""
        rounds = [r for r in sorted(self.ends) if last is None or r <= last]
        walls = [self.ends[b][0] - self.ends[a][0] for a, b in zip(rounds, rounds[1:])]
        cpus = [self.ends[b][1] - self.ends[a][1] for a, b in zip(rounds, rounds[1:])]
        return mean(walls), mean(cpus)


def round_times(run_dir: Path) -> dict[str, Any]:
    """Per-round wall times and server aggregation times from a run's ``timings.json``.

    ``rounds[r]`` is the time from the end of round r's evaluation to the end of round r+1's
    (round 1: from the ServerApp's start); ``aggregate[r]`` is the strategy's fit aggregation.
    """
    rows = json.loads((run_dir / "timings.json").read_text())
    ends = {r["round"]: r["elapsed_seconds"] for r in rows if r["phase"] == "evaluate"}
    fit_ends = {r["round"]: r["elapsed_seconds"] for r in rows if r["phase"] == "fit"}
    ends = {k: max(ends.get(k, 0.0), fit_ends.get(k, 0.0)) for k in sorted(set(ends) | set(fit_ends))}
    rounds, previous = [], 0.0
    for k in sorted(ends):
        rounds.append(ends[k] - previous)
        previous = ends[k]
    aggregate = [r.get("aggregate_seconds", 0.0) for r in rows if r["phase"] == "fit"]
    return {"rounds": rounds, "aggregate": aggregate}


def portable(value: Any) -> Any:
    """``value`` with this checkout's and the home directory's paths written relative to them
    (``docs/...``, ``~/...``), so that results files name no machine's folders."""
    if isinstance(value, str):
        return value.replace(str(REPO_ROOT) + os.sep, "").replace(str(REPO_ROOT), ".").replace(str(Path.home()), "~")
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    return value


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log(y) on log(x): y grows like x to this power."""
    pairs = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0 and y == y]
    if len(pairs) < 2:
        return float("nan")
    mx = sum(p[0] for p in pairs) / len(pairs)
    my = sum(p[1] for p in pairs) / len(pairs)
    sxx = sum((p[0] - mx) ** 2 for p in pairs)
    return sum((p[0] - mx) * (p[1] - my) for p in pairs) / sxx if sxx else float("nan")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float, digits: int = 3) -> str:
    """A figure to ``digits`` significant digits; an em dash when missing."""
    return "—" if value is None or value != value else f"{value:.{digits}g}"
