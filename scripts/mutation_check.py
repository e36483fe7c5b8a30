#!/usr/bin/env python3
"""Mutation check of the Flower layer: do the tests fail when a client or strategy is wrong?

Each mutation is a one-line change of ``flwr_pfl/clients``, ``flwr_pfl/strategies``,
``flwr_pfl/training`` or the Message-API translation (``flwr_pfl/serverapp``,
``flwr_pfl/clientapp.py``) that a wrong implementation could plausibly contain (a weighting dropped, a
sign flipped, the wrong parameters trained, a difference taken against the wrong reference, the
wrong thing put on the wire). The curated list lives in ``scripts/mutations/*.toml``, one file per
algorithm family::

    [[mutation]]
    id = "fedavg-uniform-weights"            # unique, kebab-case
    file = "flwr_pfl/strategies/base.py"
    find = "[r.num_examples for r in replies]"  # must occur exactly once in the file
    replace = "[1 for r in replies]"
    tests = ["tests/strategies/test_flower_layer.py::test_fedavg_weights_by_examples"]
    why = "FedAvg averages by sample count (McMahan et al. Alg. 1)"

For every mutation the script applies the change in a scratch copy of the repository, runs the
named tests there (``pytest -x``), and calls the mutation *killed* when they fail. Before that it
runs every named test selection on the unmutated copy: a selection that fails unmutated would kill
everything and prove nothing, so the check stops there.

Usage::

    .venv/bin/python scripts/mutation_check.py                 # all mutations, 2 workers
    .venv/bin/python scripts/mutation_check.py --family fedgp  # one file of scripts/mutations/
    .venv/bin/python scripts/mutation_check.py --only fedavg-uniform-weights --keep

Writes ``docs/mutation/last.json`` and ``docs/mutation/last.md`` (or ``--out``); exits 1 when a
mutation survives or a mutation's text is not found.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MUTATIONS_DIR = REPO / "scripts" / "mutations"
MUTABLE = ("flwr_pfl/clients/", "flwr_pfl/strategies/", "flwr_pfl/training/", "flwr_pfl/serverapp/", "flwr_pfl/clientapp.py")
COPIED = ("flwr_pfl", "tests", "pyproject.toml", "simulations")


@dataclass(frozen=True)
class Mutation:
    id: str
    family: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]
    why: str


@dataclass
class Outcome:
    id: str
    family: str
    status: str  # killed | survived | timeout (counted as killed) | not-found
    seconds: float
    detail: str = ""
    tests: list[str] = field(default_factory=list)


def load_mutations(directory: Path = MUTATIONS_DIR) -> list[Mutation]:
    """Every mutation of every ``*.toml`` in ``directory``; checks ids, files and targets."""
    mutations: list[Mutation] = []
    for path in sorted(directory.glob("*.toml")):
        for entry in tomllib.loads(path.read_text()).get("mutation", []):
            missing = {"id", "file", "find", "replace", "tests", "why"} - set(entry)
            if missing:
                raise SystemExit(f"{path.name}: mutation {entry.get('id', '?')} lacks {sorted(missing)}")
            if not entry["file"].startswith(MUTABLE):
                raise SystemExit(f"{path.name}: {entry['id']} mutates {entry['file']}, outside {MUTABLE}")
            if entry["find"] == entry["replace"]:
                raise SystemExit(f"{path.name}: {entry['id']} replaces its text with itself")
            mutations.append(Mutation(
                id=entry["id"], family=path.stem, file=entry["file"], find=entry["find"],
                replace=entry["replace"], tests=tuple(entry["tests"]), why=entry["why"],
            ))
    ids = [m.id for m in mutations]
    duplicated = sorted({i for i in ids if ids.count(i) > 1})
    if duplicated:
        raise SystemExit(f"duplicate mutation ids: {duplicated}")
    return mutations


def make_scratch(root: Path) -> Path:
    """A copy of what the tests need, outside the repository."""
    root.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        source = REPO / name
        target = root / name
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache"))
        elif source.exists():
            shutil.copy2(source, target)
    return root


def run_tests(scratch: Path, tests: tuple[str, ...], timeout: float) -> tuple[int | None, str]:
    """Run ``tests`` in ``scratch`` (its package shadows the installed one); (exit code, tail)."""
    env = {**os.environ, "PYTHONPATH": str(scratch), "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", *tests]
    try:
        done = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return done.returncode, " | ".join(lines[-3:])[-400:]


def check_one(mutation: Mutation, scratch: Path, timeout: float) -> Outcome:
    path = scratch / mutation.file
    original = path.read_text()
    count = original.count(mutation.find)
    if count != 1:
        return Outcome(mutation.id, mutation.family, "not-found", 0.0,
                       f"text occurs {count} times in {mutation.file} (must be exactly once)", list(mutation.tests))
    start = time.perf_counter()
    path.write_text(original.replace(mutation.find, mutation.replace))
    try:
        code, tail = run_tests(scratch, mutation.tests, timeout)
    finally:
        path.write_text(original)
    seconds = time.perf_counter() - start
    if code is None:
        return Outcome(mutation.id, mutation.family, "timeout", seconds, tail, list(mutation.tests))
    if code == 5:
        return Outcome(mutation.id, mutation.family, "not-found", seconds, "pytest collected no test", list(mutation.tests))
    status = "survived" if code == 0 else "killed"
    return Outcome(mutation.id, mutation.family, status, seconds, tail, list(mutation.tests))


def baseline(mutations: list[Mutation], scratch: Path, timeout: float) -> list[str]:
    """Run every test the mutations name, unmutated, in one pytest session; return what fails."""
    tests = tuple(sorted({t for m in mutations for t in m.tests}))
    code, tail = run_tests(scratch, tests, timeout * 4)
    return [] if code == 0 else [f"exit {code}: {tail}"]


def report(outcomes: list[Outcome], mutations: list[Mutation], seconds: float, jobs: int) -> tuple[dict, str]:
    by_id = {m.id: m for m in mutations}
    counts = {s: sum(o.status == s for o in outcomes) for s in ("killed", "timeout", "survived", "not-found")}
    meta = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "jobs": jobs,
        "wall_seconds": round(seconds, 1),
        "mutations": len(outcomes),
        **counts,
    }
    data = {"meta": meta, "outcomes": [asdict(o) | {"why": by_id[o.id].why, "file": by_id[o.id].file} for o in outcomes]}
    lines = [
        "# Mutation check: last result",
        "",
        f"{meta['date']}, {meta['machine']}, {jobs} workers, {meta['wall_seconds']:.0f} s wall. "
        f"{len(outcomes)} mutations: {counts['killed']} killed, {counts['timeout']} killed by time-out, "
        f"{counts['survived']} survived, {counts['not-found']} not applicable.",
        "",
        "Made by `.venv/bin/python scripts/mutation_check.py` (mutations in `scripts/mutations/`).",
        "",
        "| family | mutation | file | what it breaks | result | s |",
        "|---|---|---|---|---|---|",
    ]
    for o in sorted(outcomes, key=lambda o: (o.family, o.id)):
        m = by_id[o.id]
        lines.append(f"| {o.family} | `{o.id}` | {m.file.removeprefix('flwr_pfl/')} | {m.why} | {o.status} | {o.seconds:.1f} |")
    return data, "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", nargs="*", help="only these files of scripts/mutations/ (stem)")
    parser.add_argument("--only", nargs="*", help="only these mutation ids")
    parser.add_argument("--jobs", type=int, default=2, help="parallel scratch copies (default 2)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per test run")
    parser.add_argument("--skip-baseline", action="store_true", help="do not run the selections unmutated first")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "mutation", help="where last.json/last.md go")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copies")
    args = parser.parse_args(argv)

    mutations = load_mutations()
    if args.family:
        mutations = [m for m in mutations if m.family in args.family]
    if args.only:
        unknown = set(args.only) - {m.id for m in mutations}
        if unknown:
            raise SystemExit(f"unknown mutation ids: {sorted(unknown)}")
        mutations = [m for m in mutations if m.id in args.only]
    if not mutations:
        raise SystemExit("no mutation selected")

    start = time.perf_counter()
    base = Path(tempfile.mkdtemp(prefix="flwr_pfl_mutation_"))
    jobs = max(1, min(args.jobs, len(mutations)))
    scratches = [make_scratch(base / f"w{i}") for i in range(jobs)]
    try:
        if not args.skip_baseline:
            problems = baseline(mutations, scratches[0], args.timeout)
            if problems:
                print("These test selections fail without any mutation; fix them first:", *problems, sep="\n  ")
                return 2
        outcomes: list[Outcome] = []
        free = list(scratches)
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            pending = {}
            queue = list(mutations)
            while queue or pending:
                while queue and free:
                    mutation, scratch = queue.pop(0), free.pop()
                    pending[pool.submit(check_one, mutation, scratch, args.timeout)] = scratch
                done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    free.append(pending.pop(future))
                    outcome = future.result()
                    outcomes.append(outcome)
                    print(f"{outcome.status:>9}  {outcome.seconds:6.1f} s  {outcome.id}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"scratch copies kept in {base}")
    order = {m.id: i for i, m in enumerate(mutations)}
    outcomes.sort(key=lambda o: order[o.id])
    data, table = report(outcomes, mutations, time.perf_counter() - start, jobs)
    print(table)
    if not args.no_write and not args.only and not args.family:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "last.json").write_text(json.dumps(data, indent=1) + "\n")
        (args.out / "last.md").write_text(table)
    bad = [o for o in outcomes if o.status in ("survived", "not-found")]
    for o in bad:
        print(f"{o.status}: {o.id}: {o.detail}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
