"""Server time per round of FEDORA against FedAvg as the number of clients K grows.

Times the server step alone, on the arrays the Flower layer hands it (no clients, no wire):

* FedAvg: the sample-weighted average of K uploaded models (``core.aggregation.weighted_average``);
* FEDORA, per round: the K uploads flattened into the ``K x P`` buffer and Eq. 6,
  ``Theta_hat = M Theta`` as one GEMM into the ``theta_hat`` buffer (``core.fedora.server_update``):
  O(K^2 P);
* FEDORA, once: the similarity of K subspaces, the graph and ``M = (1 - kappa)(I - kappa P)^-1``
  by one LU solve (``core.fedora.build_propagation_graph``): O(K^2 d p^2 + K^3).

    python simulations/fedora_server_scaling.py --clients 10 100 1000 --params 10000 \\
        --out docs/benchmark/fedora

``--threads`` is ``torch.set_num_threads``; FEDORA's propagation GEMM runs in torch, so it is the
thread count of the timed round (NumPy's own BLAS pool does not take part in it).

Writes ``<out>/server_scaling.json`` and ``<out>/server_scaling.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from bench_common import best_of
from flwr_pfl.core import fedora as core
from flwr_pfl.core.aggregation import weighted_average


def measure(k: int, p: int, d: int, repeats: int, seed: int = 0) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    shapes = [(p // 10 - 1, 10), (10,)]  # a softmax-regression-like model with P = p values
    layout = core.ParameterLayout.from_arrays([np.zeros(s, np.float32) for s in shapes])
    uploads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(k)]
    counts = [128] * k
    subspaces = [np.linalg.qr(rng.standard_normal((d, 1)))[0] for _ in range(k)]
    cfg = core.FedoraConfig()
    t_setup = best_of(lambda: core.build_propagation_graph(subspaces, cfg.graph, cfg.propagation), 1)
    graph = core.build_propagation_graph(subspaces, cfg.graph, cfg.propagation)
    theta, theta_hat = core.init_server_buffers(layout.flatten(uploads[0]), k)

    def fedora_round() -> None:
        flat = {i: layout.flatten(a) for i, a in enumerate(uploads)}
        core.server_update(theta, theta_hat, flat, graph, cfg.propagation)

    t_fedavg = best_of(lambda: weighted_average(uploads, counts), repeats)
    t_fedora = best_of(fedora_round, repeats)
    return {"clients": k, "params": layout.size, "fedavg_s": t_fedavg, "fedora_round_s": t_fedora,
            "fedora_setup_s": t_setup, "server_state_mb": (theta.nbytes + theta_hat.nbytes) / 2**20,
            "kxk_mb": 4 * graph.propagation.nbytes / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--params", type=int, default=10_000)
    parser.add_argument("--dim", type=int, default=794, help="subspace dimension d_x + C")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (FEDORA's GEMM runs in torch)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmark/fedora"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(k, args.params, args.dim, args.repeats) for k in args.clients]
    for r in rows:
        print(json.dumps(r))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "server_scaling.json").write_text(json.dumps(rows, indent=1))
    lines = ["| K | P | FedAvg (ms) | FEDORA round (ms) | ratio | FEDORA setup, once (ms) | K x P buffers (MB) | K x K matrices (MB) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['clients']} | {r['params']} | {1e3 * r['fedavg_s']:.2f} | {1e3 * r['fedora_round_s']:.2f} | "
                     f"{r['fedora_round_s'] / r['fedavg_s']:.1f} | {1e3 * r['fedora_setup_s']:.1f} | "
                     f"{r['server_state_mb']:.1f} | {r['kxk_mb']:.1f} |")
    (args.out / "server_scaling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
