"""FedDAR's synthetic domain-mixed linear regression (Sec. 5.1, App. B.3.1, Fig. 1), and reference
simulations of the linear experiments on the core FedDAR functions.

Data-generating process (n clients, M domains, input dimension d, representation dimension k):

* B* (d, k): Q-factor of the QR of an i.i.d. N(0, 1) matrix; W* (M, k): Q-factor of the QR of an
  i.i.d. N(0, 1) matrix, row m is the domain head w*_m (App. B.3.1);
* client mixtures pi_i ~ Dir(alpha p), p uniform over the M domains (inferred), alpha = 0.4
  (:class:`MixtureConcentration` also offers the Dir(alpha, ..., alpha) reading common in code);
* per sample: z ~ Cat(pi_i), x ~ N(0, I_d), y = (w*_z)^T (B*)^T x + eps, eps ~ N(0, sigma^2),
  sigma = 1e-3 read as a standard deviation (as in the FedRep code the paper adapted);
* training: L samples per client, fixed for the whole run; test: noise-free samples
  (100 per client, inferred). d = 20 is inferred (the paper does not state it).

The simulations (:func:`run_fig1`, :func:`run_algorithm2`) process all clients at once (stacked on a
leading client dimension) but call the same client- and server-side functions of
:mod:`flwr_pfl.core.feddar` a federated deployment calls, so they double as reference runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from flwr_pfl.core import feddar as core

if TYPE_CHECKING:  # the registry imports this module's builder: no import cycle at run time
    from flwr_pfl.data.config import DataConfig
    from flwr_pfl.data.registry import DatasetPool

__all__ = [
    "MixtureConcentration",
    "DomainMixedSamples",
    "DomainMixedLinearProblem",
    "FedDARSyntheticData",
    "make_domain_mixed_linear_problem",
    "make_feddar_synthetic",
    "Fig1Method",
    "Fig1Config",
    "Fig1Result",
    "run_fig1",
    "run_algorithm2",
]


class MixtureConcentration(str, Enum):
    """Dirichlet concentration vector of the client domain mixtures pi_i.

    ``ALPHA_TIMES_PRIOR`` (default): Dir(alpha p) with p a distribution over the M domains, the
    paper's notation (Sec. 5.1); with uniform p and alpha = 0.4 every entry is 0.08, so most
    clients hold mainly one domain.
    ``ALPHA_PER_DOMAIN``: Dir(alpha p M), i.e. alpha per domain for uniform p (0.4 each), the
    reading common in code; clients mix more domains with fewer samples each.
    """

    ALPHA_TIMES_PRIOR = "alpha_times_prior"
    ALPHA_PER_DOMAIN = "alpha_per_domain"


@dataclass(frozen=True)
class DomainMixedSamples:
    """Samples of every client, stacked: x (n, L, d), y (n, L), z (n, L) int64 domain labels."""

    x: Tensor
    y: Tensor
    z: Tensor

    def client_datasets(self) -> list[TensorDataset]:
        """One ``TensorDataset(x, y, z)`` per client, for the federated data layer."""
        return [TensorDataset(self.x[i], self.y[i], self.z[i]) for i in range(self.x.shape[0])]


@dataclass(frozen=True)
class DomainMixedLinearProblem:
    """Ground truth of the domain-mixed linear model: y = (w*_z)^T (B*)^T x + noise.

    Attributes:
        rep_star: B*, (d, k) with orthonormal columns.
        heads_star: W*, (M, k), row m is w*_m.
        mixtures: pi, (n, M), row i is client i's domain distribution.
    """

    rep_star: np.ndarray
    heads_star: np.ndarray
    mixtures: np.ndarray

    @property
    def num_clients(self) -> int:
        return self.mixtures.shape[0]

    @property
    def num_domains(self) -> int:
        return self.heads_star.shape[0]

    def sample(
        self,
        samples_per_client: int,
        noise_std: float,
        rng: np.random.Generator,
        dtype: torch.dtype = torch.float32,
    ) -> DomainMixedSamples:
        """Draw ``samples_per_client`` fresh samples for every client (z ~ Cat(pi_i), x ~ N(0, I))."""
        if samples_per_client < 1 or noise_std < 0:
            raise ValueError("samples_per_client must be >= 1 and noise_std >= 0")
        n, d = self.num_clients, self.rep_star.shape[0]
        cdf = np.cumsum(self.mixtures, axis=1)
        z = (rng.random((n, samples_per_client, 1)) > cdf[:, None, :]).sum(-1)
        z = np.minimum(z, self.num_domains - 1)
        x = rng.standard_normal((n, samples_per_client, d))
        coef = self.rep_star @ self.heads_star.T  # (d, M): column m is B* w*_m
        y = np.einsum("nld,nld->nl", x, coef.T[z]) + noise_std * rng.standard_normal((n, samples_per_client))
        return DomainMixedSamples(
            torch.as_tensor(x, dtype=dtype), torch.as_tensor(y, dtype=dtype), torch.as_tensor(z, dtype=torch.int64)
        )


@dataclass(frozen=True)
class FedDARSyntheticData:
    """The Fig. 1 dataset: ground truth plus fixed training and noise-free test samples."""

    problem: DomainMixedLinearProblem
    train: DomainMixedSamples
    test: DomainMixedSamples


def _orthonormal(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    q, _ = np.linalg.qr(rng.standard_normal((rows, cols)))
    return q


def make_domain_mixed_linear_problem(
    num_clients: int = 100,
    num_domains: int = 5,
    dim: int = 20,
    rep_dim: int = 2,
    alpha: float = 0.4,
    prior: np.ndarray | None = None,
    concentration: MixtureConcentration = MixtureConcentration.ALPHA_TIMES_PRIOR,
    rng: np.random.Generator | int = 0,
) -> DomainMixedLinearProblem:
    """Draw B*, W* (QR of Gaussian matrices) and mixtures pi_i ~ Dir(alpha * prior) (or
    Dir(alpha * prior * M), see :class:`MixtureConcentration`).

    Args:
        num_clients: n. num_domains: M. dim: d. rep_dim: k (<= min(d, M) for QR-normalised W*).
        alpha: Dirichlet concentration (0.4 in Fig. 1); prior: p over domains (uniform if None).
        concentration: how alpha and p form the Dirichlet parameter.
        rng: seed or numpy Generator.

    Returns:
        :class:`DomainMixedLinearProblem`.
    """
    rng = np.random.default_rng(rng)
    if not (1 <= rep_dim <= min(dim, num_domains)) or num_clients < 1 or alpha <= 0:
        raise ValueError(
            f"need num_clients >= 1, alpha > 0 and 1 <= rep_dim <= min(dim, num_domains); got "
            f"n={num_clients}, alpha={alpha}, k={rep_dim}, d={dim}, M={num_domains}"
        )
    prior = np.full(num_domains, 1.0 / num_domains) if prior is None else np.asarray(prior, dtype=float)
    if prior.shape != (num_domains,) or np.any(prior <= 0) or not np.isclose(prior.sum(), 1.0):
        raise ValueError(f"prior must be a positive distribution over {num_domains} domains")
    rep_star = _orthonormal(rng, dim, rep_dim)
    heads_star = _orthonormal(rng, num_domains, rep_dim)
    scale = alpha * (num_domains if MixtureConcentration(concentration) is MixtureConcentration.ALPHA_PER_DOMAIN else 1)
    mixtures = rng.dirichlet(scale * prior, size=num_clients)
    return DomainMixedLinearProblem(rep_star, heads_star, mixtures)


def make_feddar_synthetic(
    num_clients: int = 100,
    num_domains: int = 5,
    dim: int = 20,
    rep_dim: int = 2,
    samples_per_client: int = 10,
    test_samples_per_client: int = 100,
    alpha: float = 0.4,
    concentration: MixtureConcentration = MixtureConcentration.ALPHA_TIMES_PRIOR,
    noise_std: float = 1e-3,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> FedDARSyntheticData:
    """The FedDAR synthetic dataset (Fig. 1): fixed noisy training samples and noise-free test
    samples for every client, seeded.

    Defaults are the paper's (n=100, M=5, k=2, alpha=0.4, sigma=1e-3) with the inferred d=20,
    uniform prior and 100 test samples per client; samples_per_client (L) ranges over 5..20 in
    the paper. Training samples have shape x (n, L, d), y (n, L), z (n, L).
    """
    rng = np.random.default_rng(seed)
    problem = make_domain_mixed_linear_problem(
        num_clients, num_domains, dim, rep_dim, alpha, concentration=concentration, rng=rng
    )
    train = problem.sample(samples_per_client, noise_std, rng, dtype)
    test = problem.sample(test_samples_per_client, 0.0, rng, dtype)
    return FedDARSyntheticData(problem, train, test)


# --------------------------------------------------------------------------------------------
# Reference simulation of Fig. 1 (Algorithm 1 with a linear encoder, and the paper's baselines)
# --------------------------------------------------------------------------------------------


class Fig1Method(str, Enum):
    """Methods of Fig. 1: FedDAR-SA/WA and the baselines (Local-Only, FedAvg, FedRep, Separate FedAvg)."""

    FEDDAR_SA = "feddar_sa"
    FEDDAR_WA = "feddar_wa"
    FEDAVG = "fedavg"
    SEPARATE_FEDAVG = "separate_fedavg"
    FEDREP = "fedrep"
    LOCAL = "local"


@dataclass(frozen=True)
class Fig1Config:
    """Training choices of the reference simulation (the paper gives none; inferred defaults).

    Attributes:
        rounds: T communication rounds.
        rep_steps, rep_lr: local full-batch GD steps and learning rate on the representation
            (FedDAR phase R and FedRep), on the mean (FedDAR: u-re-weighted) squared loss.
        baseline_steps, baseline_lr: local GD steps and learning rate of FedAvg / Separate FedAvg
            (a d-dimensional linear model per model).
        init_scale: std of the random Gaussian initialisation of B (FedDAR, FedRep; heads use
            std 1) and init_scale / sqrt(d) for the d-dimensional FedAvg models.
        sa_options: options of FedDAR-SA's head aggregation.
        seed: initialisation seed.
    """

    rounds: int = 300
    rep_steps: int = 5
    rep_lr: float = 0.5
    baseline_steps: int = 5
    baseline_lr: float = 0.03
    init_scale: float = 1.0
    sa_options: core.SAOptions = field(default_factory=core.SAOptions)
    seed: int = 0


@dataclass(frozen=True)
class Fig1Result:
    """Final test MSE (mean over all clients' test samples) and its history per round (T,)."""

    test_mse: float
    history: np.ndarray


def _mse(pred: Tensor, target: Tensor) -> float:
    return float(((pred.reshape(target.shape) - target) ** 2).mean())


def _local_gd(params: Tensor, steps: int, lr: float, objective) -> Tensor:
    """``steps`` full-batch GD steps on every client's copy (n, ...) of ``params``; the objective
    returns per-client losses (n,), whose sum has independent per-client gradients."""
    params = params.detach().clone()
    for _ in range(steps):
        params.requires_grad_(True)
        (grad,) = torch.autograd.grad(objective(params).sum(), params)
        params = (params - lr * grad).detach()
    return params


def _local_rep_gd(
    rep: Tensor, x: Tensor, y: Tensor, sample_heads: Tensor, sample_weights: Tensor, steps: int, lr: float
) -> Tensor:
    """Local full-batch GD on a linear encoder B for every client, heads frozen, in closed form:
    the loss (1/L) sum_j c_j (x_j^T B w_j - y_j)^2 has gradient (2/L) sum_j c_j r_j x_j w_j^T.
    With c_j = u_{z_j} and w_j = w_{z_j} it is :func:`core.reweighted_loss` of the squared errors.

    Args: rep B (d, k); x (n, L, d); y (n, L); sample_heads (n, L, k); sample_weights (n, L).
    Returns: the clients' encoders (n, d, k).
    """
    reps = rep.expand(x.shape[0], *rep.shape).clone()
    weighted_heads = sample_heads * sample_weights[..., None] * (2.0 / x.shape[1])
    for _ in range(steps):
        resid = ((x @ reps) * sample_heads).sum(-1) - y
        reps -= lr * x.transpose(1, 2) @ (resid[..., None] * weighted_heads)
    return reps


def _feddar_round(
    rep: Tensor, heads: Tensor, data: FedDARSyntheticData, u: np.ndarray, agg: core.HeadAggregation, cfg: Fig1Config
) -> tuple[Tensor, Tensor]:
    """One FedDAR round (Algorithm 1): exact local heads on frozen features, WA/SA, then local GD
    on the encoder with the u-re-weighted loss and the L_i-weighted encoder average."""
    x, y, z = data.train.x, data.train.y, data.train.z
    num_domains, k = heads.shape
    layout = core.HeadLayout(1, k)
    feats = x @ rep
    local = core.local_least_squares_heads(feats, y, z, heads, layout)
    counts = core.domain_counts(z, num_domains)
    hessians = None
    if agg is core.HeadAggregation.SA:
        point = core.hessian_point(core.HessianAt.LOCAL, local, heads)
        hessians = core.head_statistics(feats, y, z, point, layout, core.HeadLoss.SQUARED).hessians.numpy()
    new_heads = core.aggregate_heads(agg, local.numpy(), counts.numpy(), heads.numpy(), hessians, cfg.sa_options).heads
    heads = torch.as_tensor(new_heads, dtype=x.dtype)  # SA solves in float64; the model keeps the data's precision

    u_z = torch.as_tensor(u, dtype=x.dtype)[z]
    reps = _local_rep_gd(rep, x, y, heads[z], u_z, cfg.rep_steps, cfg.rep_lr)
    (rep,) = core.aggregate_encoder([[r] for r in reps.numpy()], counts.sum(-1).numpy())
    return torch.as_tensor(rep), heads


def run_fig1(method: Fig1Method, data: FedDARSyntheticData, config: Fig1Config = Fig1Config()) -> Fig1Result:
    """Train one Fig. 1 method on ``data`` (float64 recommended) and report the test MSE.

    * FedDAR-SA / FedDAR-WA: Algorithm 1 with a linear encoder B (d, k) and M linear heads; local
      heads are the exact local least-squares minimisers nearest to the global head (the limit of
      long local head training; WA only fails in this regime, spec 7.1), SA Hessians
      (2/L_{i,m}) P^T P with weights L_{i,m}; encoder by local GD on the u-re-weighted loss.
    * FedAvg: one d-dimensional linear model, local GD, L_i-weighted averaging.
    * Separate FedAvg: one FedAvg model per domain (local domain-mean losses, L_{i,m} weights);
      a convex problem that converges to per-domain pooled least squares (~1e-7 at L = 10).
    * FedRep: shared B, per-client heads kept locally (exact local least squares), local GD on B.
    * Local: per-client minimum-norm least squares.

    Each client predicts with its personalised predictor (FedDAR: B w_z; FedRep: B w_i).
    """
    method = Fig1Method(method)
    x, y, z = data.train.x, data.train.y, data.train.z
    xt, yt, zt = data.test.x, data.test.y, data.test.z
    n, _, d = x.shape
    num_domains, k = data.problem.heads_star.shape
    gen = torch.Generator().manual_seed(config.seed)
    dtype = x.dtype
    history = np.empty(config.rounds)
    sq = core.HeadLoss.SQUARED
    counts = core.domain_counts(z, num_domains)

    if method is Fig1Method.LOCAL:
        zero = torch.zeros_like(z)
        heads = core.local_least_squares_heads(x, y, zero, torch.zeros(n, 1, d, dtype=dtype), core.HeadLayout(1, d))
        mse = _mse(core.head_outputs(xt, torch.zeros_like(zt), heads, core.HeadLayout(1, d)), yt)
        return Fig1Result(mse, np.full(config.rounds, mse))

    rep = config.init_scale * torch.randn(d, k, generator=gen, dtype=dtype)
    if method in (Fig1Method.FEDDAR_SA, Fig1Method.FEDDAR_WA):
        agg = core.HeadAggregation.SA if method is Fig1Method.FEDDAR_SA else core.HeadAggregation.WA
        heads = torch.randn(num_domains, k, generator=gen, dtype=dtype)
        u = core.domain_weights(counts.numpy())
        layout = core.HeadLayout(1, k)
        for t in range(config.rounds):
            rep, heads = _feddar_round(rep, heads, data, u, agg, config)
            history[t] = _mse(core.head_outputs(xt @ rep, zt, heads, layout), yt)
        return Fig1Result(float(history[-1]), history)

    if method is Fig1Method.FEDREP:
        layout, zero, zero_t = core.HeadLayout(1, k), torch.zeros_like(z), torch.zeros_like(zt)
        heads = torch.randn(n, 1, k, generator=gen, dtype=dtype)  # one local head per client
        for t in range(config.rounds):
            heads = core.local_least_squares_heads(x @ rep, y, zero, heads, layout)

            sample_heads = heads[:, 0, None, :].expand(n, x.shape[1], k)  # client i's own head
            reps = _local_rep_gd(rep, x, y, sample_heads, torch.ones_like(y), config.rep_steps, config.rep_lr)
            rep = torch.as_tensor(core.aggregate_encoder([[r] for r in reps.numpy()], counts.sum(-1).numpy())[0])
            history[t] = _mse(core.head_outputs(xt @ rep, zero_t, heads, layout), yt)
        return Fig1Result(float(history[-1]), history)

    # FedAvg (one model, every sample in "domain" 0) or Separate FedAvg (one model per domain),
    # both as d-dimensional linear "heads" on the raw input, trained with the head-phase loss.
    separate = method is Fig1Method.SEPARATE_FEDAVG
    groups, groups_t = (z, zt) if separate else (torch.zeros_like(z), torch.zeros_like(zt))
    num_models = num_domains if separate else 1
    table = core.domain_counts(groups, num_models).numpy()
    layout = core.HeadLayout(1, d)
    models = config.init_scale * torch.randn(num_models, d, generator=gen, dtype=dtype) / np.sqrt(d)

    def objective(local: Tensor) -> Tensor:
        out = core.head_outputs(x, groups, local, layout)
        return core.head_phase_loss(core.per_sample_loss(out, y, sq), groups, num_models)

    for t in range(config.rounds):
        local = _local_gd(models.expand(n, num_models, d), config.baseline_steps, config.baseline_lr, objective)
        models = torch.as_tensor(core.aggregate_heads_wa(local.numpy(), table, models.numpy()))
        history[t] = _mse(core.head_outputs(xt, groups_t, models, layout), yt)
    return Fig1Result(float(history[-1]), history)


# --------------------------------------------------------------------------------------------
# Reference simulation of Algorithm 2 (App. A.2)
# --------------------------------------------------------------------------------------------


def run_algorithm2(
    problem: DomainMixedLinearProblem,
    rounds: int = 100,
    samples_per_client: int = 20,
    init_samples_per_client: int = 20,
    lr: float = 1.0,
    noise_std: float = 1e-3,
    seed: int = 0,
) -> np.ndarray:
    """Run Algorithm 2 exactly: spectral initialisation, then per round fresh samples for the
    server-side exact head solve, fresh samples for the domain-balanced B gradient step, and QR.

    Returns:
        dist(B^t, B*) for t = 0..rounds, float64 array (rounds + 1,).
    """
    rng = np.random.default_rng(seed)
    num_domains, k = problem.heads_star.shape
    n = problem.num_clients
    init = problem.sample(init_samples_per_client, noise_std, rng, torch.float64)
    rep = core.spectral_init(core.spectral_statistic(init.x, init.y).numpy(), n * init_samples_per_client, k)
    heads = np.zeros((num_domains, k))
    dist = [core.principal_angle_distance(rep, problem.rep_star)]
    for _ in range(rounds):
        batch = problem.sample(samples_per_client, noise_std, rng, torch.float64)
        stats = core.linear_head_statistics(batch.x, batch.y, batch.z, rep, num_domains)
        heads = core.solve_linear_heads(stats.gram.numpy(), stats.moment.numpy(), stats.counts.numpy(), heads)
        batch = problem.sample(samples_per_client, noise_std, rng, torch.float64)
        grads, counts = core.linear_representation_gradient(batch.x, batch.y, batch.z, rep, heads)
        rep = core.representation_step(rep, grads.numpy(), counts.numpy(), lr)
        dist.append(core.principal_angle_distance(rep, problem.rep_star))
    return np.asarray(dist)


# --------------------------------------------------------------------------------------------
# The Fig. 1 problem as a registered dataset ("feddar-synthetic") for the federated pipeline
# --------------------------------------------------------------------------------------------

#: samples in the "feddar-synthetic" pool (enough for 100 clients x 110 samples at any mixture)
SYNTHETIC_POOL_SIZE = 60_000


def feddar_synthetic_pool(config: DataConfig) -> DatasetPool:
    """Builder of the registered dataset ``feddar-synthetic``: the Fig. 1 linear problem as a pool.

    Ground truth B* (d=20, k=2) and W* (M=5) are drawn from ``config.seed`` exactly as
    :func:`make_domain_mixed_linear_problem` draws them; the pool holds
    :data:`SYNTHETIC_POOL_SIZE` samples with z uniform over the M domains, x ~ N(0, I_d) and
    y = (w*_z)^T (B*)^T x + eps, eps ~ N(0, 1e-6) (sigma = 1e-3 as a standard deviation).

    The pool also keeps the noise-free targets y - eps (``DatasetPool.noise_free_y``).

    Clients get the paper's per-client mixtures through the ``domain-mixture`` partitioner:
    pi_i ~ Dir(domain-alpha * p) with p the pool's (uniform) domain shares, exactly
    ``samples-per-client`` samples each, drawn without replacement. Each client's test split
    (``test-fraction``) comes from the same mixture. By default its targets carry the
    sigma = 1e-3 noise like the training ones, so the test MSE has a floor of sigma^2 = 1e-6;
    with the run key ``noise-free-test = true`` they are the noise-free targets, as in the
    paper's test set (the training and validation targets stay noisy).
    """
    from flwr_pfl.data.registry import DatasetPool  # noqa: F811 (run-time import, see above)

    rng = np.random.default_rng(config.seed)
    problem = make_domain_mixed_linear_problem(num_clients=1, rng=rng)
    z = rng.integers(0, problem.num_domains, SYNTHETIC_POOL_SIZE)
    x = rng.standard_normal((SYNTHETIC_POOL_SIZE, problem.rep_star.shape[0]))
    coef = problem.rep_star @ problem.heads_star.T  # (d, M)
    clean = np.einsum("nd,nd->n", x, coef.T[z])
    y = clean + 1e-3 * rng.standard_normal(SYNTHETIC_POOL_SIZE)
    return DatasetPool(
        x=torch.as_tensor(x, dtype=torch.float32),
        y=torch.as_tensor(y, dtype=torch.float32),
        domain=torch.as_tensor(z, dtype=torch.int64),
        num_classes=0,
        num_domains=problem.num_domains,
        task="regression",
        noise_free_y=torch.as_tensor(clean, dtype=torch.float32),
    )


def register_feddar_synthetic() -> None:
    """Make ``dataset = "feddar-synthetic"`` valid (idempotent)."""
    from flwr_pfl.data.registry import available_datasets, register_dataset

    if "feddar-synthetic" not in available_datasets():
        register_dataset("feddar-synthetic", feddar_synthetic_pool, noise_free_targets=True)
