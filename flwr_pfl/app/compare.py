"""Compare algorithms in one command: the same data, model, budget and seeds for each.

Every paper's claim is a comparison, so this runs a list of algorithms on one configuration
(a preset plus overrides), optionally over several seeds, and writes one table and one plot::

    python -m flwr_pfl.app.compare -c fmnist_label_skew \\
        --algorithms fedavg finetune fedrep fedper local --seeds 0 1 2 --out docs/results/fmnist

Each run goes through the real strategies and clients, on the in-process grid (default: fast,
no Ray) or on Flower's Ray simulation engine (``--engine ray``). Results: ``<out>/runs/<algo>-s<seed>/``
(each run's usual files), ``<out>/comparison.json``, ``<out>/comparison.md`` (mean and standard
deviation over seeds of the last round's figures; best round in brackets) and
``<out>/comparison.png`` (learning curves).

A run that trained nothing (every client failed in a round, or a diverged run left at chance:
:func:`flwr_pfl.app.results.judge_run`) does not stop the comparison: its row is kept, the
tables and ``comparison.json`` name it as FAILED with the first line of its summary, and the
command exits non-zero once everything is written. ``-c fail-on-no-training=false`` counts such
runs as completed.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from flwr_pfl.app.checkpoint import changed_keys
from flwr_pfl.app.keys import with_suggestions
from flwr_pfl.errors import ConfigError

if TYPE_CHECKING:
    from flwr_pfl.app.config import Experiment

# The configuration, the registry and the results writer import the training stack (torch):
# they are imported where a function needs them, so that `--help` and the command line's
# checks start in a fraction of a second (docs/benchmark/entry_points.md).

#: figures reported per algorithm (those a run produced)
REPORTED = (
    "accuracy_wmean", "accuracy_mean", "accuracy_min", "acc_domain_min", "acc_domain_mean",
    "global_accuracy_wmean", "loss_wmean", "mse_wmean",
)


def finished(experiment: Experiment) -> bool:
    """Whether ``experiment`` already ran to its end in its output directory with this
    configuration (its ``summary.txt`` is written last; ``config.json`` first; keys added to the
    app since, at their defaults, are no change: :func:`~flwr_pfl.app.checkpoint.changed_keys`)."""
    out = experiment.output_path()
    if not (out / "summary.txt").exists() or not (out / "metrics.json").exists():
        return False
    try:
        saved = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and not changed_keys(saved, json.loads(json.dumps(experiment.to_dict(), sort_keys=True)))


def run_one(run_config: dict[str, Any], engine: str, reuse: bool = False) -> list[dict[str, Any]]:
    """Run one configuration; return its evaluation rows (one per round).

    With ``reuse``, a run that already finished with the same configuration is read, not run
    again (reruns are bit-identical, so nothing is lost), so a long comparison can be stopped
    and started again.
    """
    from flwr_pfl.app.config import parse_experiment

    experiment = parse_experiment(run_config)
    if reuse and finished(experiment):
        logging.getLogger("flwr").warning("reusing the finished run %s", experiment.output_path())
        return _evaluation_rows(experiment)
    # The comparison owns <out>/runs/: a run it starts again replaces the earlier one there (the
    # app itself never overwrites a run's directory).
    shutil.rmtree(experiment.output_path(), ignore_errors=True)
    try:
        if engine == "ray":
            from flwr_pfl.app.simulation import run_ray_simulation

            run_ray_simulation(run_config, experiment.run.num_clients)
        else:
            from flwr_pfl.app.client_app import app as client_app
            from flwr_pfl.app.inprocess import run_inprocess
            from flwr_pfl.app.server_app import app as server_app

            run_inprocess(server_app, client_app, experiment.run.num_clients, run_config)
    except Exception:
        # A run that went to its end and was judged to have trained nothing raised after
        # writing its results: the comparison reports it (failed_runs) and goes on. Any other
        # error (one that stopped the run) stops the comparison.
        if not judged_failed(experiment):
            raise
    return _evaluation_rows(experiment)


def judged_failed(experiment: Experiment) -> bool:
    """Whether ``experiment``'s run went to its end and was judged failed (its
    ``summary.json``), as opposed to stopped by an error or completed."""
    from flwr_pfl.app.results import FAILED, read_status

    status = read_status(experiment.output_path())
    return status is not None and status.get("status") == FAILED and not status.get("stopped")


def failed_runs(configs: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """Run name -> why, for every run of ``configs`` whose results record status ``failed``
    (the reasons from its ``summary.json``, as the first line of its summary gives them)."""
    from flwr_pfl.app.config import parse_experiment
    from flwr_pfl.app.results import FAILED, read_status

    out: dict[str, str] = {}
    for runs in configs.values():
        for config in runs:
            experiment = parse_experiment(config)
            status = read_status(experiment.output_path())
            if status is not None and status.get("status") == FAILED:
                out[experiment.output_path().name] = "; ".join(status.get("problems") or ["failed"])
    return out


def _evaluation_rows(experiment: Experiment) -> list[dict[str, Any]]:
    rows = json.loads((experiment.output_path() / "metrics.json").read_text())
    return [r for r in rows if r["phase"] == "evaluate"]


def summarize_runs(rows_by_seed: list[list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Mean and std over seeds of each reported figure in the last round, plus its best round."""
    out: dict[str, dict[str, float]] = {}
    for key in REPORTED:
        last = [rows[-1][key] for rows in rows_by_seed if rows and rows[-1].get(key) is not None]
        if not last:
            continue
        pick = min if key.startswith(("loss", "mse")) else max
        best = [pick(r[key] for r in rows if r.get(key) is not None) for rows in rows_by_seed]
        out[key] = {"mean": float(np.mean(last)), "std": float(np.std(last)), "best_mean": float(np.mean(best)), "n": len(last)}
    return out


def paired_differences(
    curves: dict[str, list[list[dict[str, Any]]]], key: str, reference: str
) -> dict[str, dict[str, Any]]:
    """Each algorithm's last-round ``key`` minus the reference's, seed by seed (paired: same data,
    partition, initial model and client sample), with a verdict.

    The verdict is ``ahead`` or ``behind`` only when every seed's difference has the same sign
    and the mean difference exceeds the differences' standard deviation; otherwise ``tie``. With
    one seed there is no spread, so nothing is called (``one seed``).
    """
    def last(rows: list[dict[str, Any]]) -> float | None:
        return rows[-1].get(key) if rows else None

    base = [last(rows) for rows in curves[reference]]
    out: dict[str, dict[str, Any]] = {}
    for algorithm, runs in curves.items():
        if algorithm == reference:
            continue
        diffs = np.array([v - b for v, b in zip(map(last, runs), base) if v is not None and b is not None], dtype=float)
        if diffs.size == 0:
            continue
        mean, std = float(diffs.mean()), float(diffs.std(ddof=1)) if diffs.size > 1 else 0.0
        out[algorithm] = {"mean": mean, "std": std, "min": float(diffs.min()), "max": float(diffs.max()),
                          "n": int(diffs.size), "verdict": paired_verdict(diffs)}
    return out


def paired_verdict(diffs: np.ndarray) -> str:
    """``ahead`` / ``behind`` for paired per-seed differences (higher is better) only when every
    seed agrees in sign and the mean's magnitude exceeds the differences' sample std; ``tie``
    otherwise, and ``one seed`` when there is no spread to compare with."""
    diffs = np.asarray(diffs, dtype=float)
    if diffs.size < 2:
        return "one seed"
    mean, std = float(diffs.mean()), float(diffs.std(ddof=1))
    if (diffs > 0).all() and mean > std:
        return "ahead"
    if (diffs < 0).all() and -mean > std:
        return "behind"
    return "tie"


def paired_markdown(paired: dict[str, dict[str, Any]], key: str, reference: str) -> str:
    lines = [
        f"Paired over seeds: last-round `{key}` minus {reference}'s, seed by seed (mean ± sample std, min..max).",
        "A method is ahead or behind only when every seed agrees in sign and the mean exceeds the std.",
        "",
        f"| algorithm | difference vs {reference} | min..max | verdict |",
        "|---|---|---|---|",
    ]
    for algorithm, d in paired.items():
        lines.append(f"| {algorithm} | {d['mean']:+.4f} ± {d['std']:.4f} | {d['min']:+.4f}..{d['max']:+.4f} | {d['verdict']} |")
    return "\n".join(lines)


def markdown(summary: dict[str, dict[str, dict[str, float]]]) -> str:
    keys = [k for k in REPORTED if any(k in s for s in summary.values())]
    lines = ["| algorithm | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for algorithm, figures in summary.items():
        cells = []
        for key in keys:
            f = figures.get(key)
            cells.append("" if f is None else f"{f['mean']:.4f} ± {f['std']:.4f} ({f['best_mean']:.4f})")
        lines.append(f"| {algorithm} | " + " | ".join(cells) + " |")
    seeds = max((f["n"] for s in summary.values() for f in s.values()), default=0)
    lines.append("")
    lines.append(f"Last round, mean ± std over {seeds} seed(s); best round's mean in brackets.")
    return "\n".join(lines)


def plot(curves: dict[str, list[list[dict[str, Any]]]], path: Path, key: str) -> None:
    from flwr_pfl.app.plots import plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for algorithm, runs in curves.items():
        runs = [r for r in runs if r and all(key in row for row in r)]
        if not runs:
            continue
        length = min(len(r) for r in runs)
        values = np.array([[row[key] for row in r[:length]] for r in runs])
        rounds = [row["round"] for row in runs[0][:length]]
        mean = values.mean(0)
        ax.plot(rounds, mean, label=algorithm)
        if len(runs) > 1:
            ax.fill_between(rounds, mean - values.std(0), mean + values.std(0), alpha=0.15)
    ax.set_xlabel("round")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _home_relative(value: Any) -> Any:
    """Paths under the home directory written as ``~/...``, so result files travel."""
    home = str(Path.home())
    if isinstance(value, str) and value.startswith(home + "/"):
        return "~" + value[len(home):]
    return value


def run_configs(base_config: dict[str, Any], algorithms: list[str], seeds: list[int], out: Path) -> dict[str, list[dict[str, Any]]]:
    """The run config of every (algorithm, seed), checked before anything runs.

    A comparison can take hours; a misspelt algorithm name, or an option one algorithm refuses,
    must stop it at once, not after the runs listed before it. Every name is checked against
    the registry (all unknown names in one message, with the closest known ones), then every
    algorithm's config is parsed and its strategy built, and every failure is reported together.
    ``num-clients = 0`` (the federation's size) becomes
    :data:`~flwr_pfl.app.config.SIMULATED_CLIENTS`: this tool makes the federation.

    Raises:
        ConfigError: unknown algorithm names, or configurations that do not parse.
    """
    from flwr_pfl.app.config import SIMULATED_CLIENTS
    from flwr_pfl.app.registry import ALGORITHMS

    unknown = [a for a in dict.fromkeys(algorithms) if a not in ALGORITHMS]
    if unknown:
        raise ConfigError(
            f"--algorithms: unknown algorithm name(s) {with_suggestions(unknown, ALGORITHMS)}; "
            f"allowed: {', '.join(sorted(ALGORITHMS))}"
        )
    num_clients = int(base_config.get("num-clients", 0)) or SIMULATED_CLIENTS
    configs = {
        a: [{**base_config, "algorithm": a, "seed": seed, "num-clients": num_clients, "output-dir": str(out / "runs"),
             "run-name": f"{a}-s{seed}"}
            for seed in seeds]
        for a in algorithms
    }
    problems = list(dict.fromkeys(  # one line per algorithm and distinct problem
        f"{a}: {err}" for a, runs in configs.items() for err in map(_config_problem, runs) if err
    ))
    if problems:
        raise ConfigError("the comparison's configuration is refused, nothing was run:\n  " + "\n  ".join(problems))
    return configs


def _config_problem(config: dict[str, Any]) -> str | None:
    """Why ``config`` would stop its run before training (its parse or its strategy), or None."""
    from flwr_pfl.app.config import parse_experiment
    from flwr_pfl.app.server_app import build_strategy

    try:
        build_strategy(parse_experiment(config))
    except ConfigError as err:
        return str(err)
    return None


def compare(
    base_config: dict[str, Any], algorithms: list[str], seeds: list[int], out: Path,
    engine: str = "inprocess", reuse: bool = False,
) -> dict[str, Any]:
    """Run every (algorithm, seed) and write the comparison files; returns the summary.

    Every configuration is checked first (:func:`run_configs`); with ``reuse``, runs that
    already finished with the same configuration are read instead of run (:func:`run_one`).
    """
    out = out.resolve()
    configs = run_configs(base_config, algorithms, seeds, out)
    curves: dict[str, list[list[dict[str, Any]]]] = {
        algorithm: [run_one(config, engine, reuse) for config in runs] for algorithm, runs in configs.items()
    }
    summary = {algorithm: summarize_runs(runs) for algorithm, runs in curves.items()}
    out.mkdir(parents=True, exist_ok=True)
    shareable = {k: _home_relative(v) for k, v in base_config.items()}
    key = next((k for k in ("accuracy_wmean", "mse_wmean", "loss_wmean") if any(k in s for s in summary.values())), "loss_wmean")
    reference = algorithms[0]
    paired = paired_differences(curves, key, reference)
    failed = failed_runs(configs)
    (out / "comparison.json").write_text(json.dumps(
        {"config": shareable, "seeds": seeds, "summary": summary, "paired": {"key": key, "reference": reference, "differences": paired},
         "failed": failed},
        indent=2,
    ))
    (out / "comparison.md").write_text(
        markdown(summary) + "\n\n" + paired_markdown(paired, key, reference) + "\n" + failed_markdown(failed)
    )
    plot(curves, out / "comparison.png", key)
    return summary


def failed_markdown(failed: dict[str, str]) -> str:
    """The FAILED runs of a comparison and why, one line each ("" when none failed)."""
    if not failed:
        return ""
    lines = [f"FAILED runs ({len(failed)}; their figures above are not results):", ""]
    lines += [f"- {name}: {why}" for name, why in failed.items()]
    return "\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from flwr_pfl.app.appdir import default_run_config
    from flwr_pfl.app.overrides import parse_overrides

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--run-config", action="append", default=[],
                        help="a preset (TOML path or shipped name, e.g. tiny) or 'k=v' overrides; repeatable")
    parser.add_argument("--algorithms", nargs="+", required=True)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--engine", choices=("inprocess", "ray"), default="inprocess")
    parser.add_argument("--reuse", action="store_true",
                        help="read runs that already finished with the same config instead of running them again")
    parser.add_argument("--tracking", default="",
                        help="experiment tracking of every run: tensorboard, mlflow, wandb (comma-separated; run key tracking); "
                             "`tensorboard --logdir <out>/runs` shows the runs side by side")
    args = parser.parse_args(argv)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    import torch

    torch.set_num_threads(1)
    overrides = parse_overrides(args.run_config)
    if args.tracking:
        overrides["tracking"] = args.tracking
    base = default_run_config(overrides)
    summary = compare(base, args.algorithms, args.seeds, args.out, args.engine, args.reuse)
    print(markdown(summary))
    failed = json.loads((args.out / "comparison.json").read_text())["failed"]
    if failed:
        raise SystemExit(f"FAILED: {len(failed)} run(s) trained nothing:\n" + failed_markdown(failed).strip())
    if any(math.isnan(f["mean"]) for s in summary.values() for f in s.values()):
        raise SystemExit("some runs produced NaN figures")


if __name__ == "__main__":
    main()
