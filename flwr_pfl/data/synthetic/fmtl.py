"""Synthetic linear FMTL problem with controllable feature heterogeneity (FMTL spec, Sec. 7).

The paper (Liu, Yang, Shen, ISIT 2023) has no synthetic experiment; this generator matches its
assumptions: a known representation (B = I, so x = z), M linear tasks y = z^T w_c* + eps, and
N clients each performing m distinct tasks.

* Heterogeneous features (``FeatureModel.HETEROGENEOUS``): for task c, z = s e_c + tau g with
  s ~ N(0, 1), g ~ N(0, I_k) and w_c* = e_c. Then Lambda^c = e_c e_c^T + tau^2 I and
  Delta = E[(z^T w_c*)^2] = tau^2 for z of another task (Assumptions 4 and 5 hold).
* Homogeneous features (``FeatureModel.HOMOGENEOUS``): z ~ N(0, I_k) for every task, and w_c* are
  the first M columns of a random orthogonal matrix; Lambda = I and Delta = 1.

Task assignment: the list [0..M-1] repeated N m / M times is shuffled and reshaped to (N, m),
redrawn until every row has distinct tasks, so every task has exactly N m / M holders.

Random draws, in order, from ``numpy.random.default_rng(seed)``: the heads (homogeneous only),
the task assignment, then per client and per task (row order) the features, then the noise.

``python -m flwr_pfl.data.synthetic.fmtl`` prints the table of
docs/fmtl-when-augmentation-helps.md.
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flwr_pfl.core.fmtl import (
    Augmentation,
    HeadWeighting,
    TaskStatistics,
    excess_risk,
    head_weight_matrix,
    linear_closed_form,
    task_statistics,
)

__all__ = [
    "FeatureModel",
    "LinearFMTLConfig",
    "LinearFMTLProblem",
    "LinearEstimator",
    "ESTIMATORS",
    "assign_tasks",
    "make_linear_fmtl",
    "client_statistics",
    "estimate_heads",
    "run_linear_experiment",
]


class FeatureModel(enum.StrEnum):
    """How features are distributed across tasks (see the module docstring)."""

    HETEROGENEOUS = "heterogeneous"
    HOMOGENEOUS = "homogeneous"


@dataclass(frozen=True)
class LinearFMTLConfig:
    """Size and heterogeneity of the synthetic problem (defaults: the spec's Sec. 7 setting).

    Attributes:
        num_clients: N (default 20).
        num_tasks: M (default 10); must be <= dim.
        tasks_per_client: m distinct tasks per client (default 2); N m must be a multiple of M.
        dim: k (default 10).
        samples_per_task: n_i^c for every held (client, task) (default 20).
        noise_std: sigma of the label noise (default 1).
        tau: feature spread of the heterogeneous model (Delta = tau^2; default 0.1).
        features: heterogeneous (default) or homogeneous.
    """

    num_clients: int = 20
    num_tasks: int = 10
    tasks_per_client: int = 2
    dim: int = 10
    samples_per_task: int = 20
    noise_std: float = 1.0
    tau: float = 0.1
    features: FeatureModel = FeatureModel.HETEROGENEOUS

    def __post_init__(self) -> None:
        for name in ("num_clients", "num_tasks", "tasks_per_client", "dim", "samples_per_task"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LinearFMTLConfig.{name} must be an integer >= 1, got {value!r}")
        if self.tasks_per_client > self.num_tasks:
            raise ValueError("tasks_per_client must be <= num_tasks")
        if (self.num_clients * self.tasks_per_client) % self.num_tasks:
            raise ValueError("num_clients * tasks_per_client must be a multiple of num_tasks")
        if self.num_tasks > self.dim:
            raise ValueError("num_tasks must be <= dim (one orthogonal head per task)")
        if not (np.isfinite(self.tau) and self.tau >= 0):
            raise ValueError(f"tau must be a finite number >= 0, got {self.tau}")
        if not (np.isfinite(self.noise_std) and self.noise_std >= 0):
            raise ValueError(f"noise_std must be a finite number >= 0, got {self.noise_std}")
        object.__setattr__(self, "features", FeatureModel(self.features))


@dataclass(frozen=True)
class LinearFMTLProblem:
    """One draw of the synthetic problem.

    Attributes:
        features: N arrays (n_i, k), client i's features z (task-major within the client).
        targets: N arrays (n_i,), labels y.
        task_ids: N arrays (n_i,), task of each sample.
        assignment: (N, m) tasks of each client.
        true_heads: (M, k) w_c*.
        test_second_moments: (M, k, k) Lambda_bar^c (= Lambda^c here).
    """

    features: tuple[np.ndarray, ...]
    targets: tuple[np.ndarray, ...]
    task_ids: tuple[np.ndarray, ...]
    assignment: np.ndarray
    true_heads: np.ndarray
    test_second_moments: np.ndarray

    @property
    def num_tasks(self) -> int:
        """M."""
        return int(self.true_heads.shape[0])

    @property
    def membership(self) -> np.ndarray:
        """(N, M) bool holder mask."""
        mask = np.zeros((self.assignment.shape[0], self.num_tasks), dtype=bool)
        np.put_along_axis(mask, self.assignment, True, axis=1)
        return mask


def assign_tasks(
    num_clients: int, num_tasks: int, tasks_per_client: int, rng: np.random.Generator,
    max_draws: int = 10_000,
) -> np.ndarray:
    """Shuffle-and-reshape task assignment with distinct tasks per client.

    Returns:
        (N, m) int64; every task appears N m / M times.
    """
    if (num_clients * tasks_per_client) % num_tasks:
        raise ValueError("num_clients * tasks_per_client must be a multiple of num_tasks")
    pool = np.repeat(np.arange(num_tasks), num_clients * tasks_per_client // num_tasks)
    for _ in range(max_draws):
        rows = rng.permutation(pool).reshape(num_clients, tasks_per_client)
        srt = np.sort(rows, axis=1)
        if np.all(np.diff(srt, axis=1) > 0):
            return rows.astype(np.int64)
    raise ValueError(f"no assignment with distinct tasks per client found in {max_draws} draws")


def make_linear_fmtl(config: LinearFMTLConfig, seed: int) -> LinearFMTLProblem:
    """Draw one synthetic problem (see the module docstring for the model and the draw order)."""
    rng = np.random.default_rng(seed)
    k, m_tasks = config.dim, config.num_tasks
    if config.features is FeatureModel.HOMOGENEOUS:
        q, _ = np.linalg.qr(rng.standard_normal((k, k)))
        heads = q[:, :m_tasks].T.copy()
        test = np.repeat(np.eye(k)[None], m_tasks, axis=0)
    else:
        heads = np.eye(k)[:m_tasks].copy()
        test = heads[:, :, None] * heads[:, None, :] + config.tau**2 * np.eye(k)[None]
    assignment = assign_tasks(config.num_clients, m_tasks, config.tasks_per_client, rng)
    n_c = config.samples_per_task
    feats, ys, ids = [], [], []
    for row in assignment:
        blocks = []
        for c in row:
            if config.features is FeatureModel.HOMOGENEOUS:
                blocks.append(rng.standard_normal((n_c, k)))
            else:
                s = rng.standard_normal(n_c)
                g = rng.standard_normal((n_c, k))
                blocks.append(s[:, None] * heads[c][None, :] + config.tau * g)
        z = np.concatenate(blocks)
        t = np.repeat(row, n_c)
        y = np.einsum("nk,nk->n", z, heads[t]) + config.noise_std * rng.standard_normal(z.shape[0])
        feats.append(z)
        ys.append(y)
        ids.append(t)
    return LinearFMTLProblem(tuple(feats), tuple(ys), tuple(ids), assignment, heads, test)


@dataclass(frozen=True)
class LinearEstimator:
    """A linear FMTL estimator: which datasets, and which client weights per head."""

    augmentation: Augmentation
    weighting: HeadWeighting


#: The spec's three estimators: ``orig`` = ERM (3) on the holders' original data (pooled least
#: squares when all n_i^c are equal), ``aug_uniform`` = (5) with beta = 1/N, ``aug_eq12`` = (5)
#: with eq. (12) weights.
ESTIMATORS: dict[str, LinearEstimator] = {
    "orig": LinearEstimator(Augmentation.ORIGINAL, HeadWeighting.EW_HOLDERS),
    "aug_uniform": LinearEstimator(Augmentation.AUGMENTED, HeadWeighting.UNIFORM),
    "aug_eq12": LinearEstimator(Augmentation.AUGMENTED, HeadWeighting.FMTL_EQ12),
}


def client_statistics(problem: LinearFMTLProblem) -> list[TaskStatistics]:
    """Every client's :class:`TaskStatistics` (with cross moments), as the clients would send them."""
    return [
        task_statistics(z, t, problem.num_tasks, targets=y)
        for z, y, t in zip(problem.features, problem.targets, problem.task_ids)
    ]


def estimate_heads(
    problem: LinearFMTLProblem, estimator: LinearEstimator,
    statistics: Sequence[TaskStatistics] | None = None,
) -> np.ndarray:
    """Closed-form heads (M, k) of one estimator, through the client statistics path.

    ``statistics`` (from :func:`client_statistics`) can be passed to reuse them across estimators.
    """
    stats = client_statistics(problem) if statistics is None else statistics
    beta = head_weight_matrix(problem.membership, estimator.weighting)
    return linear_closed_form(stats, beta, augmentation=estimator.augmentation)


def run_linear_experiment(
    config: LinearFMTLConfig, seeds: Sequence[int],
    estimators: dict[str, LinearEstimator] | None = None,
) -> dict[str, tuple[float, float]]:
    """Mean and standard error over ``seeds`` of each estimator's excess risk (eq. 6, alpha = 1/M).

    Returns:
        {estimator name: (mean, standard error)}.
    """
    estimators = ESTIMATORS if estimators is None else estimators
    risks: dict[str, list[float]] = {name: [] for name in estimators}
    for seed in seeds:
        problem = make_linear_fmtl(config, seed)
        stats = client_statistics(problem)
        for name, est in estimators.items():
            w = estimate_heads(problem, est, stats)
            risks[name].append(excess_risk(w, problem.true_heads, problem.test_second_moments))
    out = {}
    for name, values in risks.items():
        arr = np.asarray(values)
        se = float(arr.std(ddof=1) / np.sqrt(arr.size)) if arr.size > 1 else float("nan")
        out[name] = (float(arr.mean()), se)
    return out


def _main() -> None:
    parser = argparse.ArgumentParser(description="Synthetic linear FMTL: excess risk per estimator")
    parser.add_argument("--seeds", type=int, default=200, help="number of seeds (0..seeds-1)")
    args = parser.parse_args()
    seeds = range(args.seeds)
    settings: list[tuple[str, LinearFMTLConfig]] = [
        (f"m=2 heterogeneous tau={tau}", LinearFMTLConfig(tau=tau))
        for tau in (0.0316, 0.1, 0.3, 0.5, 1.0)
    ]
    settings.append(("m=2 homogeneous", LinearFMTLConfig(features=FeatureModel.HOMOGENEOUS)))
    settings += [
        (f"m=1 heterogeneous tau={tau}", LinearFMTLConfig(tau=tau, tasks_per_client=1, samples_per_task=40))
        for tau in (0.1, 0.3)
    ]
    print(f"| setting | orig | aug_uniform | aug_eq12 |  ({args.seeds} seeds, mean ± s.e.)")
    print("|---|---|---|---|")
    for label, cfg in settings:
        res = run_linear_experiment(cfg, seeds)
        cells = " | ".join(f"{res[n][0]:.4f} ± {res[n][1]:.4f}" for n in ("orig", "aug_uniform", "aug_eq12"))
        print(f"| {label} | {cells} |")


if __name__ == "__main__":
    _main()
