"""Synthetic problems for checking pFedFDA's mathematics (the paper itself has none).

* :func:`shifted_gaussian_client`: one client whose class-conditional features are Gaussians
  shifted away from the global ones, for beta selection (Eq. 9): with no shift the global
  statistics should win (beta near 0), with a large shift and many samples the local ones
  (beta near 1).
* :func:`bias_variance_problem` and :func:`sample_client_means`: the setting of Theorem 1
  (App. E): M clients with z ~ N(theta_i, Sigma_i) and n_i samples each.
* :func:`affine_shift_federation`: a small federation of raw inputs (class Gaussians in R^m),
  Dirichlet label skew, and a per-client affine covariate shift x -> A_i x + b_i on half the
  clients, for end-to-end runs of the whole algorithm.

All generators are seeded and return NumPy arrays (features float32, labels int64).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class ShiftedGaussianClient:
    """One client's features under a known global Gaussian model.

    Attributes:
        global_means: mu_g (C, d); global_cov: Sigma_g = I (d, d).
        client_means: mu_i^c = mu_g^c + shift * u_c with random unit vectors u_c (C, d).
        train_features, train_labels: n_per_class rows per class, (C n, d) and (C n,).
        test_features, test_labels: n_test_per_class rows per class.
    """

    global_means: np.ndarray
    global_cov: np.ndarray
    client_means: np.ndarray
    train_features: np.ndarray
    train_labels: np.ndarray
    test_features: np.ndarray
    test_labels: np.ndarray


def shifted_gaussian_client(
    n_per_class: int,
    shift: float,
    *,
    num_classes: int = 4,
    dim: int = 16,
    global_scale: float = 0.35,
    n_test_per_class: int = 1000,
    seed: int = 0,
) -> ShiftedGaussianClient:
    """A client whose class means are the global ones moved by ``shift`` in random directions.

    mu_g^c ~ N(0, global_scale^2 I), Sigma_g = I, mu_i^c = mu_g^c + shift u_c with u_c uniform on
    the unit sphere, features z ~ N(mu_i^y, I), balanced classes (uniform priors).

    Args:
        n_per_class: training rows per class, >= 1.
        shift: delta >= 0, the distance between each local and global class mean.
        num_classes: C; dim: d; global_scale: spread of the global means.
        n_test_per_class: test rows per class. seed: the NumPy seed.
    """
    if n_per_class < 1 or n_test_per_class < 1:
        raise ValueError(f"need at least one row per class, got {n_per_class} train and {n_test_per_class} test")
    if shift < 0:
        raise ValueError(f"shift must be >= 0, got {shift}")
    rng = np.random.default_rng(seed)
    global_means = global_scale * rng.standard_normal((num_classes, dim))
    directions = rng.standard_normal((num_classes, dim))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    client_means = global_means + shift * directions

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = np.repeat(np.arange(num_classes), n)
        features = client_means[labels] + rng.standard_normal((labels.size, dim))
        return features.astype(np.float32), labels.astype(np.int64)

    train_features, train_labels = draw(n_per_class)
    test_features, test_labels = draw(n_test_per_class)
    return ShiftedGaussianClient(
        global_means=global_means.astype(np.float32),
        global_cov=np.eye(dim, dtype=np.float32),
        client_means=client_means.astype(np.float32),
        train_features=train_features,
        train_labels=train_labels,
        test_features=test_features,
        test_labels=test_labels,
    )


@dataclass(frozen=True, eq=False)
class BiasVarianceProblem:
    """Theorem 1's setting: client i has n_i samples of z ~ N(theta_i, diag(variances_i)).

    Attributes:
        means: theta (M, d); variances: diagonal of each Sigma_i (M, d); counts: n_i (M,).
    """

    means: np.ndarray
    variances: np.ndarray
    counts: np.ndarray

    @property
    def cov_traces(self) -> np.ndarray:
        """Tr(Sigma_i) per client, shape (M,)."""
        return self.variances.sum(axis=1)


def bias_variance_problem(
    counts: tuple[int, ...] = (5, 20, 50, 100),
    dim: int = 5,
    *,
    var_low: float = 0.5,
    var_high: float = 2.0,
    seed: int = 1,
) -> BiasVarianceProblem:
    """theta_i ~ N(0, I_d) and Sigma_i diagonal with entries U(var_low, var_high), seeded."""
    if any(n < 1 for n in counts):
        raise ValueError(f"counts must be >= 1, got {counts}")
    rng = np.random.default_rng(seed)
    means = rng.standard_normal((len(counts), dim))
    variances = rng.uniform(var_low, var_high, size=(len(counts), dim))
    return BiasVarianceProblem(means=means, variances=variances, counts=np.asarray(counts, dtype=np.int64))


def sample_client_means(
    problem: BiasVarianceProblem, repetitions: int, *, seed: int = 0, chunk: int = 2000
) -> np.ndarray:
    """Sample means of every client over independent repetitions, shape (M, repetitions, d).

    Each repetition draws n_i raw samples z ~ N(theta_i, Sigma_i) per client and averages them
    (drawn in chunks of repetitions to bound memory). float64.
    """
    rng = np.random.default_rng(seed)
    num_clients, dim = problem.means.shape
    out = np.empty((num_clients, repetitions, dim))
    for start in range(0, repetitions, chunk):
        stop = min(start + chunk, repetitions)
        for i in range(num_clients):
            noise = rng.standard_normal((stop - start, int(problem.counts[i]), dim)) * np.sqrt(problem.variances[i])
            out[i, start:stop] = problem.means[i] + noise.mean(axis=1)
    return out


@dataclass(frozen=True, eq=False)
class FederatedSplits:
    """Per-client train/test arrays of a synthetic federation.

    Attributes:
        train_x, train_y, test_x, test_y: one array per client (inputs float32 (n, m),
            labels int64 (n,)).
        shifted: whether each client applies a non-identity affine shift, (M,) bool.
        num_classes: C.
    """

    train_x: list[np.ndarray]
    train_y: list[np.ndarray]
    test_x: list[np.ndarray]
    test_y: list[np.ndarray]
    shifted: np.ndarray
    num_classes: int


def affine_shift_federation(
    *,
    num_clients: int = 10,
    num_classes: int = 4,
    input_dim: int = 20,
    samples_per_client: int = 60,
    alpha: float = 0.5,
    class_separation: float = 1.5,
    shift_scale: float = 2.0,
    train_fraction: float = 0.8,
    seed: int = 0,
    shifted_clients: tuple[int, ...] | None = None,
) -> FederatedSplits:
    """A federation with label skew and covariate shift on raw inputs.

    Inputs come from class Gaussians x ~ N(m_y, I_m) with m_y ~ N(0, class_separation^2 I / m);
    each client draws its label distribution from Dir(alpha) (classes may be absent or tiny on
    a client, as under the paper's Dirichlet partitions), and the odd-numbered clients apply
    their own affine map x -> A_i x + b_i with A_i = I + shift_scale G / sqrt(m) and
    b_i ~ N(0, shift_scale^2 I) (even clients keep the identity). Each client's rows are split
    ``train_fraction`` / rest into train / test after shuffling.

    The defaults (48 training rows per client, shift_scale 2) are the setting of the spec's
    tiny end-to-end check (T7): M = 10, C = 4, m = 20, Dir(0.5). ``shifted_clients`` names the
    shifted clients instead (e.g. a minority, as when most clients share the clean domain).
    """
    if not 0 < train_fraction < 1:
        raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
    rng = np.random.default_rng(seed)
    class_means = class_separation * rng.standard_normal((num_classes, input_dim)) / np.sqrt(input_dim)
    if shifted_clients is None:
        shifted = np.arange(num_clients) % 2 == 1
    else:
        if any(not 0 <= i < num_clients for i in shifted_clients):
            raise ValueError(f"shifted_clients must lie in [0, {num_clients}), got {shifted_clients}")
        shifted = np.isin(np.arange(num_clients), shifted_clients)
    out: dict[str, list[np.ndarray]] = {"train_x": [], "train_y": [], "test_x": [], "test_y": []}
    for i in range(num_clients):
        proportions = rng.dirichlet(alpha * np.ones(num_classes))
        labels = rng.choice(num_classes, size=samples_per_client, p=proportions)
        x = class_means[labels] + rng.standard_normal((samples_per_client, input_dim))
        if shifted[i]:
            a = np.eye(input_dim) + shift_scale * rng.standard_normal((input_dim, input_dim)) / np.sqrt(input_dim)
            b = shift_scale * rng.standard_normal(input_dim)
            x = x @ a.T + b
        order = rng.permutation(samples_per_client)
        n_train = int(round(train_fraction * samples_per_client))
        train, test = order[:n_train], order[n_train:]
        out["train_x"].append(x[train].astype(np.float32))
        out["train_y"].append(labels[train].astype(np.int64))
        out["test_x"].append(x[test].astype(np.float32))
        out["test_y"].append(labels[test].astype(np.int64))
    return FederatedSplits(shifted=shifted, num_classes=num_classes, **out)
