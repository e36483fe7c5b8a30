"""The synthetic RBF regression problem of FedGP's App. B, and its reference simulation.

Jiang, Zhang, Koyejo (ICLR 2024), App. B: one source domain and one target domain share the
inputs x (concept shift): the labelling function is a sum of radial basis functions whose centres
and widths move with a shift level s. A one-hidden-layer sigmoid network is trained for 300
full-batch steps with the target gradient, the source gradient, or an FDA combination of the two;
the metric is the target test MSE.

The generating process follows the official code where it and the paper's text differ (the
code produced Figure 5): phi_k(x) = exp(-||x - mu_k||^2 / sigma2_k) with sigma2_k = 100 U(0,1),
y = A phi(x) + b with A, b ~ U(-0.5, 0.5), shifted domains mu + U(0,1) s and
sigma2 + 100 U(0,1) s with fresh draws for every s, the same X for every domain, and the source
dataset being the s = 0 one. The released datasets carry no seed, so data are regenerated here
from a seed; every random stream is derived from (seed, purpose), so a reduced grid gives the
same datasets as the full one.

Shapes: x (5000, 50), y (5000, 10); network W1 (100, 50), b1 (100,), W2 (10, 100), b2 (10,)
(m = 6110 parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flwr_pfl.core.fedgp import (
    FDAConfig,
    FDAStats,
    Projection,
    Rule,
    estimate_fda_stats,
    fda_aggregate,
)

NUM_SAMPLES = 5000
INPUT_DIM = 50
NUM_CLUSTERS = 10
NUM_RBF = 100
OUTPUT_DIM = 10
HIDDEN_DIM = 100

_STREAM_BASE, _STREAM_SHIFT, _STREAM_SPLIT, _STREAM_INIT, _STREAM_BATCHES = range(5)


def shift_grid() -> np.ndarray:
    """The 15 shift levels s = 0, 0.07, ..., 0.98 of the official code."""
    return np.round(np.arange(15) * 0.07, 2)


def target_ratio_grid() -> np.ndarray:
    """The 9 target ratios r = exp(arange(ln 0.003, ln 0.5, (ln 0.4 - ln 0.001) / 10)) of the
    official code: 0.003 ... 0.3621 (n_T = 14, 27, 49, 90, 164, 299, 546, 994, 1810)."""
    return np.exp(np.arange(np.log(0.003), np.log(0.5), (np.log(0.4) - np.log(0.001)) / 10))


def num_target_samples(ratio: float, num_samples: int = NUM_SAMPLES) -> int:
    """int(num_samples * ratio), as the code truncates (int(5000 * 0.003) = 14)."""
    if not (0.0 < ratio < 1.0):
        raise ValueError(f"ratio must lie in (0, 1); got {ratio}")
    return int(num_samples * ratio)


@dataclass(frozen=True)
class RBFProblem:
    """Inputs and the base (s = 0) labelling function.

    Attributes:
        seed: the seed everything was drawn from.
        x: inputs (N, 50), a mixture of 10 unit-covariance Gaussians, 500 consecutive samples
            per centre; centres ~ U(-0.5, 0.5)^50.
        rbf_means: mu (50, 100) ~ U(-0.5, 0.5).
        rbf_widths: sigma2 (100,) = 100 U(0, 1).
        out_weight: A (10, 100) ~ U(-0.5, 0.5).
        out_bias: b (10,) ~ U(-0.5, 0.5).
    """

    seed: int
    x: np.ndarray
    rbf_means: np.ndarray
    rbf_widths: np.ndarray
    out_weight: np.ndarray
    out_bias: np.ndarray


def make_rbf_problem(seed: int, num_samples: int = NUM_SAMPLES) -> RBFProblem:
    """Draw the inputs and the base labelling function (App. B; official generator)."""
    if num_samples % NUM_CLUSTERS:
        raise ValueError(f"num_samples must be a multiple of {NUM_CLUSTERS}; got {num_samples}")
    rng = np.random.default_rng([seed, _STREAM_BASE])
    centres = rng.uniform(-0.5, 0.5, (NUM_CLUSTERS, INPUT_DIM))
    x = rng.standard_normal((num_samples, INPUT_DIM)) + np.repeat(centres, num_samples // NUM_CLUSTERS, axis=0)
    mu = rng.uniform(-0.5, 0.5, (INPUT_DIM, NUM_RBF))
    widths = 100.0 * rng.uniform(0.0, 1.0, NUM_RBF)
    a = rng.uniform(-0.5, 0.5, (OUTPUT_DIM, NUM_RBF))
    b = rng.uniform(-0.5, 0.5, OUTPUT_DIM)
    return RBFProblem(seed, x, mu, widths, a, b)


def rbf_labels(problem: RBFProblem, shift: float) -> np.ndarray:
    """Labels y (N, 10) of the domain at shift level ``shift`` >= 0.

    mu_s = mu + U(0,1)^(50x100) s, sigma2_s = sigma2 + 100 U(0,1)^100 s (fresh draws per s, keyed
    by (seed, s)); y = A phi_s(x) + b with phi_k(x) = exp(-||x - mu_s,k||^2 / sigma2_s,k).
    ``shift = 0`` is the base (source) labelling.
    """
    if not (0.0 <= shift < np.inf):
        raise ValueError(f"shift must be finite and >= 0; got {shift}")
    rng = np.random.default_rng([problem.seed, _STREAM_SHIFT, int(round(shift * 1_000_000))])
    mu = problem.rbf_means + rng.uniform(0.0, 1.0, problem.rbf_means.shape) * shift
    widths = problem.rbf_widths + 100.0 * rng.uniform(0.0, 1.0, problem.rbf_widths.shape) * shift
    x = problem.x
    sq = (x**2).sum(1)[:, None] - 2.0 * x @ mu + (mu**2).sum(0)[None, :]
    phi = np.exp(-np.maximum(sq, 0.0) / widths)
    return phi @ problem.out_weight.T + problem.out_bias


@dataclass(frozen=True)
class RBFCell:
    """One (shift, n_T) cell: source data (all N samples at s = 0), the target's training subset
    and the rest of the target domain as its test set."""

    shift: float
    x_source: np.ndarray
    y_source: np.ndarray
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def make_rbf_cell(problem: RBFProblem, shift: float, n_target: int, split_seed: int = 0) -> RBFCell:
    """Source = the s = 0 dataset; target training set = ``n_target`` random samples of the
    shift-s dataset (seeded, unlike the original code), target test set = the other ones."""
    n = problem.x.shape[0]
    if not (2 <= n_target < n):
        raise ValueError(f"n_target must lie in [2, {n - 1}]; got {n_target}")
    perm = np.random.default_rng([problem.seed, _STREAM_SPLIT, split_seed, n_target]).permutation(n)
    y_s, y_t = rbf_labels(problem, 0.0), rbf_labels(problem, shift)
    tr, te = perm[:n_target], perm[n_target:]
    return RBFCell(float(shift), problem.x, y_s, problem.x[tr], y_t[tr], problem.x[te], y_t[te])


# --------------------------------------------------------------------------------------------
# Reference simulation (App. B model and training)
# --------------------------------------------------------------------------------------------


def init_mlp(seed: int, dtype: np.dtype | type = np.float32) -> list[np.ndarray]:
    """[W1 (100, 50), b1 (100,), W2 (10, 100), b2 (10,)], every entry U(-0.5, 0.5)."""
    rng = np.random.default_rng([seed, _STREAM_INIT])
    shapes = [(HIDDEN_DIM, INPUT_DIM), (HIDDEN_DIM,), (OUTPUT_DIM, HIDDEN_DIM), (OUTPUT_DIM,)]
    return [rng.uniform(-0.5, 0.5, s).astype(dtype) for s in shapes]


def _t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a), dtype=dtype)


def mlp_mse(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """sum over outputs, mean over samples of (y - W2 sigmoid(W1 x + b1) - b2)^2."""
    w1, b1, w2, b2 = (_t(p, torch.float64) for p in params)
    h = torch.sigmoid(_t(x, torch.float64) @ w1.T + b1)
    r = h @ w2.T + b2 - _t(y, torch.float64)
    return float((r**2).sum() / x.shape[0])


def _backward(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sample pieces of the MSE gradient (loss = sum over outputs, mean over samples).

    params: W1 (100, 50), b1 (100,), W2 (10, 100), b2 (10,); x (n, 50), y (n, 10). Returns the
    hidden activations h (n, 100), dL/dz (n, 100) and dL/dyhat (n, 10), the last two including
    the 1/n of the mean. In-place where possible: this is the inner loop of the App. B runs.
    """
    w1, b1, w2, b2 = params
    h = torch.sigmoid_(torch.addmm(b1, x, w1.T))
    r = torch.addmm(b2, h, w2.T).sub_(y).mul_(2.0 / x.shape[0])
    dz = (r @ w2).mul_(h).mul_(1.0 - h)
    return h, dz, r


def _grads(params: list[torch.Tensor], x: torch.Tensor, x_t: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Full-batch gradient [dW1, db1, dW2, db2]; x_t = x.T contiguous (faster first-layer GEMM)."""
    h, dz, r = _backward(params, x, y)
    return [(x_t @ dz).T, dz.sum(0), r.T @ h, r.sum(0)]


def mlp_grads(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Full-batch gradient of :func:`mlp_mse`, one array per parameter (dtype of the params)."""
    dt = torch.float32 if params[0].dtype == np.float32 else torch.float64
    xt = _t(x, dt)
    return [g.numpy() for g in _grads([_t(p, dt) for p in params], xt, xt.T.contiguous(), _t(y, dt))]


def mlp_per_sample_grads(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Gradient of each sample's own loss, flattened in parameter order: (n, 6110), float64."""
    xt = _t(x, torch.float64)
    h, dz, r = _backward([_t(p, torch.float64) for p in params], xt, _t(y, torch.float64))
    n = x.shape[0]
    dz, r = dz * n, r * n  # undo the 1/n of the mean: each row is one sample's gradient
    g_w1 = (dz[:, :, None] * xt[:, None, :]).reshape(n, -1)
    g_w2 = (r[:, :, None] * h[:, None, :]).reshape(n, -1)
    return torch.cat([g_w1, dz, g_w2, r], dim=1).numpy()


def flat_grad(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """:func:`mlp_grads` flattened (6110,), float64."""
    grads = mlp_grads([p.astype(np.float64) for p in params], x, y)
    return np.concatenate([g.ravel() for g in grads])


def estimate_stats_at_init(params: list[np.ndarray], cell: RBFCell, seed: int, batch_size: int = 2) -> FDAStats:
    """Auto-weight statistics at the initial parameters (pi = point mass at init, App. A.5).

    As the official synthetic code: B = floor(n_T / batch_size) batches, each an independent
    random subset of ``batch_size`` target training samples (seeded here); g^j is the gradient on
    batch j, g_bar the gradient on the whole target training set, s the full source gradient.
    """
    n_t = cell.x_train.shape[0]
    b = n_t // batch_size
    if b < 2:
        raise ValueError(f"need at least 2 target batches; n_T = {n_t}, batch_size = {batch_size}")
    rng = np.random.default_rng([seed, _STREAM_BATCHES, n_t])
    per_sample = mlp_per_sample_grads(params, cell.x_train, cell.y_train)
    idx = np.stack([rng.choice(n_t, size=batch_size, replace=False) for _ in range(b)])
    g = per_sample[idx].mean(axis=1)
    g_bar = per_sample.mean(axis=0)
    s = flat_grad(params, cell.x_source, cell.y_source)
    return estimate_fda_stats(g, s[None, :], target_mean=g_bar)


def train_rbf(
    init: list[np.ndarray],
    cell: RBFCell,
    *,
    rule: Rule | str,
    beta: float,
    iterations: int = 300,
    lr: float = 0.2,
    momentum: float = 0.9,
) -> list[np.ndarray]:
    """Train the network from ``init`` on one cell with an FDA rule (App. B; official code).

    Per iteration: g_S on all source samples and g_T on the target training set, combined per
    tensor by :func:`flwr_pfl.core.fedgp.fda_aggregate` with the ``exact`` projection
    (Definition 4.3) for FedGP or the convex combination for FedDA; then the code's momentum
    form v <- momentum v + lr u, theta <- theta - lr v (effective step lr^2 = 0.04). The rules
    are odd and homogeneous, so passing gradients instead of updates is exact. ``rule="fedda",
    beta=1`` is Source Only (the target gradient is not computed), ``beta=0`` Target Only (the
    source gradient is not computed). Gradients are computed in float32.

    Returns:
        The trained parameters (float32).
    """
    config = FDAConfig(rule=rule, beta=beta, projection=Projection.EXACT)
    use_s = config.beta > 0.0
    use_t = not (config.rule is Rule.FEDDA and config.beta == 1.0)
    f32 = torch.float32
    params = [_t(p, f32).clone() for p in init]
    velocity = [torch.zeros_like(p) for p in params]
    x_s, x_t = _t(cell.x_source, f32), _t(cell.x_train, f32)
    source = (x_s, x_s.T.contiguous(), _t(cell.y_source, f32))
    target = (x_t, x_t.T.contiguous(), _t(cell.y_train, f32))
    for _ in range(iterations):
        g_s = [g.numpy() for g in _grads(params, *source)] if use_s else None
        g_t = [g.numpy() for g in _grads(params, *target)] if use_t else None
        if g_s is not None and g_t is not None:
            u = fda_aggregate(g_t, [g_s], betas=[config.beta], weights=[1.0], config=config).update
        else:
            u = g_s if g_t is None else g_t
        for p, v, g in zip(params, velocity, u):
            v.mul_(momentum).add_(torch.from_numpy(np.ascontiguousarray(g, dtype=np.float32)), alpha=lr)
            p.sub_(v, alpha=lr)
    return [p.numpy().copy() for p in params]
