"""Health sweep: every registered algorithm, on the suite's own settings, ends above chance.

A new algorithm, or a change to a shared base, can leave an algorithm that runs without an
error and learns nothing, or that loses clients to exceptions while the round goes on. This
sweep runs EVERY algorithm of the registry (``flwr_pfl.app.registry.ALGORITHMS``: a newly
registered one is included without editing this file) on

* ``default``: the default experiment (``pyproject.toml``'s ``[tool.flwr.app.config]``:
  Fashion-MNIST, Dirichlet(0.3) label skew, the small CNN, 5 rounds, 10 simulated clients), and
* every shipped dataset preset (a preset in ``flwr_pfl/presets/`` that names no algorithm and
  sets no algorithm option: ``tiny``, ``fmnist_label_skew``, ``mnist_pathological``,
  ``cifar10_label_skew``) whose dataset is on this machine. Availability is detected by loading
  the dataset with ``download=false``; a setting whose dataset is missing is skipped, and the
  output says so and why,

over several seeds, through the comparison tool's own functions (``flwr_pfl.app.compare``:
:func:`run_configs` checks every configuration, :func:`run_one` runs one on the in-process
engine through the real strategies and clients).

The rule. A cell (algorithm, setting) PASSes when, on every seed, the weighted mean accuracy of
the LAST round (``accuracy_wmean`` of the final evaluation, not the best round) is at least
``chance + margin`` (chance = 1 / number of classes; the margins are in :data:`MARGINS`, with
the reason for each), the run evaluated its last round, no client failed, was rejected or was
dropped in any round of any phase (``num_failures``, ``num_rejected``, ``num_dropped`` of
``metrics.json``), and the run raised no error. Otherwise it FAILs, and the script exits 1.

Some algorithms need a setting the plain experiment leaves at a value where they do not do
their own work; :func:`extra_config` gives the least that makes the experiment a valid run of
each (today: FMTL's FedAvg phase is shortened so that its head-only phase happens within the
budget; FEDORA gets the validation split its transfer weights are computed on), and the output
records it per cell. Algorithms whose defaults already fit (FedGP's
family takes the last client as the target; the FedDAR family runs with the data's one
domain) run unchanged, with a note.

    python simulations/health_sweep.py                                  # default experiment, 3 seeds
    python simulations/health_sweep.py --settings default fmnist_label_skew --seeds 0 1 2
    python simulations/health_sweep.py --algorithms fedavg fedrep --rounds 3
    python simulations/health_sweep.py --quick                          # tiny preset, 3 rounds, 1 seed

The committed ``docs/benchmark/health/health.md`` is ``--settings default --rounds 3``: on a
shared 2-core machine the 5-round sweep (18 algorithms x 3 seeds) was estimated at 60 to 100
minutes (the 3-round one took about 45, a fifth of it in FedDAR-SA's second-order head
aggregation: ``feddar`` and ``feddar-sa``).

Writes ``<out>/health.json`` and ``<out>/health.md`` (default ``docs/benchmark/health``; with
``--quick``, ``docs/benchmark/health/quick``) after every cell, and each run's own files under
``<out>/<setting>/runs/`` (not committed). Rerun, it skips the cells already finished with the
same configuration and seeds, and reads finished runs of an interrupted cell instead of running
them again (``--force`` runs everything anew); cells that stopped with an error run again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from bench_common import portable

from flwr_pfl.app.appdir import default_run_config
from flwr_pfl.app.compare import _evaluation_rows, _home_relative, run_configs, run_one
from flwr_pfl.app.config import SIMULATED_CLIENTS, parse_experiment
from flwr_pfl.app.overrides import parse_overrides
from flwr_pfl.app.presets import preset_names
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.data.registry import dataset_builder

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SETTING = "default"
#: the figure judged: weighted mean accuracy over the evaluated clients, last round
KEY = "accuracy_wmean"

#: margin above chance (absolute accuracy) that every healthy algorithm clears on every seed,
#: per setting, with the reason; a setting not listed gets FALLBACK_MARGIN
MARGINS: dict[str, tuple[float, str]] = {
    "default": (0.10, "10 classes (chance 0.10). Measured at 3 rounds x 3 seeds: the weakest healthy "
                      "figure is target-only's, 0.24-0.26 (one client's Dirichlet(0.3)-skewed data, its "
                      "model judged on all ten clients), then FedGP's 0.34 (it steers the model to the "
                      "target client, whose own accuracy is 0.44-0.94); a model that learns nothing "
                      "stays at 0.10"),
    "tiny": (0.25, "10 classes (chance 0.10), 3 IID clients of 240 training images, an MLP, "
                   "3 rounds (pFedHN's hypernetwork makes one step a round: after 2 it was at 0.31-0.38, "
                   "rising). Measured at 3 rounds, seed 0: the healthy algorithms end at 0.41-0.69 "
                   "(lowest: per-fedavg 0.41, pfedme 0.43, pfedhn 0.46), so 0.35 leaves them 0.06; at 2 "
                   "rounds a FedDAR-SA whose training loss climbed from 2.7 to 9.1 in round 2 ended at "
                   "0.24 and failed"),
    "fmnist_label_skew": (0.10, "not yet measured: the default experiment's margin (the same data "
                                "and partition, 20 clients, 30 rounds)"),
    "mnist_pathological": (0.10, "not yet measured: the default experiment's margin"),
}
FALLBACK_MARGIN = (0.10, "no measured margin for this setting: a plain +0.10 above chance")

#: settings of --quick: the tiny preset, 3 rounds, one seed
QUICK = {"settings": ["tiny"], "rounds": 3, "seeds": [0]}


# ------------------------------------------------------------------------------ settings
def dataset_presets() -> list[str]:
    """The shipped presets that describe data and a budget, not an algorithm: no ``algorithm``
    key and no ``<algorithm>.<option>`` key."""
    names = []
    for name in preset_names():
        keys = parse_overrides([name])
        if "algorithm" not in keys and not any("." in k for k in keys):
            names.append(name)
    return names


def all_settings() -> list[str]:
    return [DEFAULT_SETTING, *dataset_presets()]


def setting_config(setting: str, rounds: int | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """The run config of ``setting`` (the default experiment plus the preset, then
    ``--rounds`` and ``-c`` overrides)."""
    items = [] if setting == DEFAULT_SETTING else [setting]
    config = default_run_config({**parse_overrides(items), **overrides})
    if rounds is not None:
        config["num-server-rounds"] = rounds
    return config


def dataset_check(config: dict[str, Any]) -> tuple[int | None, str | None]:
    """(number of classes, None) when the setting's dataset is on this machine, else
    (None, why not). The dataset is loaded as a run would load it but with ``download=false``,
    so nothing is fetched and the answer is what a run would find."""
    try:
        experiment = parse_experiment({**config, "algorithm": "fedavg", "num-clients": SIMULATED_CLIENTS})
        data = replace(experiment.data, download=False)
        pool = dataset_builder(data.dataset)(data)
    except Exception as err:  # noqa: BLE001 - any reason a run could not load it
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return None, f"dataset {config.get('dataset')!r} is not available locally ({type(err).__name__}: {first})"
    if pool.num_classes < 2:
        return None, f"dataset {config.get('dataset')!r} is not a classification task: no chance level"
    return pool.num_classes, None


def margin_of(setting: str, override: float | None) -> tuple[float, str]:
    if override is not None:
        return override, "--margin on the command line"
    return MARGINS.get(setting, FALLBACK_MARGIN)


# ------------------------------------------------------------------------------ algorithms
def extra_config(algorithm: str, config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The least extra run config that makes ``config`` a valid run of ``algorithm``, and why.

    FMTL's FedAvg phase (``fmtl.t1-rounds``, 100 by default) would take the whole budget of a
    shorter experiment, so its own head-only phase would never run; it gets the first half of
    the rounds (rounded up) and the head phase the rest. FEDORA computes its transfer weights
    from a validation error (Eq. 8) and needs a validation split (``val-fraction``, 0 by
    default; carved from the training share, the test split is unchanged).
    """
    rounds = int(config["num-server-rounds"])
    if algorithm == "fedora" and not float(config.get("val-fraction", 0.0)):
        return {"val-fraction": 0.1}, ("a validation split for the transfer weights' validation error (Eq. 8; "
                                       "without one FEDORA warns and uses the training split); the test split is unchanged")
    if algorithm == "fmtl":
        t1 = max(1, (rounds + 1) // 2)
        return {"fmtl.t1-rounds": t1}, f"FedAvg phase rounds 1..{t1}, head-only phase rounds {t1 + 1}..{rounds}"
    judged = (f"judged like every algorithm on all clients' `{KEY}`; the target client's own accuracy "
              "(`target_accuracy`) is recorded per seed in health.json")
    notes = {
        name: f"target = the last client ({name}.target-partition = -1, the default), the others are sources; {judged}"
        for name in ("fedgp", "fedda", "target-only", "source-only")
    }
    if algorithm in notes:
        return {}, notes[algorithm]
    if ALGORITHMS[algorithm].section.startswith("feddar.") or algorithm in ("separate-fedavg", "fedavg-rw", "fedavg-mh"):
        return {}, f"one domain (num-domains = {config.get('num-domains', 1)}): one head, as the data has"
    return {}, ""


# ------------------------------------------------------------------------------ one cell
def fingerprint(configs: list[dict[str, Any]]) -> str:
    """A digest of a cell's run configs, without where they are written."""
    shareable = [{k: _home_relative(v) for k, v in c.items() if k != "output-dir"} for c in configs]
    return hashlib.sha256(json.dumps(shareable, sort_keys=True, default=str).encode()).hexdigest()[:16]


def counts(run_dir: Path) -> dict[str, float]:
    """Failures, rejections and drops summed over every round and phase of a run's metrics."""
    rows = json.loads((run_dir / "metrics.json").read_text())
    return {k: float(sum(r.get(k, 0.0) or 0.0 for r in rows)) for k in ("num_failures", "num_rejected", "num_dropped")}


def own_figures(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Last-round figures an algorithm reports besides ``KEY`` (recorded, not judged): the FedGP
    family's target-client accuracy, whose improvement is what those algorithms are for."""
    last = rows[-1] if rows else {}
    return {k: float(last[k]) for k in ("target_accuracy", "source_accuracy_wmean") if last.get(k) is not None}


def run_cell(
    algorithm: str, setting: str, base: dict[str, Any], seeds: list[int], out: Path,
    chance: float, margin: float, reuse: bool,
) -> dict[str, Any]:
    """Run ``algorithm`` on one setting over ``seeds`` and judge it."""
    extra, note = extra_config(algorithm, base)
    cell: dict[str, Any] = {
        "algorithm": algorithm, "setting": setting, "seeds": seeds, "extra_config": extra, "note": note,
        "chance": chance, "margin": margin, "threshold": chance + margin,
        "rounds": int(base["num-server-rounds"]), "error": None, "per_seed": [],
    }
    start = time.perf_counter()
    try:
        configs = run_configs({**base, **extra}, [algorithm], seeds, out / setting)[algorithm]
    except Exception as err:  # noqa: BLE001 - the config is refused: the cell fails
        cell.update(error=f"{type(err).__name__}: {err}", verdict="FAIL", seconds=time.perf_counter() - start)
        return cell
    cell["fingerprint"] = fingerprint(configs)
    for seed, config in zip(seeds, configs):
        run_start = time.perf_counter()
        entry: dict[str, Any] = {"seed": seed}
        try:
            rows = run_one(config, "inprocess", reuse=reuse)
            run_dir = parse_experiment(config).output_path()
            entry.update(counts(run_dir))
            last = rows[-1] if rows else {}
            entry["final_round"] = int(last.get("round", 0))
            entry["final_accuracy"] = float(last[KEY]) if last.get(KEY) is not None else float("nan")
            entry["clients_evaluated"] = float(last.get("num_clients", 0.0))
            entry["best_accuracy"] = max((float(r[KEY]) for r in rows if r.get(KEY) is not None), default=float("nan"))
            entry.update(own_figures(rows))
        except Exception as err:  # noqa: BLE001 - a run that stops is a failed cell, not a stopped sweep
            entry["error"] = f"{type(err).__name__}: {err}"
            entry["traceback"] = traceback.format_exc(limit=-3)
            cell["error"] = f"seed {seed}: {entry['error']}"
        entry["seconds"] = time.perf_counter() - run_start
        cell["per_seed"].append(entry)
    cell["seconds"] = time.perf_counter() - start
    return judge(cell)


def judge(cell: dict[str, Any]) -> dict[str, Any]:
    """Summary figures and the verdict of a cell whose seeds have run."""
    seeds = cell["per_seed"]
    finals = np.array([s.get("final_accuracy", float("nan")) for s in seeds], dtype=float)
    cell["mean"] = float(np.mean(finals)) if finals.size else float("nan")
    cell["std"] = float(np.std(finals)) if finals.size else float("nan")
    cell["min"] = float(np.min(finals)) if finals.size else float("nan")
    for key in ("num_failures", "num_rejected", "num_dropped"):
        cell[key] = float(sum(s.get(key, 0.0) for s in seeds))
    reasons = []
    if cell["error"]:
        reasons.append(cell["error"])
    if any(s.get("final_round", cell["rounds"]) != cell["rounds"] for s in seeds if "error" not in s):
        reasons.append("last evaluated round is not the last round: " + ", ".join(
            f"seed {s['seed']}: {s.get('final_round')}" for s in seeds if "error" not in s))
    if not finals.size or np.isnan(finals).any():
        reasons.append(f"{KEY} missing or NaN in the last round")
    elif cell["min"] < cell["threshold"]:
        low = [f"seed {s['seed']}: {s['final_accuracy']:.4f}" for s in seeds if s.get("final_accuracy", 0) < cell["threshold"]]
        reasons.append(f"below chance + margin = {cell['threshold']:.2f} ({', '.join(low)})")
    bad = {k: cell[k] for k in ("num_failures", "num_rejected", "num_dropped") if cell[k]}
    if bad:
        reasons.append("clients lost: " + ", ".join(f"{k} = {v:g}" for k, v in bad.items()))
    cell["reasons"] = reasons
    cell["verdict"] = "FAIL" if reasons else "PASS"
    return cell


# ------------------------------------------------------------------------------ report
def fmt(value: float, spec: str = ".4f") -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Health sweep: every algorithm above chance on the suite's own settings",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Rule: a cell PASSes when, on every seed, the last round's `{KEY}` (weighted mean test accuracy over the "
        "evaluated clients; the last round, not the best) is at least chance + margin, the last round was evaluated, "
        "no client failed, was rejected or dropped in any round (`num_failures`, `num_rejected`, `num_dropped` "
        "of each run's `metrics.json`), and no run raised. Chance = 1 / number of classes.",
        "",
        "| setting | algorithm | final accuracy (mean ± std) | min over seeds | chance | margin | failed clients | verdict | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in report["cells"].values():
        lost = cell.get("num_failures", 0) + cell.get("num_rejected", 0) + cell.get("num_dropped", 0)
        lines.append(
            f"| {cell['setting']} | {cell['algorithm']} | {fmt(cell.get('mean'))} ± {fmt(cell.get('std'))} "
            f"| {fmt(cell.get('min'))} | {cell['chance']:.2f} | +{cell['margin']:.2f} | {lost:g} "
            f"| {cell['verdict']} | {cell.get('seconds', 0):.0f} |"
        )
    lines += ["", "Seeds: " + ", ".join(f"{s}: {', '.join(map(str, v['seeds']))}" for s, v in report["settings"].items()
                                        if v["status"] == "run") + "."]
    lines += ["", "## Settings", ""]
    for name, s in report["settings"].items():
        if s["status"] == "run":
            lines.append(f"* **{name}**: {s['summary']}; chance {s['chance']:.2f}, margin +{s['margin']:.2f} "
                         f"({s['margin_reason']}).")
        elif s["status"] == "skipped":
            lines.append(f"* **{name}**: SKIPPED: {s['reason']}.")
        else:
            lines.append(f"* **{name}**: not run: {s['reason']}.")
    extras = {c["algorithm"]: c for c in report["cells"].values() if c.get("extra_config") or c.get("note")}
    if extras:
        lines += ["", "## Per-algorithm settings", ""]
        for algorithm, c in extras.items():
            cfg = ", ".join(f"`{k} = {v}`" for k, v in c["extra_config"].items()) or "none"
            lines.append(f"* **{algorithm}**: extra config {cfg}" + (f" ({c['note']})" if c.get("note") else "") + ".")
    failing = [c for c in report["cells"].values() if c["verdict"] == "FAIL"]
    lines += ["", "## Failing cells", ""]
    if not failing:
        lines.append("None.")
    for c in failing:
        lines.append(f"* **{c['setting']} / {c['algorithm']}**: " + "; ".join(c["reasons"]))
    return "\n".join(lines) + "\n"


def write(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report = portable(report)  # no machine's folders in the files
    (out / "health.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "health.md").write_text(markdown(report))


def summary_of(config: dict[str, Any]) -> str:
    clients = int(config.get("num-clients", 0)) or SIMULATED_CLIENTS
    part = config["partitioner"]
    if part == "dirichlet":
        part = f"Dirichlet({config['dirichlet-alpha']})"
    elif part == "pathological":
        part = f"{config['classes-per-client']} classes per client"
    return (f"{config['dataset']}, {part}, {clients} clients, {config['model']}, {config['num-server-rounds']} rounds, "
            f"fraction-fit {config['fraction-fit']}, max-samples {config['max-samples']}")


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=None, help="default: every registered algorithm")
    parser.add_argument("--settings", nargs="+", default=None,
                        help=f"default: {DEFAULT_SETTING} and every dataset preset ({', '.join(all_settings())})")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0 1 2")
    parser.add_argument("--rounds", type=int, default=None, help="override num-server-rounds of every setting")
    parser.add_argument("--quick", action="store_true",
                        help="a cheap check: the tiny preset, 3 rounds, seed 0 (the other flags still apply)")
    parser.add_argument("--margin", type=float, default=None, help="one margin above chance for every setting")
    parser.add_argument("-c", "--run-config", action="append", default=[],
                        help="'k=v' overrides for every setting, e.g. data-dir='/data'")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: docs/benchmark/health (docs/benchmark/health/quick with --quick)")
    parser.add_argument("--force", action="store_true",
                        help="run the selected cells again, and their runs (after a change to the library)")
    args = parser.parse_args(argv)

    algorithms = args.algorithms or list(ALGORITHMS)
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        parser.error(f"unknown algorithm(s) {', '.join(unknown)}; registered: {', '.join(ALGORITHMS)}")
    settings = args.settings or (QUICK["settings"] if args.quick else all_settings())
    unknown = [s for s in settings if s not in all_settings()]
    if unknown:
        parser.error(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(all_settings())}")
    seeds = args.seeds or (QUICK["seeds"] if args.quick else [0, 1, 2])
    rounds = args.rounds if args.rounds is not None else (QUICK["rounds"] if args.quick else None)
    out = (args.out or REPO_ROOT / "docs" / "benchmark" / "health" / ("quick" if args.quick else "")).resolve()
    overrides = parse_overrides(args.run_config)

    logging.getLogger("flwr").setLevel(logging.WARNING)
    import torch

    torch.set_num_threads(1)
    previous: dict[str, Any] = {}
    if (out / "health.json").exists():  # kept under --force too: cells not selected stay
        try:
            previous = json.loads((out / "health.json").read_text())
        except ValueError:
            previous = {}
    report: dict[str, Any] = {
        "command": "python simulations/health_sweep.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "key": KEY,
        "rule": "every seed's last-round accuracy_wmean >= 1/num_classes + margin; no failed, rejected or dropped "
                "client in any round; no error",
        "settings": dict(previous.get("settings", {})),
        "cells": dict(previous.get("cells", {})),
    }
    failed = False
    for setting in all_settings():  # the output names every setting: those not run, and why
        if setting not in settings and report["settings"].get(setting, {}).get("status") != "run":
            _, why_not = dataset_check(setting_config(setting, rounds, overrides))
            report["settings"][setting] = (
                {"status": "skipped", "reason": why_not} if why_not
                else {"status": "not run", "reason": "its dataset is available; not selected in this invocation (--settings)"})
    for setting in settings:
        base = setting_config(setting, rounds, overrides)
        num_classes, why_not = dataset_check(base)
        if why_not:
            report["settings"][setting] = {"status": "skipped", "reason": why_not}
            print(f"[health] {setting}: SKIPPED: {why_not}", flush=True)
            write(out, report)
            continue
        margin, reason = margin_of(setting, args.margin)
        chance = 1.0 / num_classes
        report["settings"][setting] = {
            "status": "run", "summary": summary_of(base), "num_classes": num_classes, "chance": chance,
            "margin": margin, "margin_reason": reason, "seeds": seeds,
            "config": {k: _home_relative(v) for k, v in base.items()},
        }
        for algorithm in algorithms:
            key = f"{setting}/{algorithm}"
            done = report["cells"].get(key)
            if done and not args.force and not done.get("error") and done.get("seeds") == seeds:
                extra, _ = extra_config(algorithm, base)
                try:
                    configs = run_configs({**base, **extra}, [algorithm], seeds, out / setting)[algorithm]
                except Exception:  # noqa: BLE001 - refused now: run it to record why
                    configs = None
                if configs is not None and done.get("fingerprint") == fingerprint(configs):
                    done["extra_config"], done["note"] = extra_config(algorithm, base)  # today's wording
                    for entry, config in zip(done["per_seed"], configs):
                        if "error" not in entry:
                            entry.update(own_figures(_evaluation_rows(parse_experiment(config))))
                    if (done["chance"], done["margin"]) != (chance, margin):  # the same runs, judged again
                        done.update(chance=chance, margin=margin, threshold=chance + margin)
                        judge(done)
                        write(out, report)
                    print(f"[health] {key}: finished before, {done['verdict']} (skipped)", flush=True)
                    failed |= done["verdict"] == "FAIL"
                    continue
            print(f"[health] {key}: running seeds {seeds} ...", flush=True)
            cell = run_cell(algorithm, setting, base, seeds, out, chance, margin, reuse=not args.force)
            report["cells"][key] = cell
            failed |= cell["verdict"] == "FAIL"
            print(f"[health] {key}: {cell['verdict']} final {fmt(cell.get('mean'))} ± {fmt(cell.get('std'))} "
                  f"(min {fmt(cell.get('min'))}, threshold {cell['threshold']:.2f}), lost clients "
                  f"{cell.get('num_failures', 0) + cell.get('num_rejected', 0) + cell.get('num_dropped', 0):g}, "
                  f"{cell['seconds']:.0f} s" + (f"; {'; '.join(cell['reasons'])}" if cell["reasons"] else ""), flush=True)
            write(out, report)
    write(out, report)
    selected = [report["cells"][f"{s}/{a}"] for s in settings for a in algorithms if f"{s}/{a}" in report["cells"]]
    failing = [c for c in selected if c["verdict"] == "FAIL"]
    print(f"[health] {len(selected) - len(failing)} of {len(selected)} cells PASS; results in {out}", flush=True)
    for c in failing:
        print(f"[health] FAIL {c['setting']}/{c['algorithm']}: {'; '.join(c['reasons'])}", flush=True)
    return 1 if failed or failing else 0


if __name__ == "__main__":
    sys.exit(main())
