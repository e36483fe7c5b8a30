"""How far apart can FedDAR-SA and Separate FedAvg end on Fig. 1's problem? The least-squares floors.

Once training has converged, what separates the two methods on a noise-free test set is only the
estimation error the sigma = 1e-3 training noise leaves in their parameters:

* Separate FedAvg fits one d-dimensional linear model per domain from that domain's N_m
  training samples: ordinary least squares, test excess sigma^2 d / (N_m - d - 1) for Gaussian
  inputs.
* FedDAR-SA fits the shared representation B (d x k, from all N samples) and a k-dimensional
  head per domain (from N_m samples): about sigma^2 (k / N_m + d k / N) (parameter counting).

Their ratio, d M / (k (M + d)) with N = M N_m, is 2 for the paper's d = 20, k = 2, M = 5, at
every L: a converged Separate FedAvg cannot be orders of magnitude worse than a converged SA.

This script computes both floors on the app's own data (the same pool, partition and splits as
``feddar-fig1 --scale paper``, noise-free test targets): the per-domain least-squares fit, and the
shared-representation least-squares fit (alternating least squares on all clients' training
samples, started from the SVD of the per-domain fits), each evaluated on every client's test
split (client-weighted mean, as the app's ``loss_wmean``). It prints them beside the formulas and
beside the app runs' final MSE where ``docs/reproduce/results/feddar-fig1/paper`` has them.

    python simulations/feddar_floor.py --seeds 0 1 2 --out docs/reproduce/feddar_floor.json
"""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

import numpy as np

from flwr_pfl.data import DataConfig, load_client_data
from flwr_pfl.data.synthetic.feddar import register_feddar_synthetic

PRESET = Path("flwr_pfl/presets/feddar_synthetic.toml")
RESULTS = Path("docs/reproduce/results/feddar-fig1/paper")
COLUMNS = {10: "noise-free_test_the_paper_s", 5: "noise-free_test_L_=_5"}  # the driver's folder names
METHODS = {"FedDAR-SA": "FedDAR-SA", "Separate FedAvg": "Separate_FedAvg"}
SIGMA2, D, K = 1e-6, 20, 2


def pooled_data(seed: int, train_per_client: int, clients: int) -> dict[str, np.ndarray]:
    """Every client's training and noise-free test samples, with domains and client ids."""
    register_feddar_synthetic()
    run_config = tomllib.loads(PRESET.read_text())
    run_config |= {"samples-per-client": 2 * train_per_client, "noise-free-test": True, "seed": seed}
    config = DataConfig.from_run_config(run_config)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("x", "y", "z", "tx", "ty", "tz", "tc")}
    for c in range(clients):
        data = load_client_data(config, c, clients)
        parts["x"].append(data.train.x.double().numpy())
        parts["y"].append(data.train.y.double().numpy())
        parts["z"].append(data.train.domain.numpy())
        parts["tx"].append(data.test.x.double().numpy())
        parts["ty"].append(data.test.y.double().numpy())
        parts["tz"].append(data.test.domain.numpy())
        parts["tc"].append(np.full(len(data.test), c))
    return {k: np.concatenate(v) for k, v in parts.items()}


def client_weighted_mse(pred: np.ndarray, data: dict[str, np.ndarray]) -> float:
    """Mean squared error over all test samples (each client weighted by its test size)."""
    return float(np.mean((pred - data["ty"]) ** 2))


def separate_fit(data: dict[str, np.ndarray], domains: int) -> np.ndarray:
    """Per-domain least squares: one d-vector per domain (rows), from that domain's samples."""
    return np.stack([
        np.linalg.lstsq(data["x"][data["z"] == m], data["y"][data["z"] == m], rcond=None)[0]
        for m in range(domains)
    ])


def shared_fit(data: dict[str, np.ndarray], domains: int, iterations: int = 500) -> np.ndarray:
    """Shared-representation least squares, y ~ w_z^T B^T x with B d x k, by alternating exact
    solves (heads per domain, then B from all samples); returns the d-vectors B w_m (rows)."""
    x, y, z = data["x"], data["y"], data["z"]
    u, _, _ = np.linalg.svd(separate_fit(data, domains).T, full_matrices=False)
    rep = u[:, :K]
    for _ in range(iterations):
        features = x @ rep
        heads = np.stack([
            np.linalg.lstsq(features[z == m], y[z == m], rcond=None)[0] for m in range(domains)
        ])
        design = (x[:, :, None] * heads[z][:, None, :]).reshape(len(x), -1)  # vec(B) regression
        rep = np.linalg.lstsq(design, y, rcond=None)[0].reshape(D, K)
    features = x @ rep
    heads = np.stack([np.linalg.lstsq(features[z == m], y[z == m], rcond=None)[0] for m in range(domains)])
    return heads @ rep.T


def app_final(column: str, method: str, seed: int) -> float | None:
    """The app run's figure (mean of its last 3 evaluations), if the run file exists."""
    path = RESULTS / COLUMNS[int(column)] / f"{METHODS[method]}-s{seed}.json"
    if not path.exists():
        return None
    rows = [r["loss_wmean"] for r in json.loads(path.read_text())["rows"] if "loss_wmean" in r]
    return float(np.mean(rows[-3:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--train-per-client", type=int, nargs="+", default=[10, 5])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for L in args.train_per_client:
        for seed in args.seeds:
            data = pooled_data(seed, L, args.clients)
            domains = int(data["z"].max()) + 1
            sizes = np.bincount(data["z"], minlength=domains)
            separate = client_weighted_mse(np.einsum("nd,nd->n", data["tx"], separate_fit(data, domains)[data["tz"]]), data)
            shared = client_weighted_mse(np.einsum("nd,nd->n", data["tx"], shared_fit(data, domains)[data["tz"]]), data)
            rows.append({
                "L": L, "seed": seed, "domain_sizes": sizes.tolist(),
                "separate_lstsq": separate, "shared_lstsq": shared,
                "separate_formula": float(np.mean(SIGMA2 * D / (sizes - D - 1))),
                "shared_formula": float(np.mean(SIGMA2 * (K / sizes + D * K / sizes.sum()))),
                "app_sa": app_final(str(L), "FedDAR-SA", seed),
                "app_separate": app_final(str(L), "Separate FedAvg", seed),
            })
    print("| L | seed | N_m | separate LS (formula) | shared LS (formula) | ratio | app SA | app Separate FedAvg |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        app = [f"{v:.1e}" if v is not None else "-" for v in (r["app_sa"], r["app_separate"])]
        print(f"| {r['L']} | {r['seed']} | {min(r['domain_sizes'])}-{max(r['domain_sizes'])} "
              f"| {r['separate_lstsq']:.1e} ({r['separate_formula']:.1e}) "
              f"| {r['shared_lstsq']:.1e} ({r['shared_formula']:.1e}) "
              f"| {r['separate_lstsq'] / r['shared_lstsq']:.1f} | {app[0]} | {app[1]} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
