"""The suite's benchmark (``simulations/benchmark.py``) with FedGP / FedDA variants in it.

The benchmark's workload has no target and no algorithm options; FedGP and FedDA run there with
their defaults (the last client is the target; 2 warm-up rounds). This wrapper adds variants named
``<algorithm>-auto`` (``auto-weight = true``) and ``<algorithm>-nowarmup`` (``warmup-rounds = 0``,
so every round is an FDA round and the projection's cost shows in every round), and otherwise
runs the benchmark unchanged:

    python simulations/fedgp_benchmark.py --data-dir ~/.cache/flwr_pfl/data \\
        --algorithms fedavg fedgp-nowarmup fedgp-auto fedda-nowarmup fedda-auto --out docs/benchmark/fedgp
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
}


def workload(args, algorithm: str):
    base, _, variant = algorithm.partition("-")
    if base not in ("fedgp", "fedda") or variant not in VARIANTS:
        return _workload(args, algorithm)
    config = _workload(args, base)
    config["run-name"] = algorithm
    config |= {f"{base}.{k}": v for k, v in VARIANTS[variant].items()}
    return config


benchmark.workload = workload

if __name__ == "__main__":
    benchmark.main()
