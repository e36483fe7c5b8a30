"""What differential privacy and secure aggregation cost in accuracy on the default experiment.

Runs the default experiment (``pyproject.toml``'s run config: Fashion-MNIST, Dirichlet(0.3)
label skew, the small CNN, 5 rounds, 10 clients) for each algorithm without DP, at two
client-level privacy levels (``--noise``: ``dp-noise-multiplier``; the epsilon each spends at
``--delta`` is computed by the suite's accountant) and at two record-level levels
(``--record-noise``: DP-SGD's ``dp-record-noise-multiplier``; the epsilon is the largest any
client reported at ``--record-delta``), over several seeds, on the in-process engine through
the comparison tool's own functions; and with Flower's SecAgg+ (``--secagg``, on by default:
``secure-aggregation = "secagg+"``, whose only cost is its quantization). The noise is seeded with the run's seed
(``dp-noise-seed``) so that the table can be reproduced; a deployment keeps the default secret
noise. Algorithms that refuse a kind of DP are skipped for it.

    python simulations/dp_cost.py                          # fedavg, fedrep; client z = 1, 4; record z = 1, 2
    python simulations/dp_cost.py --algorithms fedavg --noise 0.5 2 --record-noise 1 --seeds 0

Writes ``<out>/dp_cost.json`` and ``<out>/dp_cost.md`` (default ``docs/benchmark/privacy``)
after every cell; rerun, it reads finished runs instead of running them again.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path
from typing import Any

from flwr_pfl.app.appdir import default_run_config
from flwr_pfl.app.compare import run_configs, run_one
from flwr_pfl.app.config import SIMULATED_CLIENTS, parse_experiment
from flwr_pfl.app.results import read_status
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.privacy import ClientLevelDP, PrivateAggregator

REPO_ROOT = Path(__file__).resolve().parents[1]
KEY = "accuracy_wmean"


def planned_epsilon(noise: float, clip: float, delta: float, rounds: int, clients: int) -> float:
    """The epsilon a run of ``rounds`` full-participation rounds spends (the strategy's own accountant)."""
    return PrivateAggregator(ClientLevelDP(noise, clip, delta=delta), clients, clients).planned_epsilon(rounds, clients)


def cell(base: dict[str, Any], algorithm: str, kind: str, noise: float, args: argparse.Namespace,
         out: Path) -> dict[str, Any]:
    """``kind``: "none", "client" (client-level DP) or "record" (DP-SGD)."""
    extra: dict[str, Any] = {}
    if kind == "client":
        extra = {"dp-noise-multiplier": noise, "dp-clip-norm": args.clip, "dp-delta": args.delta}
    elif kind == "secagg":
        extra = {"secure-aggregation": "secagg+"}
    elif kind == "record":
        extra = {"dp-record-noise-multiplier": noise, "dp-record-clip-norm": args.record_clip,
                 "dp-record-delta": args.record_delta}
    label = {"none": "none", "secagg": "SecAgg+"}.get(kind, f"{kind} z={noise:g}")
    finals, failed, record_eps = [], 0, []
    for seed in args.seeds:
        config = run_configs({**base, **extra, **({"dp-noise-seed": seed} if kind in ("client", "record") else {})}, [algorithm],
                             [seed], out / "runs" / label.replace(" ", "-"))[algorithm][0]
        rows = run_one(config, "inprocess", reuse=True)
        finals.append(rows[-1][KEY])
        directory = parse_experiment(config).output_path()
        status = read_status(directory) or {}
        failed += status.get("status") != "completed"
        if kind == "record":
            fits = [r for r in json.loads((directory / "metrics.json").read_text()) if r["phase"] == "fit"]
            record_eps.append(max(r.get("dp_record_epsilon_max", 0.0) for r in fits))
    rounds = int(base["num-server-rounds"])
    epsilon = None
    if kind == "client":
        epsilon = planned_epsilon(noise, args.clip, args.delta, rounds, SIMULATED_CLIENTS)
    elif kind == "record":
        epsilon = max(record_eps)
    return {
        "algorithm": algorithm, "dp": label, "kind": kind, "noise_multiplier": noise,
        "clip_norm": {"client": args.clip, "record": args.record_clip}.get(kind),
        "delta": {"client": args.delta, "record": args.record_delta}.get(kind), "epsilon": epsilon,
        "seeds": list(args.seeds), "final_accuracy": finals, "failed_runs": failed,
        "mean": statistics.mean(finals), "std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
    }


def table(cells: list[dict[str, Any]], args: argparse.Namespace, rounds: int) -> str:
    lines = [
        "# Accuracy cost of differential privacy (default experiment)",
        "",
        f"Fashion-MNIST, Dirichlet(0.3), small CNN, {rounds} rounds, {SIMULATED_CLIENTS} clients, all sampled every round; "
        f"seeds {', '.join(map(str, args.seeds))}. Final-round example-weighted mean accuracy of the clients' own "
        "test splits (mean +- std over seeds). *client*: client-level DP of the shared model (clip norm "
        f"{args.clip}, delta {args.delta}; epsilon of the whole run, add-or-remove-one client, no amplification "
        f"by sampling). *record*: DP-SGD in every client (clip norm {args.record_clip}, delta {args.record_delta}, "
        "batch size 32, Poisson sampling; epsilon of the whole run, one record, the largest any client "
        "reported). *SecAgg+*: the fit replies summed by Flower's SecAgg+ protocol (default settings: "
        "clipping range 8, 2^22 levels, max weight 1000), no DP. A failed run is one the suite judged failed (training diverged and ended at chance, or a "
        "round trained nothing).",
        "",
        "| algorithm | DP | epsilon | accuracy | runs failed |",
        "|---|---|---|---|---|",
    ]
    for c in cells:
        eps = "-" if c["epsilon"] is None else f"{c['epsilon']:.2f}"
        lines.append(f"| {c['algorithm']} | {c['dp']} | {eps} | {c['mean']:.4f} +- {c['std']:.4f} | "
                     f"{c['failed_runs']} of {len(c['seeds'])} |")
    lines += ["", "Command: `python simulations/dp_cost.py " + " ".join(
        ["--algorithms", *args.algorithms, "--noise", *map(str, args.noise), "--record-noise",
         *map(str, args.record_noise), "--seeds", *map(str, args.seeds), *([] if args.secagg else ["--no-secagg"])]) + "`",
        ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "fedrep"])
    parser.add_argument("--noise", nargs="+", type=float, default=[1.0, 4.0], help="noise multipliers (0 is always run)")
    parser.add_argument("--clip", type=float, default=0.5)
    parser.add_argument("--delta", type=float, default=1e-3)
    parser.add_argument("--record-noise", nargs="*", type=float, default=[1.0, 2.0],
                        help="DP-SGD noise multipliers (none: no record-level rows)")
    parser.add_argument("--record-clip", type=float, default=1.0)
    parser.add_argument("--record-delta", type=float, default=1e-4)
    parser.add_argument("--secagg", action=argparse.BooleanOptionalAction, default=True,
                        help="also run each algorithm with SecAgg+ (where it accepts it)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "benchmark" / "privacy")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    base = default_run_config()
    args.out.mkdir(parents=True, exist_ok=True)
    cells = []
    for algorithm in args.algorithms:
        kinds = [("none", 0.0), *([("secagg", 0.0)] if args.secagg else []), *(("client", z) for z in args.noise),
                 *(("record", z) for z in args.record_noise)]
        for kind, noise in kinds:
            try:
                cells.append(cell(base, algorithm, kind, noise, args, args.out))
            except ConfigError as err:  # the algorithm refuses this kind of privacy
                print(f"{algorithm} {kind}: refused: {err}", flush=True)
                continue
            (args.out / "dp_cost.json").write_text(json.dumps(cells, indent=1) + "\n")
            (args.out / "dp_cost.md").write_text(table(cells, args, int(base["num-server-rounds"])))
            print(f"{algorithm} {cells[-1]['dp']}: {cells[-1]['mean']:.4f} +- {cells[-1]['std']:.4f}", flush=True)


if __name__ == "__main__":
    main()
