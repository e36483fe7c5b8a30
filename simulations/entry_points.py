"""Benchmark: what the suite's entry points cost to start, beside Flower's own CLI.

Each command runs in a fresh Python process of this environment, ``--repeats`` times,
alternating; the table keeps the fastest wall time (these machines are shared and noisy), the
median, and the process's peak resident memory (``ru_maxrss``), and gives each as a ratio to
``flwr --help`` measured in the same run:

* ``flwr --help``: Flower's CLI, the reference;
* the launcher's ``--help`` (``python -m flwr_pfl.app.launch``), which only prepares and submits a
  run and so should cost about what Flower's CLI does;
* ``compare --help`` (``python -m flwr_pfl.app.compare``);
* importing the ServerApp and the ClientApp (what Flower's ``flwr-serverapp`` / ``flwr-clientapp``
  processes pay before their first message).

    python simulations/entry_points.py --repeats 5 --out docs/benchmark

Writes ``<out>/entry_points.json`` and ``<out>/entry_points.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

#: name -> Python code run in a fresh interpreter; it prints the process's peak RSS (KiB) last
PROBE = ("import atexit, resource, runpy, sys\n"
         "atexit.register(lambda: print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr))\n")
COMMANDS = {
    "flwr --help": PROBE + "sys.argv = ['flwr', '--help']\nfrom flwr.cli.app import app\napp()",
    "launcher --help": PROBE + "sys.argv = ['launch', '--help']\nrunpy.run_module('flwr_pfl.app.launch', run_name='__main__')",
    "compare --help": PROBE + "sys.argv = ['compare', '--help']\nrunpy.run_module('flwr_pfl.app.compare', run_name='__main__')",
    "import the ServerApp": PROBE + "import flwr_pfl.app.server_app",
    "import the ClientApp": PROBE + "import flwr_pfl.app.client_app",
}


def measure(code: str) -> tuple[float, int]:
    """(wall seconds, peak RSS in KiB) of one fresh interpreter running ``code``."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    seconds = time.perf_counter() - start
    peaks = [line.split()[1] for line in done.stderr.splitlines() if line.startswith("PEAK ")]
    if not peaks:
        raise RuntimeError(f"no peak memory reported:\n{done.stderr[-2000:]}")
    return seconds, int(peaks[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "benchmark")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    peaks: dict[str, list[int]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):
        for name, code in COMMANDS.items():
            seconds, peak = measure(code)
            times[name].append(seconds)
            peaks[name].append(peak)
    reference = "flwr --help"
    rows = []
    for name in COMMANDS:
        rows.append({
            "command": name, "fastest_s": min(times[name]), "median_s": statistics.median(times[name]),
            "peak_mib": max(peaks[name]) / 1024, "time_ratio": min(times[name]) / min(times[reference]),
            "memory_ratio": max(peaks[name]) / max(peaks[reference]), "repeats": args.repeats,
        })
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "entry_points.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "# Start-up cost of the entry points",
        "",
        f"A fresh Python process per command, {args.repeats} repeats alternating; fastest and median wall time, peak "
        "resident memory; ratios to `flwr --help` (Flower's own CLI) measured in the same run. "
        "Command: `python simulations/entry_points.py --repeats " + str(args.repeats) + "`.",
        "",
        "| command | fastest (s) | median (s) | peak memory (MiB) | time vs flwr | memory vs flwr |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['command']} | {row['fastest_s']:.2f} | {row['median_s']:.2f} | {row['peak_mib']:.0f} | "
                     f"{row['time_ratio']:.2f}x | {row['memory_ratio']:.2f}x |")
    (args.out / "entry_points.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
