"""Run a paper table end to end (every method x column x seed) and write its page and plot.

    python simulations/reproduce.py feddar-fig1 --scale quick --jobs 2
    python simulations/reproduce.py fedora-lambda-ablation --scale quick --seeds 0 1 2 3
    python simulations/reproduce.py --list

Tables and scales are defined in ``simulations/reproduce_tables.py`` (``paper``: the paper's
rounds, clients, local epochs, participation and seeds; ``quick``: a documented CPU-sized
version). Every run goes through the app exactly as ``python -m flwr_pfl.app.compare`` runs it
(:func:`flwr_pfl.app.compare.run_configs` checks every configuration before anything runs,
:func:`flwr_pfl.app.compare.run_one` runs the real ServerApp / ClientApp on the in-process grid).

Resumable: each finished run leaves one JSON file (its configuration, its metric rows, its run
time, the machine it ran on), written atomically, under ``<results>/<table>/<scale>/<column>/<method>-s<seed>.json``;
a run whose file exists with the same configuration is not run again, so a killed table resumes
where it stopped. The app's own run directories go to ``.../<method>/runs/`` (not committed).
Writes ``docs/reproduce/<table>-<scale>.md`` (mean +- std over seeds, the paper's figure beside
each, the paired win rule) and ``docs/reproduce/<table>-<scale>.png``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import logging
import multiprocessing
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import reproduce_report as report  # noqa: E402
from bench_common import machine  # noqa: E402
import reproduce_tuning as tuning  # noqa: E402
from reproduce_tables import TABLES, Table  # noqa: E402

#: (run config) -> the run's metric rows (all phases); the default runs the app in-process
RunFn = Callable[[dict[str, Any]], list[dict[str, Any]]]

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "reproduce"


@dataclass(frozen=True, eq=False)
class Run:
    """One (column, method, seed) of a table at a scale, with its full run config (hashed by
    identity: a plan's runs are dictionary keys). ``lr_factor``: the method's learning rate
    times this factor (1: the table's own run; other factors: a learning-rate sweep)."""

    column: str
    method: str
    seed: int
    config: dict[str, Any]
    result: Path
    lr_factor: float = 1.0

    @property
    def label(self) -> str:
        """The method's label, with the sweep factor when it is not the table's own run."""
        return self.method if self.lr_factor == 1.0 else f"{self.method} (lr x{self.lr_factor:g})"


def slug(text: str) -> str:
    """A file-name-safe form of a column or method label."""
    return re.sub(r"[^A-Za-z0-9.=+-]+", "_", text).strip("_")


def base_config(table: Table, scale: str, column, method) -> dict[str, Any]:
    """Preset, then the scale's, the column's and the method's overrides (each then its per-scale ones),
    completed with the app's defaults (as ``flwr run`` fuses them)."""
    from flwr_pfl.app.appdir import default_run_config
    from flwr_pfl.app.overrides import parse_overrides

    overrides = parse_overrides([str(ROOT / column.preset)])
    for layer in (table.scales[scale].overrides, column.overrides, column.per_scale.get(scale, {}), method.overrides,
                  method.per_scale.get(scale, {})):
        overrides.update(layer)
    return default_run_config(overrides)


def plan(table: Table, scale: str, seeds: list[int], results: Path, methods: list[str] | None = None,
         columns: list[str] | None = None, lr_factors: list[float] | None = None, tracking: str = "") -> list[Run]:
    """Every run of the table (of ``methods`` and ``columns`` only, when given), its
    configuration checked by the app before anything runs.

    With ``lr_factors``, every method also runs with its learning rate (``learning-rate``, the
    run key every other rate of the suite is a ratio of) times each factor: a learning-rate
    sweep that gives every row, the reference included, the same tuning effort. Factor 1 is the
    table's own run (the same result file). ``tracking`` (the run key) sends every run to those
    experiment-tracking backends; it changes no result, so finished runs are not run again.

    Raises:
        flwr_pfl.errors.ConfigError: a method's configuration does not parse or its strategy
            refuses it (every problem listed, nothing run).
    """
    from flwr_pfl.app.compare import run_configs

    if scale not in table.scales:
        raise SystemExit(f"--scale {scale!r}: table {table.name} has scales {sorted(table.scales)}")
    labels = [m.label for m in table.methods]
    unknown = sorted(set(methods or ()) - set(labels))
    if unknown:
        raise SystemExit(f"--methods: {unknown} not in table {table.name}; its methods: {labels}")
    names = [c.name for c in table.columns]
    unknown_columns = sorted(set(columns or ()) - set(names))
    if unknown_columns:
        raise SystemExit(f"--columns: {unknown_columns} not in table {table.name}; its columns: {names}")
    bad = [f for f in lr_factors or () if not (isinstance(f, (int, float)) and 0 < f < float("inf"))]
    if bad:
        raise SystemExit(f"--lr-factors: {bad} are not positive finite numbers (a factor multiplies each method's learning rate)")
    factors = sorted({1.0, *map(float, lr_factors or ())})
    runs = []
    for column in table.columns:
        if columns and column.name not in columns:
            continue
        for method in table.methods:
            if methods and method.label not in methods:
                continue
            base = base_config(table, scale, column, method)
            for factor in factors:
                name = slug(method.label) + ("" if factor == 1.0 else f"_lr-x{factor:g}")
                out = results / table.name / scale / slug(column.name) / name
                swept = base | {"learning-rate": base["learning-rate"] * factor} | ({"tracking": tracking} if tracking else {})
                configs = run_configs(swept, [method.algorithm], seeds, out)[method.algorithm]
                for seed, config in zip(seeds, configs):
                    runs.append(Run(column.name, method.label, seed, config, out.parent / f"{name}-s{seed}.json", factor))
    # seed by seed: a table stopped early still has complete paired sets for its first seeds
    return sorted(runs, key=lambda r: seeds.index(r.seed))


#: where a run writes its files, and what tracks it, are not part of what it computes: results stay
#: valid when the checkout or a column's folder moves, and when a run is watched by a tracker
LOCATION_KEYS = ("output-dir", "tracking")


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    """The configuration as stored and compared: JSON values, without the location keys."""
    return json.loads(json.dumps({k: v for k, v in config.items() if k not in LOCATION_KEYS}, sort_keys=True, default=str))


def finished(run: Run) -> dict[str, Any] | None:
    """The run's stored result if it finished with this configuration, else None (a run key
    added to the app later and left at its default is no change:
    :func:`flwr_pfl.app.checkpoint.changed_keys`)."""
    from flwr_pfl.app.checkpoint import changed_keys

    try:
        stored = json.loads(run.result.read_text())
    except (OSError, ValueError):
        return None
    saved = stored.get("config") if isinstance(stored, dict) else None
    if not isinstance(saved, dict):
        return None
    return None if changed_keys(saved, _comparable(run.config), LOCATION_KEYS) else stored


#: ``<method>_lr-x<factor>-s<seed>.json``: a learning-rate sweep's result file
SWEEP_FILE = re.compile(r"_lr-x(?P<factor>[0-9.]+)-s\d+\.json$")


def sweep_factors(results: Path) -> list[float]:
    """Every learning-rate factor with a result file under ``results`` (the table's own: 1)."""
    return sorted({1.0} | {float(m["factor"]) for p in results.rglob("*.json") if (m := SWEEP_FILE.search(p.name))})


def stored_runs(table: Table, scale: str, results: Path = DOCS / "results") -> Iterator[tuple[Run, dict[str, Any]]]:
    """Every run of ``table`` at ``scale`` that finished with its current configuration, at every
    learning-rate factor with a result file under ``results``, with its stored result (for the
    scripts that read a table's runs after the fact)."""
    seeds = list(table.scales[scale].seeds)
    factors = sweep_factors(results / table.name / scale)
    for run in plan(table, scale, seeds, results.resolve(), lr_factors=factors):
        stored = finished(run)  # None: not run, or run with another configuration
        if stored is not None:
            yield run, stored


def over_seeds(table: Table, scale: str, per_run: Callable[[list[dict[str, Any]]], dict[str, Any] | None],
               results: Path = DOCS / "results") -> list[dict[str, Any]]:
    """Per (column, method, learning-rate factor) of the table's finished runs: each figure that
    ``per_run`` computes from a run's rows, as ``<name>_mean`` and ``<name>_std`` over the seeds
    (:func:`reproduce_report.mean_std`) and ``<name>_per_seed``, with the cell's ``seeds``. A run
    for which ``per_run`` returns None is left out."""
    cells: dict[tuple[str, str, float], dict[str, list[Any]]] = {}
    for run, stored in stored_runs(table, scale, results):
        figures = per_run(stored["rows"])
        if figures is None:
            continue
        cell = cells.setdefault((run.column, run.method, run.lr_factor), {"seeds": []})
        cell["seeds"].append(run.seed)
        for name, value in figures.items():
            cell.setdefault(name, []).append(value)
    found = []
    for (column, method, factor), cell in cells.items():
        entry: dict[str, Any] = {"column": column, "method": method, "lr_factor": factor, "seeds": cell.pop("seeds")}
        for name, values in cell.items():
            entry[f"{name}_mean"], entry[f"{name}_std"] = report.mean_std(values)
            entry[f"{name}_per_seed"] = values
        found.append(entry)
    return found


def write_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON to a temporary file in the same folder, then rename it over ``path``: a kill
    leaves either the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def app_run(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Run one configuration through the app (in-process engine) and return all its metric rows."""
    import torch

    from flwr_pfl.app.compare import run_one
    from flwr_pfl.app.config import parse_experiment

    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    run_one(config, "inprocess")  # replaces what a killed run, or one of another configuration, left there
    return json.loads((parse_experiment(config).output_path() / "metrics.json").read_text())


def execute(run: Run, run_fn: RunFn) -> dict[str, Any]:
    """Run ``run`` with ``run_fn`` and store its result atomically; returns the stored payload."""
    start = time.perf_counter()
    rows = run_fn(run.config)
    payload = {"config": _comparable(run.config), "column": run.column, "method": run.method, "seed": run.seed,
               "seconds": time.perf_counter() - start, "machine": machine(), "rows": rows}
    write_atomic(run.result, payload)
    return payload


def _execute_app(run: Run) -> dict[str, Any]:
    return execute(run, app_run)


def run_all(runs: list[Run], run_fn: RunFn | None = None, jobs: int = 1, log: Callable[[str], None] = print) -> dict[Run, dict[str, Any]]:
    """Run every unfinished run (``jobs`` processes when > 1), printing progress with an ETA.

    Args:
        runs: the plan.
        run_fn: the runner (default: the app in-process). With ``jobs > 1`` only the default
            runner is used (each worker process runs the app).
        jobs: parallel worker processes.

    Returns:
        run -> its stored payload (finished before or now).
    """
    done: dict[Run, dict[str, Any]] = {}
    todo = []
    for run in runs:
        stored = finished(run)
        if stored is None:
            todo.append(run)
        else:
            done[run] = stored
    log(f"{len(runs)} runs: {len(done)} finished before, {len(todo)} to run" + (f" on {jobs} workers" if jobs > 1 else ""))
    start, spent = time.perf_counter(), []

    def report_one(run: Run, payload: dict[str, Any]) -> None:
        done[run] = payload
        spent.append(payload["seconds"])
        left = len(todo) - len(spent)
        eta = sum(spent) / len(spent) * left / max(1, jobs)
        log(f"[{len(spent)}/{len(todo)}] {run.column} | {run.label} | seed {run.seed}: {payload['seconds']:.0f} s; "
            f"elapsed {(time.perf_counter() - start) / 60:.1f} min, ETA {eta / 60:.1f} min")

    if jobs <= 1 or not todo:
        for run in todo:
            report_one(run, execute(run, run_fn or app_run))
        return done
    if run_fn is not None:
        raise ValueError("a custom run_fn runs in this process only: use jobs=1")
    with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        pending = {pool.submit(_execute_app, run): run for run in todo}
        for future in futures.as_completed(pending):
            report_one(pending[future], future.result())
    return done


def collect(table: Table, results: dict[Run, dict[str, Any]]) -> tuple[dict, dict, dict]:
    """Per column, method and seed: the run's figure, its extra figures (the table's own runs,
    learning-rate factor 1) and, for a run the app judges failed
    (:func:`~flwr_pfl.app.results.judge_run`: a round in which every client failed, or a
    divergence that ended at chance), why."""
    from flwr_pfl.app.results import judge_run, rounds_text

    figures: dict[str, dict[str, dict[int, float]]] = {}
    extras: dict[str, dict[str, dict[str, dict[int, float]]]] = {}
    failed: dict[str, dict[str, dict[int, str]]] = {}
    for run, payload in results.items():
        if run.lr_factor != 1.0:
            continue
        rows = payload["rows"]
        verdict = judge_run(rows)
        if verdict.trained_nothing:
            why = verdict.divergence or f"{rounds_text(verdict.rounds_without_training)} trained nothing"
            failed.setdefault(run.column, {}).setdefault(run.method, {})[run.seed] = why
        value = report.run_figure(rows, table.metric, table.last)
        if value is not None:
            figures.setdefault(run.column, {}).setdefault(run.method, {})[run.seed] = value
        for key in table.extras:
            v = report.fit_mean(rows, key[4:]) if key.startswith("fit:") else report.run_figure(rows, (key,), table.last)
            if v is not None:
                extras.setdefault(run.column, {}).setdefault(run.method, {}).setdefault(key, {})[run.seed] = v
    return figures, extras, failed


def write_table(table: Table, scale: str, results: dict[Run, dict[str, Any]], command: str, docs: Path = DOCS) -> Path:
    """Write ``<docs>/<table>-<scale>.md``, ``.png`` and ``.json`` (the summary); returns the page."""
    figures, extras, failed = collect(table, results)
    summary = report.summarize(table, figures, extras, failed)
    seconds = sum(p["seconds"] for p in results.values()) if results else None
    machines = Counter(report.machine_label(payload.get("machine")) for payload in results.values())
    docs.mkdir(parents=True, exist_ok=True)
    page = docs / f"{table.name}-{scale}.md"
    page.write_text(report.markdown(table, scale, summary, command, seconds, machines))
    (docs / f"{table.name}-{scale}.json").write_text(json.dumps(summary, indent=1, default=float))
    report.plot(table, summary, docs / f"{table.name}-{scale}.png")
    return page


def write_sweep(table: Table, scale: str, results: dict[Run, dict[str, Any]], command: str, docs: Path = DOCS) -> Path:
    """Write the learning-rate sweep's ``<docs>/<table>-<scale>-lr.md`` and ``.json``; returns the page."""
    figures: tuning.SweepFigures = {}
    for run, payload in results.items():
        value = report.run_figure(payload["rows"], table.metric, table.last)
        if value is not None:
            figures.setdefault(run.column, {}).setdefault(run.method, {}).setdefault(run.lr_factor, {})[run.seed] = value
    summary = tuning.summarize(table, figures)
    docs.mkdir(parents=True, exist_ok=True)
    page = docs / f"{table.name}-{scale}-lr.md"
    page.write_text(tuning.markdown(table, scale, summary, command))
    (docs / f"{table.name}-{scale}-lr.json").write_text(json.dumps(summary, indent=1, default=float))
    return page


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", nargs="?", choices=sorted(TABLES))
    parser.add_argument("--scale", choices=("quick", "paper"), default="quick")
    parser.add_argument("--seeds", nargs="+", type=int, help="default: the scale's seeds")
    parser.add_argument("--jobs", type=int, default=1, help="parallel worker processes")
    parser.add_argument("--methods", nargs="+", help="only these methods (labels); default: all")
    parser.add_argument("--columns", nargs="+", help="only these columns (names); default: all")
    parser.add_argument("--lr-factors", nargs="+", type=float, metavar="F",
                        help="also run every method at its learning rate times each F (e.g. 0.5 2) and write the "
                             "sweep's page <table>-<scale>-lr.md")
    parser.add_argument("--results", type=Path, default=DOCS / "results", help="one JSON per finished run")
    parser.add_argument("--docs", type=Path, default=DOCS, help="where the pages go")
    parser.add_argument("--report-only", action="store_true", help="write the page from the finished runs; run nothing")
    parser.add_argument("--tracking", default="", help="experiment tracking of every run: tensorboard, mlflow, wandb "
                        "(comma-separated; run key tracking); changes no result")
    parser.add_argument("--list", action="store_true", help="list the tables and their scales")
    args = parser.parse_args(argv)
    if args.list or args.table is None:
        for name, t in TABLES.items():
            print(f"{name}: {t.title}")
            for s, sc in t.scales.items():
                print(f"    {s}: {sc.note}")
        return
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    table = TABLES[args.table]
    seeds = args.seeds or list(table.scales[args.scale].seeds)
    from flwr_pfl.errors import ConfigError

    try:
        runs = plan(table, args.scale, seeds, args.results.resolve(), args.methods, args.columns, args.lr_factors,
                    tracking=args.tracking)
    except ConfigError as err:
        raise SystemExit(f"table {table.name}, scale {args.scale}: {err}") from err
    if args.report_only:
        results = {r: p for r in runs if (p := finished(r)) is not None}
    else:
        results = run_all(runs, jobs=args.jobs)
    table_command = f"python simulations/reproduce.py {table.name} --scale {args.scale} --seeds {' '.join(map(str, seeds))}"
    if args.lr_factors:
        # like the table's page, the sweep's page shows every finished run at these factors, of
        # every method, in every column that has a run at a factor other than 1 (a sweep of some
        # rows adds them to the page, never drops the others)
        command = table_command + " --lr-factors " + " ".join(f"{f:g}" for f in args.lr_factors)
        swept = {r: p for r in plan(table, args.scale, seeds, args.results.resolve(), lr_factors=args.lr_factors)
                 if (p := finished(r)) is not None}
        columns = {r.column for r in swept if r.lr_factor != 1.0}
        swept = {r: p for r, p in swept.items() if r.column in columns}
        print(f"wrote {write_sweep(table, args.scale, swept, command, args.docs)}")
    # the table's page shows every finished run of the table at these seeds, not only this
    # invocation's subset (a run of one column or method adds to the page, never shrinks it)
    whole = {r: p for r in plan(table, args.scale, seeds, args.results.resolve()) if (p := finished(r)) is not None}
    print(f"wrote {write_table(table, args.scale, whole, table_command, args.docs)}")

if __name__ == "__main__":
    main()
