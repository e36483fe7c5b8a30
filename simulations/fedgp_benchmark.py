"""The suite's benchmark (``simulations/benchmark.py``) with FedGP / FedDA variants in it.

The benchmark's workload has no target and no algorithm options; FedGP and FedDA run there with
their defaults (the last client is the target; 2 warm-up rounds). This wrapper adds variants named
``<algorithm>-auto`` (``auto-weight = true``) and ``<algorithm>-nowarmup`` (``warmup-rounds = 0``,
so every round is an FDA round and the projection's cost shows in every round) and
``<algorithm>-auto-target`` (auto-weighting with ``placement = "target"``: every FDA round takes
two server rounds, so the variant runs 2 x ``--rounds`` server rounds and its figures are still
per FDA round), and otherwise runs the benchmark unchanged:

    python simulations/fedgp_benchmark.py --data-dir ~/.cache/flwr_pfl/data \\
        --algorithms fedavg fedgp-nowarmup fedgp-auto fedgp-auto-target fedda-nowarmup fedda-auto \\
        --out docs/benchmark/fedgp
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchmark  # noqa: E402

_workload = benchmark.workload

VARIANTS = {
    "auto": {"auto-weight": True, "warmup-rounds": 0, "target-batch-size": 8},
    "nowarmup": {"warmup-rounds": 0},
    "auto-target": {"auto-weight": True, "warmup-rounds": 0, "target-batch-size": 8, "placement": "target"},
}


def workload(args, algorithm: str):
    base, _, variant = algorithm.partition("-")
    if base not in ("fedgp", "fedda") or variant not in VARIANTS:
        return _workload(args, algorithm)
    config = _workload(args, base)
    config["run-name"] = algorithm
    config |= {f"{base}.{k}": v for k, v in VARIANTS[variant].items()}
    if VARIANTS[variant].get("placement") == "target":
        config["num-server-rounds"] = 2 * args.rounds  # two server rounds per FDA round
    return config


benchmark.workload = workload

if __name__ == "__main__":
    benchmark.main()
