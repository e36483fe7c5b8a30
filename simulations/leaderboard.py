"""Leaderboard: every registered algorithm on two shared settings, each at its best learning rate.

The papers' tables compare a method with the competitors it chose, each at the paper's settings.
This page puts every algorithm of the registry (``flwr_pfl.app.registry.ALGORITHMS``: a newly
registered one is included without editing this file) side by side on the same two settings:

* ``fmnist-dir0.3``: Fashion-MNIST, Dirichlet(0.3) label skew, 20 clients, the small CNN
  (the ``fmnist_label_skew`` preset);
* ``rotated-mnist``: MNIST in four rotations (0, 90, 180, 270 degrees), client k holding rotation
  k mod 4 (five clients each), 20 clients, the small CNN (the ``rotated_mnist`` preset);

with ``--rounds`` rounds (default 20), full participation, 1 local epoch, SGD, each setting's
learning rate multiplied by every factor of ``--lr-factors`` (default 0.5, 1, 2), and
``--seeds`` (default 0 1 2). Algorithms that need a setting to do their own work get the least
extra configuration the health sweep gives them (``simulations/health_sweep.py``'s
``extra_config``: FMTL's FedAvg phase shortened, FEDORA's validation split), stated per row.

The reporting rule. Each run's figure is the weighted mean test accuracy of the LAST round
(``accuracy_wmean``, not the best round). A row's learning rate is the grid's factor with the
highest mean over the seeds (chosen on the same figure that is reported, as PFLlib's and
FL-bench's leaderboards do: every row gets the same optimistic tuning), and the row gives that
factor's mean ± std over the seeds (population std) and its seconds per round (the mean wall time
of rounds 2 onwards, from the run's ``timings.json``: round 1 also loads data; in-process, one
torch thread; compare rows measured in one sweep only). A
difference between two rows is a win only when it exceeds both rows' std. A row whose best factor
is at the edge of the grid says so: its best rate may lie outside it.

    python simulations/leaderboard.py                                # both settings, every algorithm
    python simulations/leaderboard.py --algorithms fedavg fedrep --settings rotated-mnist
    python simulations/leaderboard.py --quick                        # tiny data, 2 rounds, 1 seed, 1 factor

Every finished run is recorded in ``<out>/leaderboard.json`` as soon as it ends; a rerun skips
the runs recorded there with the same configuration (``--force`` runs them again), so the sweep
can be stopped and resumed; ``--report-only`` runs nothing and rewrites the page from the runs
recorded, for the grid the other options select (a partial sweep's page says how many of the
grid's runs are done and, per row, which factors are not). Writes ``<out>/leaderboard.json`` and the page ``<page>`` (defaults
``docs/benchmark/leaderboard`` and ``docs/leaderboard.md``; with ``--quick``, under
``docs/benchmark/leaderboard/quick`` and no page unless ``--page`` is given).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_common import portable, round_times
from health_sweep import KEY, counts, extra_config, fingerprint, setting_config, summary_of

from flwr_pfl.app.compare import run_configs, run_one
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.overrides import parse_overrides
from flwr_pfl.app.registry import ALGORITHMS

REPO_ROOT = Path(__file__).resolve().parents[1]
#: setting -> the preset it is built from, and the overrides that make it the leaderboard's
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "fmnist-dir0.3": ("fmnist_label_skew", {"fraction-fit": 1.0, "fraction-evaluate": 1.0}),
    "rotated-mnist": ("rotated_mnist", {"fraction-fit": 1.0, "fraction-evaluate": 1.0}),
}
#: --quick: the tiny preset (3 IID clients, an MLP), 2 rounds, one seed, one factor
QUICK = {"settings": {"tiny": ("tiny", {})}, "rounds": 2, "seeds": [0], "factors": [1.0]}


def setting_base(preset: str, overrides: dict[str, Any], rounds: int, user: dict[str, Any]) -> dict[str, Any]:
    """The run config of a setting: the default experiment, the preset, the leaderboard's
    overrides, ``rounds`` and the command line's ``-c`` overrides."""
    return setting_config(preset, rounds, {**overrides, **user})


def run_key(setting: str, algorithm: str, factor: float, seed: int) -> str:
    return f"{setting}/{algorithm}/x{factor:g}/s{seed}"


def one_run(config: dict[str, Any], reuse: bool) -> dict[str, Any]:
    """Run one configuration in-process; its last round's figure, time per round and lost clients."""
    start = time.perf_counter()
    entry: dict[str, Any] = {}
    try:
        rows = run_one(config, "inprocess", reuse=reuse)
        last = rows[-1] if rows else {}
        entry["final_round"] = int(last.get("round", 0))
        entry["final_accuracy"] = float(last[KEY]) if last.get(KEY) is not None else float("nan")
        run_dir = parse_experiment(config).output_path()
        entry.update(counts(run_dir))
        rounds = round_times(run_dir)["rounds"]
        steady = rounds[1:] or rounds  # round 1 also loads the data and starts the clients
        entry["seconds_per_round"] = float(np.mean(steady)) if steady else float("nan")
    except Exception as err:  # noqa: BLE001 - a failed run is a row's finding, not the sweep's end
        entry["error"] = f"{type(err).__name__}: {err}"
    entry["seconds"] = time.perf_counter() - start
    entry.setdefault("seconds_per_round", float("nan"))
    return entry


def row(report: dict[str, Any], setting: str, algorithm: str, factors: list[float], seeds: list[int]) -> dict[str, Any]:
    """The row of ``algorithm`` on ``setting``: every factor's mean ± std, the best factor."""
    per_factor = {}
    for factor in factors:
        runs = [report["runs"].get(run_key(setting, algorithm, factor, s)) for s in seeds]
        finals = np.array([r.get("final_accuracy", np.nan) if r else np.nan for r in runs], dtype=float)
        complete = all(r is not None and "error" not in r for r in runs) and not np.isnan(finals).any()
        per_factor[factor] = {
            "mean": float(finals.mean()) if complete else float("nan"),
            "std": float(finals.std()) if complete else float("nan"),
            "seconds_per_round": float(np.nanmean([r["seconds_per_round"] for r in runs if r])) if any(runs) else float("nan"),
            "lost_clients": float(sum(r.get(k, 0.0) for r in runs if r for k in ("num_failures", "num_rejected", "num_dropped"))),
            "errors": [r["error"] for r in runs if r and "error" in r],
            "runs": sum(r is not None for r in runs),
        }
    scored = {f: v for f, v in per_factor.items() if not math.isnan(v["mean"])}
    best = max(scored, key=lambda f: scored[f]["mean"]) if scored else None
    edge = best is not None and len(factors) > 1 and best in (min(factors), max(factors))
    return {"setting": setting, "algorithm": algorithm, "per_factor": per_factor, "best_factor": best, "at_edge": edge}


def progress(report: dict[str, Any]) -> tuple[int, int]:
    """Runs recorded for the page's grid, and the grid's size (settings x algorithms x factors x seeds)."""
    grid = report.get("grid") or {"settings": list(report["settings"]),
                                  "algorithms": sorted({r["algorithm"] for r in report["rows"].values()})}
    keys = [run_key(s, a, f, seed) for s in grid["settings"] for a in grid["algorithms"]
            for f in report["factors"] for seed in report["seeds"]]
    return sum(k in report["runs"] for k in keys), len(keys)


def same_as(report: dict[str, Any], setting: str, algorithm: str, earlier: list[str]) -> str | None:
    """The first of ``earlier`` whose final accuracy equals ``algorithm``'s on every run both have
    on ``setting`` (at least one): an algorithm that reduces to another there (FedBN on a model
    without normalisation layers, a domain method on single-domain clients) gets the same bytes."""
    def finals(name: str) -> dict[str, float]:
        prefix = f"{setting}/{name}/"
        return {k[len(prefix):]: r["final_accuracy"] for k, r in report["runs"].items()
                if k.startswith(prefix) and "final_accuracy" in r}

    own = finals(algorithm)
    for other in earlier:
        theirs = finals(other)
        if own and own.keys() <= theirs.keys() and all(theirs[k] == v for k, v in own.items()):
            return other
    return None


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def markdown(report: dict[str, Any]) -> str:
    factors, seeds = report["factors"], report["seeds"]
    lines = [
        "# Leaderboard: every algorithm on two shared settings",
        "",
        f"Regenerate: `{report['command']}` (resumable; the runs recorded so far took {report.get('hours', '?')} hours of CPU on 2 cores).",
        "",
        "**Reporting rule.** A run's figure is the weighted mean test accuracy of its **final round** "
        f"(`{KEY}`), never its best round. Each row is at its best learning rate from the grid "
        f"{', '.join(f'x{f:g}' for f in factors)} of the setting's rate (best = highest mean over the seeds, "
        "chosen on the reported figure, as PFLlib and FL-bench do), and gives that rate's mean ± std "
        f"(population std over seeds {', '.join(map(str, seeds))}) and seconds per round (mean wall time of rounds 2 "
        "onwards, in-process, one torch thread; compare rows of one sweep only). A difference is a win only where it exceeds both "
        "rows' std. `edge`: the best rate is at the grid's edge, so a better one may lie outside it. Runs with "
        "lost clients (failed, rejected or dropped replies) or errors are marked.",
        "",
    ]
    done, expected = progress(report)
    if done < expected:
        seconds = [r["seconds"] for r in report["runs"].values() if "seconds" in r]
        left = f" (about {np.mean(seconds) * (expected - done) / 3600:.0f} hours of CPU left at the mean run time so far)" if seconds else ""
        lines += [f"**Status: {done} of the grid's {expected} runs are done**{left}, so the page is provisional: a row "
                  "is ranked on the factors whose seeds have all run (`not run` names the others), and a "
                  "row without one is not ranked. The command above resumes the sweep where it stopped.", ""]
    for setting, info in report["settings"].items():
        rows = sorted((r for r in report["rows"].values() if r["setting"] == setting),
                      key=lambda r: -(r["per_factor"][r["best_factor"]]["mean"] if r["best_factor"] is not None else -1))
        lines += [f"## {setting}", "", info["summary"] + f"; learning rate {info['learning_rate']:g} x factor.", "",
                  "| rank | algorithm | final accuracy (mean ± std) | best factor | s / round | every factor (mean) | notes |",
                  "|---|---|---|---|---|---|---|"]
        registered = [r["algorithm"] for r in report["rows"].values() if r["setting"] == setting]
        for rank, r in enumerate(rows, 1):
            best = r["best_factor"]
            cell = r["per_factor"].get(best, {}) if best is not None else {}
            every = ", ".join(f"x{f:g}: {fmt(v['mean']) or '—'}" for f, v in sorted(r["per_factor"].items()))
            notes = []
            if r["at_edge"]:
                notes.append("edge")
            missing = [f for f, v in sorted(r["per_factor"].items()) if v["runs"] < len(seeds)]
            if missing:
                notes.append("not run: " + ", ".join(f"x{f:g} ({r['per_factor'][f]['runs']} of {len(seeds)} seeds)" for f in missing))
            if any(v["lost_clients"] for v in r["per_factor"].values()):
                notes.append("lost clients")
            errors = [e for v in r["per_factor"].values() for e in v["errors"]]
            if errors:
                notes.append(f"{len(errors)} failed run(s): {errors[0][:120]}")
            twin = same_as(report, setting, r["algorithm"], registered[:registered.index(r["algorithm"])])
            if twin is not None:
                notes.append(f"the same final accuracy as {twin} on every seed run: it reduces to {twin} on this setting")
            extra = report["extra"].get(r["algorithm"])
            if extra:
                notes.append(extra)
            lines.append(f"| {rank if best is not None else '—'} | {r['algorithm']} | {fmt(cell.get('mean'))} ± "
                         f"{fmt(cell.get('std'))} | {'x' + format(best, 'g') if best is not None else '—'} | "
                         f"{fmt(cell.get('seconds_per_round'), '.2f')} | {every} | {'; '.join(notes)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=None, help="default: every registered algorithm")
    parser.add_argument("--settings", nargs="+", default=None, help=f"default: {', '.join(SETTINGS)}")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0 1 2")
    parser.add_argument("--lr-factors", nargs="+", type=float, default=None, help="default: 0.5 1 2")
    parser.add_argument("--rounds", type=int, default=None, help="default: 20")
    parser.add_argument("--quick", action="store_true", help="tiny preset, 2 rounds, seed 0, factor 1")
    parser.add_argument("-c", "--run-config", action="append", default=[], help="'k=v' overrides for every run")
    parser.add_argument("--out", type=Path, default=None, help="default: docs/benchmark/leaderboard[/quick]")
    parser.add_argument("--page", type=Path, default=None, help="default: docs/leaderboard.md (none with --quick)")
    parser.add_argument("--force", action="store_true", help="run the selected runs again")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: rewrite the page from the runs recorded, for the grid selected")
    args = parser.parse_args(argv)

    settings = QUICK["settings"] if args.quick else SETTINGS
    chosen = args.settings or list(settings)
    unknown = [s for s in chosen if s not in settings]
    if unknown:
        parser.error(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(settings)}")
    algorithms = args.algorithms or list(ALGORITHMS)
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        parser.error(f"unknown algorithm(s) {', '.join(unknown)}; registered: {', '.join(ALGORITHMS)}")
    seeds = args.seeds or (QUICK["seeds"] if args.quick else [0, 1, 2])
    factors = args.lr_factors or (QUICK["factors"] if args.quick else [0.5, 1.0, 2.0])
    rounds = args.rounds or (QUICK["rounds"] if args.quick else 20)
    out = (args.out or REPO_ROOT / "docs" / "benchmark" / "leaderboard" / ("quick" if args.quick else "")).resolve()
    page = args.page or (None if args.quick else REPO_ROOT / "docs" / "leaderboard.md")
    user = parse_overrides(args.run_config)

    logging.getLogger("flwr").setLevel(logging.WARNING)
    import torch

    torch.set_num_threads(1)
    path = out / "leaderboard.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    report: dict[str, Any] = {
        "command": " ".join(["python simulations/leaderboard.py",
                             *(a for a in (sys.argv[1:] if argv is None else argv) if a != "--report-only")]),
        "rule": f"final-round {KEY}; best learning-rate factor by mean over seeds; mean ± population std",
        "seeds": seeds, "factors": factors, "rounds": rounds,
        "settings": dict(previous.get("settings", {})), "runs": dict(previous.get("runs", {})), "rows": {},
        "grid": {"settings": chosen, "algorithms": algorithms},
        "extra": dict(previous.get("extra", {})),
    }

    def save() -> None:
        out.mkdir(parents=True, exist_ok=True)
        if not args.report_only:  # the runs' record is the sweep's; a page rewrite leaves it alone
            path.write_text(json.dumps(portable(report), indent=1, default=str))
        if page is not None:
            page.write_text(markdown(report))

    for setting in chosen:
        preset, overrides = settings[setting]
        base = setting_base(preset, overrides, rounds, user)
        report["settings"][setting] = {"preset": preset, "summary": summary_of(base),
                                       "learning_rate": float(base["learning-rate"])}
        for algorithm in algorithms:
            extra, note = extra_config(algorithm, base)
            if extra:
                report["extra"][algorithm] = ", ".join(f"{k} = {v}" for k, v in extra.items()) + (f" ({note})" if note else "")
            for factor in [] if args.report_only else factors:
                config = {**base, **extra, "learning-rate": float(base["learning-rate"]) * factor}
                configs = run_configs(config, [algorithm], seeds, out / setting / f"x{factor:g}")[algorithm]
                for seed, run_config in zip(seeds, configs):
                    key = run_key(setting, algorithm, factor, seed)
                    digest = fingerprint([run_config])
                    done = report["runs"].get(key)
                    if done and not args.force and done.get("fingerprint") == digest and "error" not in done:
                        continue
                    entry = one_run(run_config, reuse=not args.force) | {"fingerprint": digest}
                    report["runs"][key] = entry
                    print(f"[leaderboard] {key}: {fmt(entry.get('final_accuracy'))} "
                          f"({entry['seconds_per_round']:.2f} s/round){' ' + entry['error'] if 'error' in entry else ''}",
                          flush=True)
                    report["rows"][f"{setting}/{algorithm}"] = row(report, setting, algorithm, factors, seeds)
                    save()
            report["rows"][f"{setting}/{algorithm}"] = row(report, setting, algorithm, factors, seeds)
    # the page lists every row recorded, also those of earlier invocations (other --algorithms)
    for key in sorted(report["runs"]):
        setting, algorithm = key.split("/")[:2]
        if setting in report["settings"] and f"{setting}/{algorithm}" not in report["rows"]:
            report["rows"][f"{setting}/{algorithm}"] = row(report, setting, algorithm, factors, seeds)
    total = sum(r.get("seconds", 0.0) for r in report["runs"].values())
    report["hours"] = f"{total / 3600:.1f}"
    save()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
