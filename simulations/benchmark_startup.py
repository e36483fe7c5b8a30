"""Benchmark: the default experiment end to end, through `flwr run` and in-process.

Runs the app's default experiment (pyproject.toml's ``[tool.flwr.app.config]``: FedAvg on
Fashion-MNIST, 10 clients, 5 rounds) from a fresh process to its exit, alternately

* ``inprocess``: ``python`` running the ServerApp and ClientApp on the in-process grid;
* ``flwr``: the launcher, ``python -m flwr_pfl.app.launch`` (a local SuperLink, ``flwr run`` on a
  staged copy of the app, the Ray simulation engine, the run's status checked with ``flwr list``,
  the SuperLink stopped),

``--repeats`` times each. From the processes' output it splits each run into start-up (from the
command to the ServerApp's first round: imports, SuperLink, Ray, data, the first client's model),
rounds (first round to the summary) and teardown (summary to exit), and keeps the fastest repeat
of each (these machines are shared and noisy) as well as the median. It also times Flower's
bundle (FAB) build on the repository itself and on the staged copy the launcher hands to
``flwr run``, with the number of files each walk visits.

    python simulations/benchmark_startup.py --repeats 3 --out docs/benchmark

Writes ``<out>/startup.json`` and ``<out>/startup.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import REPO_ROOT, fmt, fresh_run, launch, machine, markdown_table, portable, run_timed

PHASES = ("start-up", "rounds", "teardown", "total")
#: points of the start-up, in order: (mark, what happened by then)
STEPS = (
    ("superlink", "SuperLink up (launcher, `flwr run`, local SuperLink)"),
    ("simulation", "simulation process up (the run submitted, its process started)"),
    ("serverapp", "ServerApp running (Ray starting, the app's server side imported)"),
    ("first_reply", "first client's reply (Ray actors started, the client imported, data, model)"),
)


def default_config(out: Path, name: str) -> dict[str, Any]:
    """pyproject.toml's run config with the outputs redirected (as `flwr run` would fuse it)."""
    from flwr.common.config import get_fused_config_from_dir

    return dict(get_fused_config_from_dir(REPO_ROOT, {"output-dir": str(out), "run-name": name}))


def child_inprocess(config: dict[str, Any]) -> None:
    from flwr_pfl.app.client_app import app as client_app
    from flwr_pfl.app.inprocess import run_inprocess
    from flwr_pfl.app.server_app import app as server_app

    run_inprocess(server_app, client_app, int(config["num-clients"]), config)


def phases(result: dict[str, Any]) -> dict[str, float]:
    marks, wall = result["marks"], result["wall_seconds"]
    first, summary = marks.get("first_round", float("nan")), marks.get("summary", float("nan"))
    return {"start-up": first, "rounds": summary - first, "teardown": wall - summary, "total": wall}


def fab_walks(staging: Path) -> dict[str, Any]:
    """Flower's bundle build on the repository and on the launcher's staged copy."""
    from flwr.cli.build import build_fab_from_disk

    from flwr_pfl.app.staging import stage_app

    out = {}
    for name, folder in (("repository", REPO_ROOT), ("staged copy", stage_app(REPO_ROOT, staging))):
        start = time.perf_counter()
        fab = build_fab_from_disk(folder)
        out[name] = {"seconds": time.perf_counter() - start, "files_walked": sum(len(f) for _, _, f in os.walk(folder)),
                     "fab_bytes": len(fab)}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmark"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=39831)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.child:
        child_inprocess(json.loads(args.config))
        return
    args.out = args.out.resolve()
    runs_dir = args.out / "runs" / "startup"
    runs: dict[str, list[dict[str, Any]]] = {"inprocess": [], "flwr": []}
    for repeat in range(args.repeats):
        config = fresh_run(default_config(runs_dir, f"inprocess-{repeat}"))
        command = [sys.executable, "-u", str(Path(__file__).resolve()), "--child", "--config", json.dumps(config)]
        result = run_timed(command, f"inprocess-{repeat}", args.timeout)
        runs["inprocess"].append(result | {"phases": phases(result)})
        config = fresh_run(default_config(runs_dir, f"flwr-{repeat}"))
        result = launch({k: config[k] for k in ("output-dir", "run-name")}, args.out / "runs" / "flwr-home-startup", args.port, args.timeout)
        runs["flwr"].append(result | {"phases": phases(result)})
        for engine in runs:
            print(f"repeat {repeat} {engine}: {runs[engine][-1]['status']} "
                  + ", ".join(f"{p} {fmt(runs[engine][-1]['phases'][p])} s" for p in PHASES), flush=True)
    best = {e: {p: min(r["phases"][p] for r in rs if r["status"] == "ok") for p in PHASES} for e, rs in runs.items()}
    median = {e: {p: statistics.median(r["phases"][p] for r in rs if r["status"] == "ok") for p in PHASES} for e, rs in runs.items()}
    with tempfile.TemporaryDirectory() as staging:
        fab = fab_walks(Path(staging))
    rows = [[p, fmt(best["inprocess"][p]), fmt(best["flwr"][p]), fmt(best["flwr"][p] / best["inprocess"][p]),
             fmt(median["inprocess"][p]), fmt(median["flwr"][p])] for p in PHASES]
    steps = [[label] + [fmt(statistics.median(r["marks"].get(mark, float("nan")) for r in runs[e] if r["status"] == "ok"))
                        for e in ("inprocess", "flwr")] for mark, label in STEPS]
    text = (f"The default experiment end to end, fastest of {args.repeats} alternating repeats (seconds):\n\n"
            + markdown_table(["phase", "in-process", "flwr run", "flwr run / in-process", "in-process (median)",
                              "flwr run (median)"], rows)
            + f"\n\nflwr run's start-up + teardown: {fmt(best['flwr']['start-up'] + best['flwr']['teardown'])} s "
            + "(fastest repeat of each).\n\nStart-up, step by step (seconds after the command, median of the repeats):\n\n"
            + markdown_table(["by then", "in-process", "flwr run"], steps)
            + "\n\nFlower's bundle build (the walk `flwr run` does over the app directory):\n\n"
            + markdown_table(["app directory", "files walked", "build (s)", "bundle (KiB)"],
                             [[name, v["files_walked"], fmt(v["seconds"]), fmt(v["fab_bytes"] / 1024)] for name, v in fab.items()]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup.json").write_text(json.dumps(portable({"machine": machine(), "repeats": args.repeats, "best": best,
                                                               "median": median, "fab": fab, "runs": runs}), indent=1))
    (args.out / "startup.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
